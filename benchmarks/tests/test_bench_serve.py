"""bench_serve on CPU: its plumbing at toy sizes (2 layers; both caches, both arrival patterns,
once through HTTP) and its summary arithmetic. The GPU figures themselves are not tested."""

import dataclasses
import json
import math

import pytest

from benchmarks import bench_serve
from oscar_jax.serving.engine import StepTiming

pytestmark = pytest.mark.kernels("xla")


def test_summary_of_a_hand_made_run():
    run = {"t0": 0.0, "arrivals": [0.0, 1.0],
           "token_times": [[0.5, 0.7, 1.0], [1.5, 1.6, 2.0]],
           "steps": [StepTiming(2, 0, 0.2, 0.15), StepTiming(40, 0, 0.1, 0.095), StepTiming(1, 16, 0.3, 0.2)]}
    s = bench_serve.summarize_run(run, 3)
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["itl_s"]["p50"] == pytest.approx(0.25)  # gaps 0.2, 0.3, 0.1, 0.4
    assert s["decode_step_s"]["p50"] == pytest.approx(0.15)  # the prefill step is left out
    assert s["decode_tokens_per_s"] == pytest.approx(42 / 0.3)  # rows over the decode-only steps' time
    assert s["host_share_at_batch_32"]["p50"] == pytest.approx(0.05)  # only the batch-40 step
    assert s["prefill_steps_total_s"] == pytest.approx(0.3)
    with pytest.raises(AssertionError, match="every output token"):
        bench_serve.summarize_run(run, 4)


def test_targets_compare_int2_with_bf16_at_the_longest_prompt():
    row = dict(host_share_at_batch_32=None, itl_s={"p99": 0.03}, decode_step_s={"p50": 0.02})
    results = [dict(row, kind="int2", prompt_len=100, rate=math.inf, output_tokens_per_s=40.0, decode_tokens_per_s=300.0,
                    prefill_steps_total_s=2.0, duration_s=3.0),
               dict(row, kind="bf16", prompt_len=100, rate=math.inf, output_tokens_per_s=10.0, decode_tokens_per_s=50.0,
                    prefill_steps_total_s=2.5, duration_s=12.0),
               dict(row, kind="bf16", prompt_len=10, rate=math.inf, output_tokens_per_s=1.0)]
    t = bench_serve.targets(results, None)
    assert t["int2_over_bf16_output_tokens_per_s"] == {"prompt_len": 100, "value": 4.0, "target": 3.5, "met": True}
    assert t["itl_p99_over_median_step"]["value"] == pytest.approx(1.5) and t["itl_p99_over_median_step"]["met"]
    assert t["int2_over_bf16_decode_tokens_per_s"] == {"prompt_len": 100, "value": pytest.approx(6.0)}
    assert t["int2_over_bf16_ceiling"] == {"prompt_len": 100, "value": pytest.approx(6.0)}  # 12 s over 2 s
    assert "device_idle_share_with_overlap" not in t  # no run without overlap to bound it by


