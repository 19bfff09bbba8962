"""bench_prefix_keys on CPU: its plumbing at a short prompt (the figures are the machine's)."""

import json

from benchmarks import bench_prefix_keys
from shared_math.spec import OscarConfig
from shared_math.tiers import tier_split


def test_a_short_run_times_both_keyings_over_every_history_page(tmp_path, monkeypatch):
    import benchmarks.harness

    monkeypatch.setattr(benchmarks.harness, "environment", lambda: {"gpu": "none"})
    out = tmp_path / "keys.json"
    assert bench_prefix_keys.main(["--lengths", "2048,4096", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    config = OscarConfig(head_dim=128, sink=64, recent=256, page_size=64)
    assert [r["history_pages"] for r in runs] == [tier_split(n, config).history_pages for n in (2048, 4096)]
    assert all(r[k] > 0 for r in runs for k in ("per_prefix_s", "chained_first_pass_s", "chained_cached_s"))


def test_the_per_prefix_key_names_namespace_and_every_token_before_the_end():
    tokens = list(range(200))
    key = bench_prefix_keys.per_prefix_key("a", tokens, 128)
    assert key == bench_prefix_keys.per_prefix_key("a", tokens[:128] + [9] * 72, 128)
    assert key != bench_prefix_keys.per_prefix_key("b", tokens, 128)
    assert key != bench_prefix_keys.per_prefix_key("a", [1] + tokens[1:], 128)
