"""Options the load-generating CLIs share (``simulate``, ``cache-sim``, ``loadtest``,
``compare``): where the requests come from, and the config they run under."""

from __future__ import annotations

import argparse
from pathlib import Path

from prefixmesh.cli_help import add_overrides
from prefixmesh.loadtest.traces import TRACE_FORMATS
from prefixmesh.loadtest.workloads import WORKLOADS


def add_source_args(parser: argparse.ArgumentParser) -> None:
    """``--workload`` or ``--trace`` (one of them, required), ``--trace-format`` and the
    workload's ``--param`` settings."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a synthetic workload")
    source.add_argument("--trace", type=Path, help="a Mooncake or Qwen-Bailian JSONL trace")
    parser.add_argument(
        "--trace-format",
        choices=("auto", *TRACE_FORMATS),
        default="auto",
        help="the trace's format; auto: read from its first record",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a workload parameter, e.g. system_prompt_tokens=4096; repeatable",
    )


def add_config_args(parser: argparse.ArgumentParser, read: str, set_dest: str) -> None:
    """``--config`` (a YAML file, of which the command reads ``read``) and ``--set`` overrides,
    kept in ``args.<set_dest>``."""
    parser.add_argument(
        "--config",
        type=Path,
        help=f"prefixmesh YAML config, {read} (default: none, the embedded defaults)",
    )
    add_overrides(parser, dest=set_dest)
