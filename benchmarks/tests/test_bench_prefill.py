"""bench_prefill on CPU: its plumbing at toy sizes (2 layers, 4 chunks, two of them profiled)."""

import json

import pytest

from benchmarks import bench_prefill
from benchmarks.bench_serve import tiny_setup

pytestmark = pytest.mark.slow  # a 2-layer model compiled and run three times a variant (four variants)


def test_tiny_run_times_every_chunk_and_profiles_the_first_and_last(tmp_path, monkeypatch):
    import benchmarks.harness

    monkeypatch.setattr(benchmarks.harness, "environment", lambda: {"gpu": "none"})
    out = tmp_path / "prefill.json"
    assert bench_prefill.main(["--tiny", "--out", str(out), "--top", "3", "--splits", "default,whole",
                               "--tier-block-m", "default,32"]) == 0
    result = json.loads(out.read_text())
    setup = tiny_setup()
    assert result["prompt_len"] == 3 * setup.prefill_chunk + setup.page_size
    # the history table holds what a sequence of max_seq_len tokens can demote, no less
    assert result["history_slots"] * setup.page_size >= result["max_seq_len"] - setup.sink - setup.recent
    assert result["dense_chunk_alone_s"] > 0
    assert list(result["splits"]) == ["default", "default+tier_block_m=32", "whole", "whole+tier_block_m=32"]
    assert result["splits"]["default"]["pages_per_split"] is None
    assert result["splits"]["whole"]["pages_per_split"] >= result["history_slots"]
    assert [run["tier_block_m"] for run in result["splits"].values()] == [None, 32, None, 32]
    for run in result["splits"].values():
        assert [c["prefix_tokens"] for c in run["chunks"]] == [0, 32, 64, 96]
        assert all(c["seconds"] > 0 for c in run["chunks"]) and run["tokens_per_s"] > 0
        assert set(run["profiles"]) == {"0", "3"}
        for index, profile in run["profiles"].items():
            assert profile["prefix_tokens"] == int(index) * setup.prefill_chunk
            assert profile["total_ns"] > 0 and 0 < len(profile["kernels"]) <= 3
            assert all(ns > 0 and count >= 1 for _, ns, count in profile["kernels"])
        assert run["profiles"]["3"]["tokens"] == setup.page_size  # the last chunk is the remainder


def test_a_bad_split_policy_is_named():
    with pytest.raises(ValueError, match="'halves' must be one of"):
        bench_prefill.split_pages("halves", runtime=None)
