"""profile_e2e's trace arithmetic on synthetic kernel events (the GPU trace itself is not tested)."""

import pytest

from benchmarks import profile_e2e


def test_busy_span_and_idle_of_overlapping_and_gapped_kernels():
    # Two steps. Step kernels: [0, 10) and [5, 12) overlap (busy 12), then a gap, then [20, 30).
    events = [("int2_tier_kernel", 0, 10), ("bf16_tier_kernel", 5, 7), ("nvjet_gemm", 20, 10),
              ("loop_fusion", 100, 10), ("write_bf16_pages", 115, 5), ("cutlass_gemm", 130, 20)]
    s = profile_e2e.summarize_kernels(events, steps=2)
    assert s["kernels_per_step"] == 3
    assert s["span_us_per_step"] == pytest.approx(150 / 2 / 1e3)
    busy = 12 + 10 + 10 + 5 + 20
    assert s["busy_us_per_step"] == pytest.approx(busy / 2 / 1e3)
    assert s["idle_us_per_step"] == pytest.approx((150 - busy) / 2 / 1e3)
    cats = s["categories"]
    assert cats["attention"]["us_per_step"] == pytest.approx(17 / 2 / 1e3)
    assert cats["gemm"]["launches_per_step"] == 1.0 and cats["gemm"]["us_per_step"] == pytest.approx(30 / 2 / 1e3)
    assert cats["cache_write"]["us_per_step"] == pytest.approx(5 / 2 / 1e3)
    assert cats["other"]["us_per_step"] == pytest.approx(10 / 2 / 1e3)
    assert s["top_kernels"][0]["name"] == "cutlass_gemm"
    # Gaps keyed by the kernel that ended last before each (bf16_tier_kernel, not the earlier-ending
    # int2 one) and the next to start; their sum is the idle time.
    gaps = {(g["after"], g["before"]): g["us_per_step"] * 2e3 for g in s["top_idle_gaps"]}
    assert gaps == pytest.approx({("nvjet_gemm", "loop_fusion"): 70, ("write_bf16_pages", "cutlass_gemm"): 10,
                                  ("bf16_tier_kernel", "nvjet_gemm"): 8, ("loop_fusion", "write_bf16_pages"): 5})
    assert sum(gaps.values()) == pytest.approx(150 - busy)
    assert [g["after"] for g in s["top_idle_gaps"]][0] == "nvjet_gemm"


def test_idle_gaps_count_a_pallas_kernel_of_every_layer_as_one():
    events = [("oscar_int2_tier__3", 0, 10), ("merge", 12, 1), ("oscar_int2_tier__4", 20, 10), ("merge", 32, 1)]
    first, second = profile_e2e.summarize_kernels(events, steps=1)["top_idle_gaps"]
    assert (first["after"], first["before"], first["gaps_per_step"]) == ("merge", "oscar_int2_tier", 1)
    assert first["us_per_step"] == pytest.approx(7 / 1e3)
    assert (second["after"], second["before"], second["gaps_per_step"]) == ("oscar_int2_tier", "merge", 2)
    assert second["us_per_step"] == pytest.approx(4 / 1e3) and second["mean_us"] == pytest.approx(2 / 1e3)


def test_no_events():
    assert profile_e2e.summarize_kernels([], steps=3) == {"kernels": 0}


def test_hlo_origin_maps_trace_names_to_the_instruction_metadata():
    hlo = "\n".join([
        '  %input_reduce_fusion.215 = f32[1,8,4,128]{3,2,1,0} fusion(%p0, %p1), kind=kInput, calls=%fused_reduce, '
        'metadata={op_name="jit(decode_step)/dot_general" source_file="/work/oscar_jax/cache.py" source_line=134}',
        '  %input_reduce_fusion.21 = f32[4096]{0} fusion(%p2), kind=kInput, calls=%r2, metadata={op_name="jit(x)/rms"}',
        '  ROOT %gemm_fusion_dot.327 = bf16[1,12288]{1,0} fusion(%a, %b), kind=kCustom, calls=%g',
    ])
    assert profile_e2e.hlo_origin(hlo, "input_reduce_fusion_215") == "jit(decode_step)/dot_general @ cache.py:134"
    assert profile_e2e.hlo_origin(hlo, "input_reduce_fusion_21") == "jit(x)/rms"  # not confused with .215
    assert profile_e2e.hlo_origin(hlo, "gemm_fusion_dot_327") is None  # found, but no metadata
    assert profile_e2e.hlo_origin(hlo, "loop_add_fusion_70") is None  # not in the module


def test_probe_gemv_reads_the_kernel_kinds_of_an_hlo_module():
    from benchmarks import probe_gemv

    hlo = ('%f = bf16[1,1024] fusion(%a, %b), kind=kInput, calls=%r\n'
           '%g = bf16[1,4096] fusion(%a, %c), kind=kCustom, calls=%t\n'
           '%h = (bf16[1,4096], s8[0]) custom-call(%a, %c), custom_call_target="__cublas$gemm"\n'
           '%i = bf16[1,1024] fusion(%a, %d), kind=kInput, calls=%r2\n')
    assert probe_gemv.kernel_kinds(hlo) == ["__cublas$gemm", "kCustom", "kInput"]


def test_probe_gemv_widths_are_qwen3_8b_projections():
    from benchmarks import bench_e2e, probe_gemv

    assert probe_gemv.widths(bench_e2e.qwen3_8b_config()) == {
        "k_or_v": 1024, "k_and_v": 2048, "q": 4096, "q_k_v": 6144, "gate_or_up": 12288}
