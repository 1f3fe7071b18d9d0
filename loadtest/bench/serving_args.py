"""``prefixmesh serving-bench``'s options (``serving.py`` parses them): the workload and
cluster each run plays on, then what each run varies and measures."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from prefixmesh.cli_help import add_overrides
from prefixmesh.router.policy import POLICY_NAMES


def add_workload_args(parser: argparse.ArgumentParser, model_sizes: Iterable[str]) -> None:
    """The engine, the fleet and the workload every run plays."""
    parser.add_argument(
        "--engine", choices=["vllm", "sim"], default="vllm", help="the replicas' engine"
    )
    parser.add_argument(
        "--workload",
        choices=["groups", "burst"],
        default="groups",
        help="groups: Poisson requests over shared prefixes; burst: bursts of --burst-size "
        "requests sharing a fresh --group-tokens prefix within 5 ms (delay-hit holds)",
    )
    parser.add_argument(
        "--burst-size", type=int, default=8, help="burst workload: requests per burst"
    )
    parser.add_argument("--replicas", type=int, default=2, help="replicas in the cluster")
    parser.add_argument("--groups", type=int, default=8, help="groups workload: shared prefixes")
    parser.add_argument(
        "--group-tokens", type=int, default=1500, help="tokens of each shared prefix"
    )
    parser.add_argument(
        "--question-tokens", type=int, default=64, help="tokens of each request's own suffix"
    )
    parser.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        help="Zipf exponent of the groups' popularity; 0: equally popular",
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per policy")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="engine KV cache per replica, in tokens (default: none, half the groups' prefixes "
        "plus --running-room prompts)",
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(model_sizes),
        default="tiny",
        help="the demo model's size (vllm engine)",
    )
    parser.add_argument(
        "--running-room",
        type=int,
        default=2,
        help="prompts the default KV size leaves room for, beyond the prefixes",
    )


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The runs (policies or variants), the overhead measurement and the output."""
    parser.add_argument(
        "--policies",
        default="prefixmesh,pow2",
        help=f"routing policies, comma-separated, of {', '.join(POLICY_NAMES)}; one run each",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="each request's time limit, in s"
    )
    add_overrides(parser, help="override a config field for every run; repeatable")
    parser.add_argument(
        "--variant",
        dest="variants",
        nargs="+",
        action="append",
        metavar=("LABEL", "KEY=VALUE"),
        help="instead of --policies: a row named LABEL with these settings; repeatable",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="registry in a redis-server started on loopback (default: the in-process one)",
    )
    parser.add_argument(
        "--overhead",
        type=int,
        default=0,
        metavar="N",
        help="instead: measure what the serving path adds (latency and CPU), N samples; 0: off",
    )
    parser.add_argument(
        "--overhead-paths",
        default="direct,proxy",
        help="with --overhead: serving paths to measure side by side, comma-separated, of "
        "direct, proxy",
    )
    parser.add_argument("--json", type=Path, help="write the results here (default: none)")
