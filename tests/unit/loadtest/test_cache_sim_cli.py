"""``prefixmesh cache-sim`` end to end on tiny traces and workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixmesh.cli import SUBCOMMANDS
from prefixmesh.loadtest import cache_sim_cli
from prefixmesh.loadtest.traces import load_trace
from prefixmesh.loadtest.workloads import FewshotWorkload

MOONCAKE = [
    {"timestamp": 0, "input_length": 3 * 512 + 7, "output_length": 5, "hash_ids": [1, 2, 3, 90]},
    {"timestamp": 10, "input_length": 2 * 512 + 7, "output_length": 5, "hash_ids": [4, 5, 91]},
    {"timestamp": 20, "input_length": 3 * 512, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 30, "input_length": 4 * 512, "output_length": 5, "hash_ids": [1, 2, 6, 7]},
]
QWEN = [
    {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 48,
     "output_length": 32, "hash_ids": [1, 2, 3], "turn": 1, "type": "text"},
    {"chat_id": 2, "parent_chat_id": 1, "timestamp": 5.0, "input_length": 96,
     "output_length": 8, "hash_ids": [1, 2, 3, 4, 5, 6], "turn": 2, "type": "text"},
    {"chat_id": 3, "parent_chat_id": -1, "timestamp": 6.0, "input_length": 32,
     "output_length": 8, "hash_ids": [7, 8], "turn": 1, "type": "search"},
]  # fmt: skip


def write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_subcommand_is_registered() -> None:
    assert SUBCOMMANDS["cache-sim"][0] == "prefixmesh.loadtest.cache_sim_cli"


def test_mooncake_trace_rows_in_the_issue_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = write(tmp_path / "mc.jsonl", MOONCAKE), tmp_path / "out.json"
    argv = [
        "--trace", str(trace), "--capacity-blocks", "3,2", "--capacity-blocks", "16",
        "--policies", "lru,hotprefix", "--json", str(out),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    assert "ceiling hit rate" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["block_tokens"] == 512 and report["distinct_blocks"] == 7
    rows = report["results"]
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("lru", [3, 2]),
        ("hotprefix", [3, 2]),
        ("lru", [16]),
        ("hotprefix", [16]),
    ]
    for row in rows:
        assert {"policy", "capacity_blocks", "hit_rate", "hit_rate_by_tier", "blocks_written",
                "blocks_promoted"} <= set(row)  # fmt: skip
    # 12 blocks requested; an unbounded cache hits 3 (request 3) + 2 (request 4)
    assert report["ceiling_hit_rate"] == pytest.approx(5 / 12)
    assert rows[2]["hit_rate"] == pytest.approx(5 / 12)
    # LRU over 3 + 2: request 2 pushes 3 and 2 down, request 3 loads them back (2 CPU hits),
    # request 4 hits 1 and 2 in the engine tier
    lru = rows[0]
    assert lru["hit_rate_by_tier"] == pytest.approx({"gpu": 3 / 12, "cpu": 2 / 12}, abs=1e-6)
    assert lru["blocks_written"] == 5 and lru["blocks_promoted"] == 2


def test_qwen_turns_answers_and_categories(tmp_path: Path) -> None:
    requests = cache_sim_cli.to_cache_requests(load_trace(write(tmp_path / "q.jsonl", QWEN)), 16)
    assert [r.category for r in requests] == ["text-1", "text-2", "search-1"]
    first, second, _ = requests
    assert len(first.blocks) == 3 and len(first.output_blocks) == 2  # answer blocks 4, 5
    assert second.blocks[:5] == first.blocks + first.output_blocks
    assert cache_sim_cli.ceiling_hit_rate(requests) == pytest.approx(5 / 11)


def test_fewshot_workload_and_fractions_variants_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "out.json", tmp_path / "hits.png"
    argv = [
        "--workload", "fewshot", "--requests", "300", "--capacity-fraction", "0.1,0.2",
        "--lower-tiers", "1,2",
        "--variant", "lru", "kvcache.policy=lru",
        "--variant", "write-all", "kvcache.policy=hotprefix", "kvcache.hotprefix.admission=false",
        "--json", str(out), "--plot", str(png),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    report = json.loads(out.read_text())
    distinct = report["distinct_blocks"]
    sizes = [r["capacity_blocks"] for r in report["results"]]
    engine = round(0.1 * distinct)
    assert sizes[0] == [engine, engine, 2 * engine]
    assert [r["policy"] for r in report["results"]] == ["lru", "write-all"] * 2
    assert report["results"][1]["blocks_written"] > 0
    assert png.stat().st_size > 0
    assert "write-all" in capsys.readouterr().out


def test_fewshot_prefixes_are_shared_long_tailed_and_questions_unique() -> None:
    requests = FewshotWorkload().generate(2000, rate=10.0, seed=1)
    heads = [r.segments[0] for r in requests]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert len(counts) <= 57 and counts[0] > 5 * counts[len(counts) // 2]
    assert len({r.segments[1] for r in requests}) == len(requests)
    assert all(300 <= h.num_tokens <= 1200 for h in heads)
    assert {r.output_tokens for r in requests} == {1}


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    trace = write(tmp_path / "mc.jsonl", MOONCAKE)
    with pytest.raises(SystemExit):
        cache_sim_cli.main(["--trace", str(trace), "--capacity-blocks", "0,4"])
    with pytest.raises(SystemExit):
        cache_sim_cli.main(["--trace", str(trace), "--capacity-blocks", "4", "--policies", "fifo"])
    with pytest.raises(SystemExit):
        cache_sim_cli.main(["--trace", str(trace), "--capacity-blocks", "4", "--policies", "all,x"])


# a b c a b a through room for two: LRU hits only the last a (1 of 6); Belady evicts b for c,
# hits a, evicts c (never used again) for b, hits a again (2 of 6).
TEXTBOOK = [
    {"timestamp": t, "input_length": 512, "output_length": 1, "hash_ids": [h]}
    for t, h in enumerate([1, 2, 3, 1, 2, 1])
]


def test_all_policies_read_against_lru_and_belady(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = write(tmp_path / "abc.jsonl", TEXTBOOK), tmp_path / "out.json"
    argv = [
        "--trace", str(trace), "--capacity-blocks", "2", "--policies", "all,belady",
        "--set", "kvcache.policy=workload", "--json", str(out),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    assert "gain" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["default_policy"] == "workload"
    rows = {r["policy"]: r for r in report["results"]}
    assert list(rows) == ["lru", "lfu", "hotprefix", "workload", "nextuse", "adaptive", "belady"]
    assert report["references"] == [
        {"capacity_blocks": [2], "lru_hit_rate": pytest.approx(1 / 6, abs=1e-6),
         "belady_hit_rate": pytest.approx(2 / 6, abs=1e-6)}
    ]  # fmt: skip
    assert (rows["lru"]["vs_lru"], rows["lru"]["share_of_belady_gain"]) == (1.0, 0.0)
    assert (rows["belady"]["vs_lru"], rows["belady"]["share_of_belady_gain"]) == (2.0, 1.0)
    for row in rows.values():
        hit = row["hit_rate"]
        assert row["vs_lru"] == pytest.approx(hit * 6, abs=1e-3)
        assert row["share_of_belady_gain"] == pytest.approx((hit - 1 / 6) * 6, abs=1e-3)
        assert row["hit_rate"] <= rows["belady"]["hit_rate"]
    assert report["variants"]["belady"] == ["kvcache.policy=belady"]


def test_default_runs_the_configured_policy_and_references_still_run(tmp_path: Path) -> None:
    trace, out = write(tmp_path / "abc.jsonl", TEXTBOOK), tmp_path / "out.json"
    argv = [
        "--trace", str(trace), "--capacity-blocks", "2", "--capacity-blocks", "1,1",
        "--policies", "default", "--set", "kvcache.policy=lfu", "--json", str(out),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["default_policy"] == "lfu"
    assert [(r["policy"], r["capacity_blocks"]) for r in report["results"]] == [
        ("lfu", [2]),
        ("lfu", [1, 1]),
    ]
    assert [r["capacity_blocks"] for r in report["references"]] == [[2], [1, 1]]
    # engine 1 + CPU 1 keeps what one tier of 2 keeps under Belady (exclusive tiers)
    assert report["references"][1]["belady_hit_rate"] == pytest.approx(2 / 6, abs=1e-6)


def test_a_variant_may_name_belady_and_gain_is_none_when_belady_gains_nothing(
    tmp_path: Path,
) -> None:
    trace, out = write(tmp_path / "abc.jsonl", TEXTBOOK), tmp_path / "out.json"
    argv = [
        "--trace", str(trace), "--capacity-blocks", "3",
        "--variant", "oracle", "kvcache.policy=belady", "--variant", "plain", "kvcache.policy=lru",
        "--json", str(out),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["variants"] == {
        "oracle": ["kvcache.policy=belady"],
        "plain": ["kvcache.policy=lru"],
    }
    # room for all three blocks: every policy hits 3 of 6, Belady gains nothing over LRU
    for row in report["results"]:
        assert row["hit_rate"] == pytest.approx(0.5)
        assert (row["vs_lru"], row["share_of_belady_gain"]) == (1.0, None)


def test_no_share_of_a_gain_too_small_to_divide() -> None:
    refs = cache_sim_cli.References(lru=0.5, belady=0.5005)
    assert refs.share_of_gain(0.49) is None
    assert refs.vs_lru(0.55) == pytest.approx(1.1)
    assert cache_sim_cli.References(lru=0.5, belady=0.6).share_of_gain(0.55) == pytest.approx(0.5)
    assert cache_sim_cli.References(lru=0.0, belady=0.1).vs_lru(0.05) is None


def test_lookahead_adds_a_row_per_online_policy_and_queue_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = write(tmp_path / "abc.jsonl", TEXTBOOK), tmp_path / "out.json"
    argv = [
        "--trace", str(trace), "--capacity-blocks", "2", "--policies", "lru,workload,belady",
        "--lookahead", "1,3", "--json", str(out),
    ]  # fmt: skip
    assert cache_sim_cli.main(argv) == 0
    # The table names every column it prints (victim_us had no header: regression).
    header, *table = [line.split() for line in capsys.readouterr().out.splitlines()[2:9]]
    assert header[-1] == "victim_us" and all(len(row) == len(header) for row in table)
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["results"]}
    assert list(rows) == [
        "lru", "workload", "belady", "lru+look1", "workload+look1", "lru+look3", "workload+look3",
    ]  # fmt: skip
    assert report["variants"]["lru+look3"] == ["kvcache.policy=lru", "lookahead=3"]
    # One queued request is enough to reach Belady here (test_lookahead.py); LRU stays LRU.
    assert rows["lru"]["hit_rate"] == pytest.approx(1 / 6, abs=1e-6)
    for label in ("lru+look1", "lru+look3", "workload+look1"):
        assert rows[label]["share_of_belady_gain"] == pytest.approx(1.0), label
    # Each row says what its policy's decisions cost (a row that evicted asked for victims).
    for label, row in rows.items():
        assert (row["victim_us"] > 0) == (row["blocks_evicted"] > 0), label
        assert row["on_request_us"] > 0, label
    with pytest.raises(SystemExit):
        cache_sim_cli.main(["--trace", str(trace), "--capacity-blocks", "2", "--lookahead", "0"])
