from __future__ import annotations

import pytest

from prefixmesh.replica.kvcache.prefill_rate import PrefillRateMeter


def test_the_initial_rate_stands_until_a_step_is_measured() -> None:
    meter = PrefillRateMeter(30_000.0, min_tokens=256)
    assert meter.tokens_per_s == 30_000.0
    assert meter.scheduled(0.0, {"a"}, 1024) == 30_000.0  # nothing timed yet
    assert meter.samples == 0


def test_a_prefill_step_followed_by_its_request_gives_a_sample() -> None:
    meter = PrefillRateMeter(30_000.0, min_tokens=256, weight=1.0)
    meter.scheduled(10.0, {"a"}, 1000)
    # "a" runs on (its decode step): the engine was busy for the whole 0.5 s.
    assert meter.scheduled(10.5, {"a"}, 1) == pytest.approx(2000.0)
    assert meter.samples == 1


def test_idle_time_and_decode_steps_are_not_samples() -> None:
    meter = PrefillRateMeter(30_000.0, min_tokens=256, weight=1.0)
    meter.scheduled(0.0, {"a"}, 1000)
    meter.scheduled(7.0, {"b"}, 1000)  # "a" finished: the engine may have idled since
    meter.scheduled(7.1, {"b", "c"}, 2)  # b's prefill: 1000 tokens in 0.1 s
    meter.scheduled(9.0, {"b", "c"}, 2)  # a decode step is too small to say anything
    assert meter.samples == 1
    assert meter.tokens_per_s == pytest.approx(10_000.0)


def test_the_estimate_is_a_weighted_mean_of_seconds_per_token() -> None:
    meter = PrefillRateMeter(1000.0, min_tokens=100, weight=0.5)
    meter.scheduled(0.0, {"a"}, 100)
    meter.scheduled(0.2, {"a"}, 100)  # 2 ms a token: halfway from 1 ms is 1.5 ms
    assert meter.tokens_per_s == pytest.approx(1 / 0.0015)


def test_an_empty_step_breaks_the_chain() -> None:
    meter = PrefillRateMeter(1000.0, min_tokens=100, weight=1.0)
    meter.scheduled(0.0, {"a"}, 500)
    meter.scheduled(1.0, set(), 0)  # nothing ran (a load still on its way)
    meter.scheduled(2.0, {"a"}, 500)
    assert meter.samples == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefillRateMeter(0.0, min_tokens=1)
    with pytest.raises(ValueError):
        PrefillRateMeter(1.0, min_tokens=1, weight=0.0)


def test_small_steps_give_the_duration_of_a_decode_step() -> None:
    meter = PrefillRateMeter(1000.0, min_tokens=100, weight=0.5)
    assert meter.decode_step_s == 0.0  # not timed yet
    meter.scheduled(0.0, {"a", "b"}, 2)
    meter.scheduled(0.04, {"a", "b"}, 2)  # the first sample stands alone: 40 ms
    assert meter.decode_step_s == pytest.approx(0.04)
    meter.scheduled(0.06, {"b"}, 1)  # 20 ms: halfway from 40 is 30
    assert meter.decode_step_s == pytest.approx(0.03)
    meter.scheduled(5.0, {"c"}, 1)  # b finished: the engine may have idled since
    assert (meter.decode_samples, meter.samples) == (2, 0)
    assert meter.tokens_per_s == 1000.0  # a small step says nothing of the prefill rate


def test_a_step_with_loads_in_it_is_no_sample() -> None:
    meter = PrefillRateMeter(1000.0, min_tokens=100, weight=1.0)
    meter.scheduled(0.0, {"a"}, 500, loads=True)  # its forward may wait for its copies
    meter.scheduled(2.0, {"a"}, 1, loads=True)
    meter.scheduled(2.5, {"a"}, 1)
    assert (meter.samples, meter.decode_samples) == (0, 0)
    meter.scheduled(2.52, {"a"}, 1)
    assert meter.decode_step_s == pytest.approx(0.02)
