from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.loadtest.bench.policy import main
from prefixmesh.router.policy import POLICY_NAMES


def test_bench_times_every_policy_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--replicas", "8", "--decisions", "120", "--scenarios", "50", "--json", str(out)]
    assert main(argv, prog="policy-bench") == 0
    table = capsys.readouterr().out
    assert all(name in table for name in POLICY_NAMES)
    results = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in results] == list(POLICY_NAMES)
    assert all(r["replicas"] == 8 and r["decisions"] == 120 for r in results)
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in results)


def test_bench_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--replicas", "0"], prog="policy-bench")
    with pytest.raises(SystemExit):
        main(["--block-size", "48"], prog="policy-bench")