def test_with_both_overlap_modes_the_caches_compare_with_overlap_and_its_idle_share_is_bounded():
    base = dict(kind="int2", prompt_len=100, rate=math.inf, itl_s={"p99": 0.03}, decode_step_s={"p50": 0.02},
                host_share_at_batch_32={"p50": 0.2}, decode_tokens_per_s=1.0, duration_s=1.0)
    on = dict(base, overlap=True, output_tokens_per_s=40.0, step_at_batch_32_s={"p50": 0.0125},
              device_wait_at_batch_32_s={"p50": 0.004})
    off = dict(base, overlap=False, output_tokens_per_s=30.0, step_at_batch_32_s={"p50": 0.015},
               device_wait_at_batch_32_s={"p50": 0.0115})
    bf16 = dict(base, kind="bf16", overlap=True, output_tokens_per_s=10.0, step_at_batch_32_s=None)
    t = bench_serve.targets([on, off, bf16], None)
    assert t["int2_over_bf16_output_tokens_per_s"]["value"] == pytest.approx(4.0)  # the overlap run's 40, not 30
    assert t["host_share_at_batch_32"] == {"value": 0.2, "target": 0.1, "met": False, "overlap": False}
    assert t["host_share_at_batch_32_with_overlap_upper_bound"] == {"value": 0.2}  # no target: the host overlaps
    idle = t["device_idle_share_with_overlap"]
    assert idle["value"] == pytest.approx(1 - 0.0115 / 0.0125) and idle["met"]  # 8 %
    assert idle["runs"][0]["step_s"] == {"overlap": 0.0125, "no_overlap": 0.015}
    slow = dict(on, step_at_batch_32_s={"p50": 0.0125 * 2})
    assert not bench_serve.targets([slow, off], None)["device_idle_share_with_overlap"]["met"]  # 54 %


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path, monkeypatch):
    import benchmarks.harness

    monkeypatch.setattr(benchmarks.harness, "environment", lambda: {"gpu": "none"})
    out = tmp_path / "serve.json"
    assert bench_serve.main(["--tiny", "--overlap", "both", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    setup = bench_serve.tiny_setup()
    rows = [(r["kind"], r["prompt_len"], r["rate"], r["overlap"]) for r in result["results"]]
    assert sorted(rows) == sorted((k, n, r, o) for k in ("int2", "bf16") for n in setup.prompt_lens
                                  for r in (math.inf, 50.0) for o in (True, False))
    assert result["setup"]["overlap"] == [True, False] and result["setup"]["kinds"] == ["int2", "bf16"]
    for r in result["results"]:
        assert r["requests"] == setup.num_requests and r["output_tokens"] == setup.num_requests * setup.output_len
        assert r["output_tokens_per_s"] > 0 and r["ttft_s"]["p50"] > 0 and r["itl_s"]["p50"] > 0
    # the same memory holds more INT2 sequences than BF16 ones
    assert result["capacity"]["int2"] > result["capacity"]["bf16"] >= 1
    http = result["http"]
    assert http["http"]["output_tokens"] == http["engine"]["output_tokens"] == setup.num_requests * setup.output_len
    assert "int2_over_bf16_output_tokens_per_s" in result["targets"]


def test_int2_pools_stay_out_of_the_byte_range_the_gpu_kernels_cannot_index(monkeypatch):
    """Qwen3-8B shapes, 6 GiB of cache: 4456 INT2 pages would make 2.6 GB codes pools; on the
    compiled kernels' path the pools shrink below 2 GiB (and the log says what is left unused), the
    bench's capacity follows them, and pools above 4 GiB are kept whole."""
    import functools

    from benchmarks.bench_e2e import qwen3_8b_config
    from oscar_jax import ops, serve
    from shared_math.spec import OscarConfig

    cfg, config = qwen3_8b_config(), OscarConfig(head_dim=128)
    codes_page = cfg.num_layers * cfg.num_kv_heads * config.page_size * config.head_dim // 4
    assert serve.pages_for_memory("int2", 6 * bench_serve.GIB, cfg, config, 8)[1] * codes_page > 2**31  # XLA path
    monkeypatch.setattr(ops, "byte_array_addressable", functools.partial(ops.byte_array_addressable, interpret=False))
    said = []
    bf16, int2 = serve.pages_for_memory("int2", 6 * bench_serve.GIB, cfg, config, 8, log=said.append)
    assert int2 * codes_page <= 2**31 < (int2 + 1) * codes_page
    assert len(said) == 1 and f"using {int2}" in said[0] and "GiB of the cache memory unused" in said[0]
    assert serve.pages_for_memory("bf16", 6 * bench_serve.GIB, cfg, config, 8)[1] == 2  # BF16 pools: no limit
    big = serve.pages_for_memory("int2", 16 * bench_serve.GIB, cfg, config, 8, log=said.append)[1]
    assert big * codes_page > 2**32 and len(said) == 1


@pytest.mark.parametrize("kind", ["int2", "bf16"])
def test_the_prefill_split_reaches_the_cache(kind):
    """--prefill-split whole: one split over the longer page table of the kind's cache (the BF16
    cache's is its BF16 table); default leaves the tiling policy's (None)."""
    import jax

    from oscar_jax.model import init_params
    from shared_math.tiling import default_pages_per_block

    setup = bench_serve.tiny_setup()
    params = init_params(setup.model, jax.random.key(0))
    for policy in ("default", "whole", "3"):
        engine, _ = bench_serve.build_engine(dataclasses.replace(setup, prefill_split=policy), kind, params,
                                             max_model_len=200)
        runtime = engine.runtime
        bf16_slots = (runtime.config.sink + runtime.config.recent) // runtime.config.page_size
        split = runtime.cache.prefill_pages_per_split
        if policy == "default":
            assert split is None
        elif policy == "3":
            assert split == 3
        else:
            block = default_pages_per_block(runtime.config.page_size)
            assert split % block == 0 and split - block < max(runtime.history_slots, bf16_slots) <= split
            assert (bf16_slots if kind == "bf16" else runtime.history_slots) > 2  # the table that sets it


def test_an_int2_cache_for_prompts_inside_the_bf16_windows_is_built():
    """max_model_len within sink + recent: no history page a sequence (the capacity is the windows')."""
    import jax

    from oscar_jax.model import init_params

    setup = bench_serve.tiny_setup()
    params = init_params(setup.model, jax.random.key(0))
    engine, seqs = bench_serve.build_engine(setup, "int2", params, max_model_len=setup.sink + setup.recent)
    assert seqs >= 1 and engine.runtime.max_batch == seqs
