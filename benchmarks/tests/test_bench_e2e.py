"""bench_e2e on CPU: the fabricated decode plan, the byte accounting, and a tiny end-to-end run
(2 layers, interpret mode) with its capacity search. The GPU timings themselves are not tested."""

import json

import numpy as np

import pytest

from benchmarks import bench_e2e
from shared_math.allocator import PageAllocator
from shared_math.tiers import demotes_on_append

QWEN = dict(num_layers=36, num_kv_heads=8)


@pytest.fixture(scope="module")
def tiny_model():
    from oscar_jax.model import ModelConfig

    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=4,
                       num_kv_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=False,
                       qk_norm=True)


def test_kv_bytes_read_formulas():
    oscar = bench_e2e.oscar_config(128)
    for context in (30000, 100000):
        assert bench_e2e.kv_bytes_read("bf16", context, 1, **QWEN, oscar=oscar) == context * 36 * 8 * 2 * 128 * 2
        history = (context - 64 - 256) // 64 * 64
        bf16_tokens = context - history
        # per token and KV head, K + V: INT2 32 B codes + 2·2 B fp16 scale/min each; BF16 256 B each
        want = 36 * 8 * (history * 2 * (32 + 4) + bf16_tokens * 2 * 256)
        assert bench_e2e.kv_bytes_read("int2", context, 3, **QWEN, oscar=oscar) == 3 * want
    with pytest.raises(ValueError, match="kind"):
        bench_e2e.kv_bytes_read("fp8", 100, 1, **QWEN, oscar=oscar)


def test_capacity_accounting_at_100k():
    oscar = bench_e2e.oscar_config(128)
    bf16_page, int2_page = 2 * 8 * 64 * 128 * 2, 2 * 8 * 64 * (32 + 4)
    assert bench_e2e.page_bytes(oscar, 8) == {"bf16": bf16_page, "int2": int2_page}
    assert bench_e2e.pages_per_sequence("int2", 100000, oscar) == {"bf16": 6, "int2": 1557}
    assert bench_e2e.pages_per_sequence("bf16", 100000, oscar) == {"bf16": 1563, "int2": 0}
    int2 = bench_e2e.sequence_cache_bytes("int2", 100000, **QWEN, oscar=oscar)
    bf16 = bench_e2e.sequence_cache_bytes("bf16", 100000, **QWEN, oscar=oscar)
    assert int2 == 36 * (6 * bf16_page + 1557 * int2_page)
    assert bf16 == 36 * 1563 * 64 * 8 * 128 * 2 * 2
    assert bench_e2e.max_sequences(100 * 2**30, 16 * 2**30, 4 * 2**30, bf16) == (80 * 2**30) // bf16
    assert bench_e2e.max_sequences(10, 20, 0, 1) == 0


@pytest.mark.parametrize("context", [65, 320, 321, 700, 1000, 1023])
def test_int2_plan_matches_the_runtime_allocator(context):
    """The fabricated tables count what PageAllocator's decode-step view counts (no demotion
    pending), and the new token is written into the last recent slot that the tables include."""
    oscar = bench_e2e.oscar_config(64)
    if demotes_on_append(context - 1, oscar):
        pytest.skip("a demoting step shows the pre-demotion view")
    tables = bench_e2e.plan_tables("int2", context, 2, oscar, table_context=1024)
    alloc = PageAllocator(oscar, num_bf16_pages=64, num_int2_pages=64)
    sid = alloc.admit(list(range(context - 1))).seq_id
    assert alloc.extend(sid, 7) is None
    want = alloc.tables([sid], 16)
    for name in ("sink_tokens", "history_tokens", "recent_tokens"):
        assert tables[name][0] == want[name][0], name
    assert tables["bf16_page_table"].shape[1] == want["bf16_page_table"].shape[1]
    sink, history, recent = (int(tables[n][0]) for n in ("sink_tokens", "history_tokens", "recent_tokens"))
    assert sink + history + recent == context and history % 64 == 0
    if context > 64:
        assert 256 <= recent < 320 or history == 0
        slot_index = 1 + (recent - 1) // 64
        assert tables["bf16_write_page"][1, 0] == tables["bf16_page_table"][1, slot_index]
        assert tables["bf16_write_slot"][1, 0] == (recent - 1) % 64
    assert np.all(tables["int2_write_page"] == tables["num_int2_pages"])  # no INT2 write
    # every page is used once, page 0 (scratch) never
    for table, pool in (("bf16_page_table", "num_bf16_pages"), ("history_page_table", "num_int2_pages")):
        pages = tables[table].ravel()
        assert len(set(pages.tolist())) == pages.size and pages.min() >= 1 and pages.max() < tables[pool]


