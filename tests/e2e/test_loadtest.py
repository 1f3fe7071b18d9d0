"""``prefixmesh loadtest`` end to end: locust in its own process, open-loop arrivals against a
sim replica server (``prefixmesh replica-server``, its own process), a report with the required
numbers and the charts. A few seconds, bounded in time and count, loopback only."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixmesh.loadtest.peers import ManagedProcess, wait_http
from prefixmesh.loadtest.report import REQUIRED_KEYS
from prefixmesh.ports import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replica_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    logs = tmp_path_factory.mktemp("logs")
    process = ManagedProcess(
        "replica",
        [sys.executable, "-m", "prefixmesh.cli", "replica-server", "--engine", "sim",
         "--port", str(port), "--set", "replica.sim.kv_blocks=256"],
        logs / "replica.log",
        {"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def test_a_short_bounded_load_test_writes_its_report(replica_server: str, tmp_path: Path) -> None:
    report = tmp_path / "report"
    command = [
        sys.executable, "-m", "prefixmesh.cli", "loadtest",
        "--target", replica_server, "--workload", "groups",
        "--param", "num_groups=3", "--param", "system_prompt_tokens=512",
        "--param", "question_tokens=64", "--param", "output_tokens_min=2",
        "--param", "output_tokens_max=4",
        "--rate", "20", "--duration", "3", "--requests", "60", "--drain", "20",
        "--metrics-url", f"{replica_server}/metrics", "--report", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((report / "report.json").read_text())
    assert all(key in summary for key in REQUIRED_KEYS)
    assert 20 <= summary["requests"] <= 60 and summary["failures"] == 0
    assert summary["hit_rate_source"] == "replica counters"
    assert summary["hit_rate"] > 0.3  # three groups of 512-token documents, reused
    assert summary["ttft_p50_s"] > 0 and summary["throughput_tok_s"] > 0
    assert summary["completion_tokens"] >= 2 * summary["requests"]
    assert summary["arrival_cv"] > 0.3  # Poisson, not a constant pace (few samples: loose)
    records = (report / "records.jsonl").read_text().splitlines()
    assert len(records) == summary["requests"]
    for name in ("ttft_cdf.png", "timeline.png", "report.md", "locust_stats.csv"):
        assert (report / name).stat().st_size > 0, name


def test_chat_and_a_trace(replica_server: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 700, "output_length": 2, "hash_ids": [1, 2 + i % 2]}
        for i in range(12)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = tmp_path / "trace-report"
    command = [
        sys.executable, "-m", "prefixmesh.cli", "loadtest", "--target", replica_server,
        "--trace", str(trace), "--api", "chat", "--duration", "5", "--drain", "20",
        "--report", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((report / "report.json").read_text())
    assert summary["requests"] == 12 and summary["failures"] == 0
    assert summary["usage_hit_rate"] > 0.3  # the 512-token block 1 is shared by all
