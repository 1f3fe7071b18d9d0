"""The ``prefixmesh`` console script: each subcommand's module is imported only when it runs.

Every subcommand module provides ``main(argv) -> int`` and parses its own arguments, so
``prefixmesh COMMAND --help`` shows them and a light command never imports a heavy one.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "prefixmesh.serve_cli",
        "start Ray on 127.0.0.1 (or join --address) and deploy the cluster",
    ),
    "make-demo-model": (
        "prefixmesh.replica.demo_model",
        "build the random-weight demo Llama and its tokenizer, offline",
    ),
    "serving-bench": (
        "prefixmesh.loadtest.bench.serving",
        "the real cluster under each routing policy: TTFT and hit rate side by side",
    ),
    "registry-bench": (
        "prefixmesh.loadtest.bench.registry",
        "registry lookup latency, publish throughput and memory per entry",
    ),
    "freshness-bench": (
        "prefixmesh.loadtest.bench.freshness",
        "lag from a replica storing or evicting blocks to the Redis registry showing it",
    ),
    "kernels-bench": (
        "prefixmesh.loadtest.bench.kernels",
        "GPU: KV block gather/scatter vs per-block copies vs the pinned-copy ceiling (GB/s)",
    ),
    "tier-bench": (
        "prefixmesh.loadtest.bench.tier",
        "vLLM TTFT without and with the KV connector's CPU and disk tiers",
    ),
    "store-bench": (
        "prefixmesh.loadtest.bench.store",
        "GPU: the KV connector's CPU-tier store and load path vs the pinned-copy ceiling (GB/s)",
    ),
    "policy-bench": (
        "prefixmesh.loadtest.bench.policy",
        "time of one routing decision per policy at 64 replicas",
    ),
    "simulate": (
        "prefixmesh.loadtest.cluster_sim_cli",
        "compare routing policies on a simulated fleet (discrete events, no GPU)",
    ),
    "cache-sim": (
        "prefixmesh.loadtest.cache_sim_cli",
        "replay a trace or workload through the hierarchical cache policies: hit rate, writes",
    ),
    "tenant-bench": (
        "prefixmesh.loadtest.bench.tenants",
        "two tenants on the sim cluster: fair share and quotas against running alone",
    ),
    "stream-bench": (
        "prefixmesh.loadtest.bench.stream",
        "streamed completions: client-side gaps between events next to the engine's own",
    ),
    "replica-server": (
        "prefixmesh.replica.serving.standalone_server",
        "one replica's engine (sim or vllm) behind the OpenAI API on 127.0.0.1",
    ),
    "loadtest": (
        "prefixmesh.loadtest.loadtest_cli",
        "locust load test with open-loop Poisson (or trace) arrivals; report and plots",
    ),
    "compare": (
        "prefixmesh.loadtest.compare",
        "prefixmesh vs Ray Serve's routers vs sglang-router vs vllm-router on the same replicas",
    ),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: prefixmesh COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "prefixmesh COMMAND --help shows a command's arguments."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command = SUBCOMMANDS.get(args[0])
    if command is None:
        print(f"prefixmesh: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command[0])
    return int(module.main(args[1:], prog=f"prefixmesh {args[0]}"))


if __name__ == "__main__":
    sys.exit(main())