def test_bf16_plan_puts_everything_in_the_bf16_tier():
    oscar = bench_e2e.oscar_config(64)
    tables = bench_e2e.plan_tables("bf16", 700, 1, oscar, table_context=1000)
    assert (tables["sink_tokens"][0], tables["recent_tokens"][0], tables["history_tokens"][0]) == (64, 636, 0)
    assert tables["bf16_page_table"].shape == (1, 16) and tables["num_int2_pages"] == 1
    assert tables["history_page_table"].shape == (1, 0)  # no INT2 tier: its kernel does not run
    assert tables["bf16_write_page"][0, 0] == tables["bf16_page_table"][0, 1 + 635 // 64]
    assert tables["bf16_write_slot"][0, 0] == 635 % 64
    with pytest.raises(ValueError, match="context"):
        bench_e2e.plan_tables("bf16", 1001, 1, oscar, table_context=1000)


@pytest.mark.slow
def test_tiny_run_end_to_end(tiny_model):
    oscar = bench_e2e.oscar_config(64)
    per_seq = bench_e2e.sequence_cache_bytes("int2", 700, 2, 2, oscar)
    import jax
    import jax.numpy as jnp

    from oscar_jax.model import init_params

    weights = bench_e2e.param_bytes(init_params(tiny_model, jax.random.key(0), dtype=jnp.bfloat16))["weight_bytes"]
    memory = weights + 3 * per_seq + per_seq // 2
    snapshots = []  # what a run cut off after each measurement would have saved
    result = bench_e2e.run(contexts=(500, 700), floor_gb_per_s=100.0, model=tiny_model, oscar=oscar,
                           capacity_context=700, memory_bytes=memory, reserve_bytes=0, steps=2, trials=2,
                           interpret=True, on_progress=lambda partial: snapshots.append(json.dumps(partial)))
    partial_runs = [len(json.loads(s)["runs"]) for s in snapshots]
    assert partial_runs[:4] == [1, 2, 3, 4] and json.loads(snapshots[-1])["capacity"].keys() >= {"int2", "bf16"}
    assert result["weight_bytes"] == weights
    assert [(r["cache"], r["context"]) for r in result["runs"]] == [
        ("int2", 500), ("int2", 700), ("bf16", 500), ("bf16", 700)]
    for r in result["runs"]:
        assert r["logits_finite"] and r["deterministic"]
        assert r["pools_moved"] == []  # the donated step updated every pool in place
        kv = bench_e2e.kv_bytes_read(r["cache"], r["context"], 1, 2, 2, oscar)
        assert r["kv_bytes_read"] == kv
        assert r["floor_s"] == pytest.approx((r["weight_bytes_read"] + kv) / 100e9)
        assert r["step_over_floor"] == pytest.approx(r["median_s"] / r["floor_s"])
        assert 0 < r["dispatch_median_s"] <= r["max_s"]  # handing the steps over ends before they finish
    assert result["runs"][1]["tiers"] == {"sink_tokens": 64, "history_tokens": 320, "recent_tokens": 316}
    cap = result["capacity"]
    assert cap["int2"]["max_concurrent_100k"] == 3 and cap["int2"]["built_batch"] == 3
    bf16_seq = bench_e2e.sequence_cache_bytes("bf16", 700, 2, 2, oscar)
    assert cap["bf16"]["max_concurrent_100k"] == (memory - weights) // bf16_seq
    for kind in ("int2", "bf16"):
        entry = cap[kind]
        if entry["built_batch"]:
            assert entry["tokens_per_s_at_capacity"] == pytest.approx(entry["built_batch"] / entry["step"]["median_s"])
            assert entry["step"]["logits_finite"]


@pytest.mark.slow
def test_run_steps_only_the_named_caches(tiny_model):
    oscar = bench_e2e.oscar_config(64)
    result = bench_e2e.run(contexts=(500,), model=tiny_model, oscar=oscar, capacity_context=None, steps=1,
                           trials=1, interpret=True, kinds=("bf16",))
    assert [(r["cache"], r["context"]) for r in result["runs"]] == [("bf16", 500)]
    with pytest.raises(ValueError, match="fp8"):
        bench_e2e.run(contexts=(500,), model=tiny_model, oscar=oscar, capacity_context=None, kinds=("fp8",))
