"""serve's progress lines while the replicas start: each deployment's running replicas out of
all, the rest by state; said every interval while Serve's run is busy, never after it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum

import pytest

from prefixmesh.deploy_progress import progress_line, run_with_progress


class State(StrEnum):
    STARTING = "STARTING"
    RUNNING = "RUNNING"


@dataclass
class Overview:
    replica_states: dict[State, int] = field(default_factory=dict)


def test_the_line_counts_running_replicas_out_of_all() -> None:
    deployments = {
        "Replica": Overview({State.STARTING: 2}),
        "Router": Overview({State.RUNNING: 1}),
    }
    line = progress_line(deployments, 21.4)
    assert line == "  ... 21 s: Replica 0/2 running (2 starting); Router 1/1 running"
    assert progress_line({}, 3.0) == "  ... 3 s: no deployment yet"


def test_progress_is_said_while_the_run_is_busy_and_its_result_returned() -> None:
    release = threading.Event()
    said: list[str] = []

    def run() -> str:
        release.wait(10)
        return "handle"

    def say(line: str) -> None:
        said.append(line)
        if len(said) == 2:
            release.set()

    result = run_with_progress(run, lambda: {"Replica": Overview({State.STARTING: 1})}, say, 0.01)
    assert result == "handle"
    assert len(said) >= 2 and all("Replica 0/1 running (1 starting)" in s for s in said)


def test_the_run_s_failure_is_raised_and_a_failed_status_read_said() -> None:
    release = threading.Event()
    said: list[str] = []

    def run() -> None:
        release.wait(10)
        raise RuntimeError("deploy failed")

    def status() -> dict[str, Overview]:
        release.set()
        raise ConnectionError("controller gone")

    with pytest.raises(RuntimeError, match="deploy failed"):
        run_with_progress(run, status, said.append, 0.01)
    assert any("status unavailable (controller gone)" in line for line in said)
