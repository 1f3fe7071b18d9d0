"""The load tester fits its target (issue 17): a plan whose requests cannot fit the target's
context is refused before it runs, and a run with too many failures exits non-zero with the
first error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixmesh.loadtest import loadtest_cli
from prefixmesh.loadtest.fit import context_length, failed_run, plan_fit
from prefixmesh.loadtest.workloads import WorkloadRequest

MODELS = {"object": "list", "data": [{"id": "demo-tiny", "max_model_len": 4096}]}


def request(prompt: int, output: int) -> WorkloadRequest:
    return WorkloadRequest("r", 0.0, (), prompt, output)


def test_a_request_longer_than_the_context_does_not_fit() -> None:
    plan = [request(4000, 96), request(4000, 97), request(100, 10)]
    fit = plan_fit(plan, 4096, None)
    assert (fit.fits, fit.too_long, fit.longest) == (False, 1, 4097)
    assert "1 of 3 requests" in fit.explain() and "4096" in fit.explain()
    assert plan_fit(plan, 4096, 50).fits  # outputs capped as the request builder caps them
    assert plan_fit([], 4096, None).fits


def test_the_context_length_comes_from_the_model_card() -> None:
    assert context_length(MODELS, "demo-tiny") == 4096
    assert context_length(MODELS, "other") is None
    assert context_length({"data": [{"id": "demo-tiny"}]}, "demo-tiny") is None  # a peer's card
    assert context_length({}, "demo-tiny") is None


def test_a_run_fails_past_its_failure_share_with_the_first_error() -> None:
    ok = {"status": 200, "error": "", "ttft_s": 0.1}
    bad = {"status": 400, "error": "context_length_exceeded", "ttft_s": None}
    assert failed_run([ok] * 19 + [bad], 0.05) is None
    reason = failed_run([ok] * 18 + [bad, bad], 0.05)
    assert reason is not None and "2 of 20" in reason and "context_length_exceeded" in reason
    assert failed_run([], 0.05) == "no request was sent"


def test_the_cli_refuses_a_workload_the_target_cannot_hold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def models(url: str, timeout: float) -> httpx.Response:
        assert url == "http://127.0.0.1:8000/v1/models"
        return httpx.Response(200, json=MODELS, request=httpx.Request("GET", url))

    def never(*_: Any, **__: Any) -> int:
        raise AssertionError("locust must not start")

    monkeypatch.setattr(loadtest_cli.httpx, "get", models)
    monkeypatch.setattr(loadtest_cli, "run_locust", never)
    argv = ["--workload", "groups", "--rate", "2", "--duration", "5", "--report", str(tmp_path)]
    too_long = ["--param", "system_prompt_tokens=17000"]
    assert loadtest_cli.main([*argv, *too_long]) == 2
    assert "refusing to run" in capsys.readouterr().out
    assert loadtest_cli.main([*argv, "--param", "nonsense"]) == 2
