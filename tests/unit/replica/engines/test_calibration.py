"""The engine's calibration keeps the fastest of its timed runs: contention only slows one."""

from __future__ import annotations

import pytest

from prefixmesh.replica.engines.calibration import CalibrationRun, fastest


def test_a_run_times_its_prefill_to_the_first_token_and_its_steps_after() -> None:
    run = CalibrationRun.of(10.0, [10.05, 10.06, 10.08, 10.11])
    assert run.prefill_s == pytest.approx(0.05)
    assert run.decode_step_s == pytest.approx(0.02)
    assert CalibrationRun.of(10.0, [10.0]) == CalibrationRun(1e-6, 0.0)  # one token, at once


def test_each_figure_comes_from_the_run_that_was_fastest_at_it() -> None:
    contended = CalibrationRun(prefill_s=0.080, decode_step_s=0.010)  # a peer loading weights
    quiet = CalibrationRun(prefill_s=0.040, decode_step_s=0.012)
    rate, step = fastest([contended, quiet], prompt_tokens=1024)
    assert rate == pytest.approx(1024 / 0.040)
    assert step == pytest.approx(0.010)
    with pytest.raises(ValueError):
        fastest([], 1024)
