"""``prefixmesh simulate`` end to end on small runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefixmesh.cli import SUBCOMMANDS
from prefixmesh.config import RoutingConfig
from prefixmesh.loadtest import cluster_sim_cli
from prefixmesh.loadtest.metrics import SUMMARY_KEYS
from prefixmesh.router.policy.base import RoutingPolicy
from tests.unit.loadtest.policies import LongestHit, RoundRobin


def tiny_policies(
    name: str, config: RoutingConfig, *, rng: random.Random, block_size: int
) -> RoutingPolicy:
    return {"rr": RoundRobin, "hit": LongestHit}[name]()  # type: ignore[return-value]


def test_subcommand_is_registered() -> None:
    assert SUBCOMMANDS["simulate"][0] == "prefixmesh.loadtest.cluster_sim_cli"


def test_workload_run_writes_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "out.json", tmp_path / "ttft.png"
    argv = [
        "--workload", "groups", "--param", "num_groups=16", "--param", "system_prompt_tokens=2048",
        "--replicas", "4", "--requests", "200", "--load", "0.5", "--policies", "rr,hit",
        "--profile", "cpu-small", "--json", str(out), "--plot", str(png),
    ]  # fmt: skip
    assert cluster_sim_cli.main(argv, policy_factory=tiny_policies) == 0
    table = capsys.readouterr().out
    assert "oracle hit rate" in table and "TTFT floor" in table
    assert any(line.startswith("rr ") for line in table.splitlines())
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"rr", "hit"}
    assert set(report["policies"]["rr"]) == set(SUMMARY_KEYS)
    assert report["policies"]["hit"]["requests"] == 200
    assert report["offered_load"] == pytest.approx(0.5, rel=0.25)
    assert report["params"]["profile"] == "cpu-small" and report["ttft_floor_s"] > 0
    assert png.stat().st_size > 10_000


def test_trace_run_rescales_to_the_requested_load(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i * 1000, "input_length": 2048 + 512 * (i % 3), "output_length": 16,
         "hash_ids": [0, 1, 2, 3, 100 + i, 200 + i]}
        for i in range(60)
    ]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out.json"
    argv = ["--trace", str(trace), "--replicas", "2", "--load", "0.6", "--policies", "hit",
            "--json", str(out)]  # fmt: skip
    assert cluster_sim_cli.main(argv, policy_factory=tiny_policies) == 0
    report = json.loads(out.read_text())
    assert report["offered_load"] == pytest.approx(0.6, rel=0.01)
    assert report["oracle_hit_rate"] > 0.4


def test_the_cpu_tier_runs_the_chosen_cache_policy_with_lookahead(tmp_path: Path) -> None:
    out = {name: tmp_path / f"{name}.json" for name in ("lru", "adaptive")}
    for name, path in out.items():
        argv = [
            "--workload", "groups", "--param", "num_groups=16", "--param",
            "system_prompt_tokens=2048", "--replicas", "2", "--requests", "120", "--load", "0.8",
            "--policies", "hit", "--profile", "cpu-small", "--cpu-blocks", "64",
            "--cpu-policy", name, "--lookahead", "8", "--json", str(path),
        ]  # fmt: skip
        assert cluster_sim_cli.main(argv, policy_factory=tiny_policies) == 0
    reports = {name: json.loads(path.read_text()) for name, path in out.items()}
    for name, report in reports.items():
        assert report["params"]["cpu_policy"] == name
        assert report["params"]["lookahead"] == 8
        assert report["policies"]["hit"]["requests"] == 120
    with pytest.raises(SystemExit):
        cluster_sim_cli.main(["--workload", "blog", "--cpu-policy", "nope"])
    with pytest.raises(SystemExit):
        cluster_sim_cli.main(["--workload", "blog", "--lookahead", "-1"])


def test_real_policies_run_when_available(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = ["--workload", "blog", "--requests", "150", "--replicas", "4",
            "--policies", "round_robin,prefixmesh", "--json", str(out)]  # fmt: skip
    assert cluster_sim_cli.main(argv) == 0
    assert set(json.loads(out.read_text())["policies"]) == {"round_robin", "prefixmesh"}


def test_bad_arguments_exit() -> None:
    with pytest.raises(SystemExit):
        cluster_sim_cli.main(["--workload", "blog", "--policies", "nope"])
    with pytest.raises(SystemExit):
        cluster_sim_cli.main(["--workload", "blog", "--trace", "x.jsonl"])
    with pytest.raises(SystemExit):
        cluster_sim_cli.main(["--workload", "blog", "--load", "0"])
