"""tenant-bench's pure parts: the same seeded schedule in every scenario (the heavy tenant at
its factor of the light one's rate, prompts with no prefix in common), rows by tenant and
status, and the quota scenario sized at a tenth of what the heavy tenant asks for."""

from __future__ import annotations

import pytest

from prefixmesh.loadtest.bench.tenants import (
    Arrival,
    Outcome,
    parse_args,
    rows_of,
    scenarios,
    schedule,
)


def test_the_schedule_is_seeded_and_the_heavy_tenant_sends_its_factor_more() -> None:
    args = parse_args(["--light-rate", "2", "--duration-s", "10", "--prompt-tokens", "64"], "t")
    both = schedule(args, ("light", "heavy"))
    assert both == schedule(args, ("light", "heavy"))
    counts = {t: sum(a.tenant == t for a in both) for t in ("light", "heavy")}
    assert counts == {"light": 20, "heavy": 200}
    assert [a for a in both if a.tenant == "light"] == schedule(args, ("light",))
    assert all(len(a.prompt) == 64 for a in both)
    assert len({a.prompt[:16] for a in both}) == len(both)  # no shared first block
    assert [a.at_s for a in both] == sorted(a.at_s for a in both)


def test_rows_count_answers_by_status_per_tenant() -> None:
    outcomes = [
        Outcome("light", 200, 0.1),
        Outcome("light", 200, 0.3),
        Outcome("heavy", 429, None),
        Outcome("heavy", 0, None),
        Outcome("heavy", 200, 0.5),
    ]
    heavy, light = rows_of("quota", outcomes)
    assert (heavy.requests, heavy.ok, heavy.rate_limited, heavy.other_errors) == (3, 1, 1, 1)
    assert (light.ttft_p50_ms, light.ttft_mean_ms) == (200.0, 200.0)


def test_the_quota_is_a_tenth_of_the_heavy_tenant_s_demand() -> None:
    args = parse_args(["--light-rate", "1", "--prompt-tokens", "996", "--max-tokens", "4"], "t")
    table = {label: (tenants, extra) for label, tenants, extra in scenarios(args)}
    assert table["alone"] == (("light",), [])
    assert table["quota"][1] == ["quotas.tenants.heavy.tokens_per_minute=60000"]
    assert table["fair"][1] == ["replica.fair_share.enabled=true"]
    args = parse_args(["--prompt-tokens", "996", "--scenarios", "quota+fair:2048"], "t")
    ((label, _, extra),) = scenarios(args)
    assert extra == [
        "quotas.tenants.heavy.tokens_per_minute=60000",
        "replica.fair_share.enabled=true",
        "replica.fair_share.prefill_budget_tokens=2048",
    ]
    args = parse_args(["--scenarios", "fair:2048"], "t")
    ((label, _, extra),) = scenarios(args)
    assert (label, extra[-1]) == ("fair:2048", "replica.fair_share.prefill_budget_tokens=2048")
    assert Arrival(0.0, "light", (1,)).tenant == "light"


def test_an_unknown_scenario_is_refused_when_the_arguments_are_read() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--scenarios", "alone,fairshare"], "t")
    with pytest.raises(SystemExit):
        parse_args(["--scenarios", "fifo:2048,nope:1"], "t")
