"""``prefixmesh tenant-bench``: two tenants on the sim cluster, side by side (issue 17's targets).

A light tenant sends Poisson arrivals at ``--light-rate``; a heavy tenant at ``--heavy-factor``
times that, enough to saturate the replicas. Each scenario deploys the cluster on a local Ray
with API keys for both, plays the same seeded schedule and reads each request's TTFT from its
stream (the first event with text):

- ``alone``: the light tenant alone (the reference);
- ``fifo``: both, admitted in arrival order (no fair share, no quotas);
- ``fair``: both, ``replica.fair_share`` on (``fair:2048``: with that prefill budget);
- ``quota``: both, the heavy tenant's ``tokens_per_minute`` a tenth of what it asks for;
- ``quota+fair``: both of the last two (what the quota lets in still waits its fair turn).

Printed and written (``--json``): per scenario and tenant the requests, answers by status, TTFT
p50/p99/mean, and the light tenant's p99 over its ``alone`` p99. ``--checks N`` also times the
API-key and quota checks themselves (in process, N sequential requests, the in-process store and
a Redis on loopback) and a 10 MB body's refusal through the front door.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefixmesh.cli_help import add_overrides, command_parser
from prefixmesh.config import load_config
from prefixmesh.loadtest.local_redis import LocalRedisServer
from prefixmesh.loadtest.poisson import exponential_arrivals, percentile
from prefixmesh.local_ray import configure_environment, init_local_ray, stop_haproxy
from prefixmesh.ports import free_port

KEYS = {"light": "sk-bench-light", "heavy": "sk-bench-heavy"}
SCENARIOS = ("alone", "fifo", "fair", "quota", "quota+fair")
"""What ``--scenarios`` may name (``scenarios``); ``fair`` and ``quota+fair`` take ``:N``."""
VOCAB_LOW, VOCAB_HIGH = 300, 8000
"""Ordinary merged tokens of the demo vocabulary: random prompts share no prefix."""


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    tenant: str
    prompt: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Outcome:
    tenant: str
    status: int
    ttft_s: float | None


@dataclass(frozen=True, slots=True)
class TenantRow:
    scenario: str
    tenant: str
    requests: int
    ok: int
    rate_limited: int
    other_errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    p99_vs_alone: float | None = None


def schedule(args: argparse.Namespace, tenants: tuple[str, ...]) -> list[Arrival]:
    """The seeded arrivals of ``tenants`` over ``--duration-s`` (the same in every scenario)."""
    arrivals: list[Arrival] = []
    for tenant in tenants:
        rate = args.light_rate * (args.heavy_factor if tenant == "heavy" else 1)
        count = max(1, round(rate * args.duration_s))
        rng = random.Random(f"{args.seed}/{tenant}/prompts")
        for at in exponential_arrivals(rate, count, zlib.crc32(f"{args.seed}/{tenant}".encode())):
            prompt = tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(args.prompt_tokens))
            arrivals.append(Arrival(at, tenant, prompt))
    return sorted(arrivals, key=lambda a: a.at_s)


async def _one(client: Any, model: str, arrival: Arrival, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": list(arrival.prompt), "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {KEYS[arrival.tenant]}"}
    started = time.perf_counter()
    ttft: float | None = None
    try:
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(arrival.tenant, response.status_code, None)
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - started
    except Exception:
        return Outcome(arrival.tenant, 0, None)
    return Outcome(arrival.tenant, 200, ttft)


async def play(
    url: str, model: str, arrivals: list[Arrival], args: argparse.Namespace
) -> list[Outcome]:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def scheduled(arrival: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
            return await _one(client, model, arrival, args.max_tokens)

        return list(await asyncio.gather(*(scheduled(a) for a in arrivals)))


def rows_of(scenario: str, outcomes: list[Outcome]) -> list[TenantRow]:
    rows = []
    for tenant in sorted({o.tenant for o in outcomes}):
        mine = [o for o in outcomes if o.tenant == tenant]
        ttfts = [o.ttft_s * 1000 for o in mine if o.status == 200 and o.ttft_s is not None]
        rows.append(
            TenantRow(
                scenario,
                tenant,
                len(mine),
                sum(o.status == 200 for o in mine),
                sum(o.status == 429 for o in mine),
                sum(o.status not in (200, 429) for o in mine),
                round(percentile(ttfts, 0.5), 1),
                round(percentile(ttfts, 0.99), 1),
                round(statistics.fmean(ttfts), 1) if ttfts else float("nan"),
            )
        )
    return rows


def scenarios(args: argparse.Namespace) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(label, tenants, overrides) of each scenario asked for."""
    asked_tokens = args.light_rate * args.heavy_factor * 60 * (args.prompt_tokens + args.max_tokens)
    quota = max(1, round(asked_tokens / 10))
    table = {
        "alone": (("light",), []),
        "fifo": (("light", "heavy"), []),
        "fair": (("light", "heavy"), ["replica.fair_share.enabled=true"]),
        "quota": (("light", "heavy"), [f"quotas.tenants.heavy.tokens_per_minute={quota}"]),
    }
    table["quota+fair"] = (("light", "heavy"), table["quota"][1] + table["fair"][1])
    rows = []
    for label in args.scenarios.split(","):
        name, _, budget = label.partition(":")  # fair:2048: fair share with that budget
        tenants, extra = table[name]
        if budget:
            extra = [*extra, f"replica.fair_share.prefill_budget_tokens={int(budget)}"]
        rows.append((label, tenants, extra))
    return rows


