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


def test_no_events():
    assert profile_e2e.summarize_kernels([], steps=3) == {"kernels": 0}
