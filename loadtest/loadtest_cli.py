"""``prefixmesh loadtest``: a locust load test with open-loop arrivals, bounded, with a report.

Runs ``loadtest/locustfile.py`` headless in its own process (locust monkey-patches the standard
library with gevent and cannot share a process with Ray or pytest), bounded by the arrival window
plus a drain time and by a request count, then leaves in ``--report``: ``report.json``,
``report.md``, ``ttft_cdf.png``, ``timeline.png``, the per-request ``records.jsonl``, and
locust's own ``locust_*.csv``, ``locust.html`` and ``locust.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from prefixmesh.cli_help import command_parser
from prefixmesh.loadtest.cli_args import add_source_args
from prefixmesh.loadtest.fit import context_length, failed_run, plan_fit
from prefixmesh.loadtest.plan import PlanSettings, build_plan, parse_params

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_TARGET = "http://127.0.0.1:8000"


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="base URL of an OpenAI-compatible server; a non-loopback URL is used only because "
        "you passed it",
    )
    add_source_args(parser)
    parser.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals per second, required for a workload; a trace is rescaled to this "
        "mean rate (default: none: a trace plays at its own timestamps)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="arrival window, in s")
    parser.add_argument("--requests", type=int, default=100_000, help="at most this many requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    parser.add_argument(
        "--api", choices=("completions", "chat"), default="completions", help="the OpenAI API"
    )
    parser.add_argument(
        "--prompt-format",
        choices=("text", "tokens"),
        default="text",
        help="text: words that are single tokens of the model's tokenizer (every router and "
        "server accepts text; text-matching routers need it); tokens: the same ids",
    )
    parser.add_argument("--model", default="demo-tiny", help="the model name to send")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="cap on each request's output tokens; 0: the workload's own lengths, uncapped",
    )
    parser.add_argument("--tokenizer", help="tokenizer folder (default: none, the demo model's)")
    parser.add_argument(
        "--connections",
        choices=("fresh", "reuse"),
        default="fresh",
        help="fresh: a connection per request (see the locustfile); reuse: keep-alive",
    )
    parser.add_argument(
        "--drain",
        type=float,
        default=60.0,
        help="after the arrival window, wait this long for requests in flight, in s",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="each request's time limit, in s"
    )
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        help="a replica's /metrics URL, repeatable: the hit rate from its prefix-cache counters",
    )
    parser.add_argument("--report", type=Path, required=True, help="folder for the report")
    parser.add_argument(
        "--max-failure-share",
        type=float,
        default=0.05,
        help="exit 1 with the first error when more than this share of requests fail, in [0, 1)",
    )
    parser.add_argument(
        "--web",
        type=int,
        metavar="PORT",
        help="show locust's web UI on 127.0.0.1:PORT while the run plays, starting at once "
        "(default: none, headless)",
    )
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.workload and not args.rate:
        parser.error("--workload needs --rate")
    if not 0 <= args.max_failure_share < 1:
        parser.error("--max-failure-share must be in [0, 1)")
    for name in ("rate", "duration", "requests", "drain", "timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be > 0")


def locust_command(args: argparse.Namespace) -> list[str]:
    run_time = int(args.duration + args.drain + 30 + (60 if args.web else 0))
    report = args.report.resolve()
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
        "--host", args.target,
        "-u", "1", "-r", "1", "-t", f"{run_time}s",
        "--stop-timeout", "10",
        "--csv", str(report / "locust"),
        "--html", str(report / "locust.html"),
        "--exit-code-on-error", "0",
        "--loglevel", "WARNING",
        "--pm-rate", str(args.rate or 0),
        "--pm-duration", str(args.duration),
        "--pm-requests", str(args.requests),
        "--pm-seed", str(args.seed),
        "--pm-api", args.api,
        "--pm-prompt-format", args.prompt_format,
        "--pm-model", args.model,
        "--pm-max-tokens", str(args.max_tokens),
        "--pm-connections", args.connections,
        "--pm-drain", str(args.drain),
        "--pm-timeout", str(args.timeout),
        "--pm-metrics-urls", ",".join(args.metrics_url),
        "--pm-report-dir", str(report),
    ]  # fmt: skip
    if args.trace is not None:
        command += ["--pm-trace", str(args.trace.resolve()), "--pm-trace-format", args.trace_format]
    else:
        command += ["--pm-workload", args.workload]
    if args.param:
        command += ["--pm-params", ",".join(args.param)]
    if args.tokenizer:
        command += ["--pm-tokenizer", str(Path(args.tokenizer).resolve())]
    if args.web:
        command += ["--web-host", "127.0.0.1", "--web-port", str(args.web), "--autostart"]
        command += ["--pm-quit-after", "60", "--autoquit", "5"]
    else:
        command += ["--headless", "--only-summary"]
    return command


def run_locust(command: list[str], log: Path, timeout_s: float) -> int:
    """Run locust in its own process group; past ``timeout_s`` stop it (and only it) by PID."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return 124


def main(argv: list[str], prog: str = "loadtest") -> int:
    args = parse_args(argv, prog)
    for url in (args.target, *args.metrics_url):
        if not is_loopback(url):
            print(f"{prog}: {url} is not a loopback address; using it as you asked", flush=True)
    refusal = check_fit(args)
    if refusal is not None:
        print(f"{prog}: refusing to run: {refusal}", flush=True)
        return 2
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / "report.json").unlink(missing_ok=True)
    command = locust_command(args)
    if args.web:
        print(f"{prog}: locust web UI on http://127.0.0.1:{args.web}", flush=True)
    started = time.monotonic()
    bound = args.duration + args.drain + (180 if args.web else 120)
    rc = run_locust(command, args.report / "locust.log", bound)
    report_path = args.report / "report.json"
    if not report_path.exists():
        tail = (args.report / "locust.log").read_text(errors="replace")[-3000:]
        print(f"{prog}: locust exited {rc} without a report; its log ends:\n{tail}")
        return 1
    report = json.loads(report_path.read_text())
    keys = ("requests", "failures", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "throughput_tok_s")
    keys += ("hit_rate", "arrival_cv", "launch_drift_p99_ms")
    print(json.dumps({k: report.get(k) for k in keys}))
    print(f"{prog}: report in {args.report} ({time.monotonic() - started:.0f} s)")
    with (args.report / "records.jsonl").open() as lines:
        failed = failed_run((json.loads(line) for line in lines), args.max_failure_share)
    if failed is not None:
        print(f"{prog}: the run failed: {failed}", flush=True)
        return 1
    return 0


def check_fit(args: argparse.Namespace) -> str | None:
    """Why the plan cannot run against the target (None: it fits, or the target does not say
    its context length)."""
    try:
        response = httpx.get(f"{args.target.rstrip('/')}/v1/models", timeout=10)
        max_model_len = context_length(response.json(), args.model)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"{args.target}/v1/models unreadable ({exc}); not checking the context length")
        return None
    if max_model_len is None:
        return None
    try:
        params = parse_params(args.param)
    except ValueError as exc:
        return str(exc)
    settings = PlanSettings(
        workload=None if args.trace else args.workload,
        trace=str(args.trace) if args.trace else None,
        trace_format=None if args.trace_format == "auto" else args.trace_format,
        params=params,
        rate=args.rate,
        requests=args.requests,
        duration_s=args.duration,
        seed=args.seed,
    )
    try:
        plan = build_plan(settings)
    except ValueError as exc:  # a workload field or a trace it cannot read
        return str(exc)
    fit = plan_fit(plan, max_model_len, args.max_tokens or None)
    return None if fit.fits else fit.explain()