def _deploy_and_play(
    overrides: list[str], url: str, arrivals: list[Arrival], args: argparse.Namespace
) -> list[Outcome]:
    from ray import serve

    from prefixmesh.app import build_app

    config = load_config(overrides=overrides)
    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    try:
        warm = [Arrival(0.0, "light", (VOCAB_LOW,) * 8)]
        asyncio.run(play(url, config.model, warm, args))
        return asyncio.run(play(url, config.model, arrivals, args))
    finally:
        serve.delete(config.app_name)


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--replicas", type=int, default=1, help="sim replicas in the cluster")
    parser.add_argument(
        "--light-rate", type=float, default=1.0, help="the light tenant's requests per second"
    )
    parser.add_argument(
        "--heavy-factor",
        type=float,
        default=10.0,
        help="the heavy tenant's rate over the light tenant's",
    )
    parser.add_argument("--duration-s", type=float, default=60.0, help="arrival window, in s")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument(
        "--scenarios",
        default="alone,fifo,fair,quota",
        help=f"comma-separated, in run order, of {', '.join(SCENARIOS)}; fair:N and "
        "quota+fair:N set the fair share's prefill budget to N tokens",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="each request's time limit, in s (also ingress.request_timeout_s)",
    )
    parser.add_argument(
        "--checks",
        type=int,
        default=0,
        metavar="N",
        help="also time the API-key and quota checks over N sequential requests and a 10 MB "
        "body's refusal; 0: off",
    )
    add_overrides(parser, help="override a config field for every scenario; repeatable")
    parser.add_argument("--json", type=Path, help="write the results here (default: none)")
    args = parser.parse_args(argv)
    unknown = {label.partition(":")[0] for label in args.scenarios.split(",")} - set(SCENARIOS)
    if unknown:
        parser.error(f"--scenarios: unknown {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    return args


def main(argv: list[str], prog: str = "prefixmesh tenant-bench") -> int:
    from prefixmesh.loadtest.bench.tenant_checks import time_big_body, time_checks

    args = parse_args(argv, prog)
    port = free_port()
    temp_dir = Path(tempfile.mkdtemp(prefix="pmtenants-", dir="/tmp"))
    keys_file = temp_dir / "keys.txt"
    keys_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    base = [
        "replica.engine=sim",
        f"replica.num_replicas={args.replicas}",
        f"ingress.port={port}",
        f"auth.api_keys_file={keys_file}",
        f"ingress.request_timeout_s={args.timeout_s}",
        *args.overrides,
    ]
    haproxy_dir = configure_environment(load_config(overrides=base).serving)
    import ray
    from ray import serve

    init_local_ray(str(temp_dir / "ray"))
    rows: list[TenantRow] = []
    checks: dict[str, Any] = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        alone_p99: float | None = None
        for label, tenants, extra in scenarios(args):
            outcomes = _deploy_and_play([*base, *extra], url, schedule(args, tenants), args)
            for row in rows_of(label, outcomes):
                if row.tenant == "light":
                    if label == "alone":
                        alone_p99 = row.ttft_p99_ms
                    elif alone_p99:
                        row = TenantRow(
                            **{**asdict(row), "p99_vs_alone": round(row.ttft_p99_ms / alone_p99, 2)}
                        )
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
        if args.checks:
            with LocalRedisServer() as redis:
                checks = time_checks(args.checks, keys_file, redis)
            checks["big_body"] = time_big_body(load_config(overrides=base), url, 5)
            print(json.dumps(checks), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        if haproxy_dir is not None:
            stop_haproxy(haproxy_dir)
            shutil.rmtree(haproxy_dir, ignore_errors=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
    if args.json:
        summary = {
            "args": vars(args) | {"json": str(args.json)},
            "rows": [asdict(r) for r in rows],
            "checks": checks,
        }
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
