"""bench_tp's plumbing on 2 fake CPU devices (a subprocess: the device-count flag must reach XLA
before JAX initialises): every row runs, its checks pass, tp 2 halves what each device holds, and
the tp-1 comparisons are filled in. The GPU timings themselves are not tested."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark's plumbing (as bench_serve's and bench_e2e's): the full suite
def test_bench_tp_tiny_on_two_cpu_devices(tmp_path):
    out = tmp_path / "tp.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               OSCAR_GIT_SHA="test")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_tp", "--tiny", "--tp", "1", "2", "--contexts", "80",
                           "--batches", "2", "--steps", "2", "--trials", "1", "--mesh-of-one", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = {(r["kind"], r["tp"], r["mesh"]): r for r in result["rows"]}
    assert set(rows) == {(k, t, m) for k in ("int2", "bf16") for t, m in ((1, False), (1, True), (2, True))}
    for (kind, tp, _), row in rows.items():
        assert row["checks"]["logits_finite"] and row["checks"]["deterministic"], (kind, tp, row["checks"])
        assert row["checks"]["pools_moved"] == [], (kind, tp)
        assert row["timing"]["median_s"] > 0
        assert row["capacity"]["kv_heads_per_device"] == 2 // tp
        assert row["step_ratio_vs_tp1"] > 0
        if tp == 2:
            assert row["collectives_s"] is None and "cpu" in row["collectives_note"]
            one = rows[(kind, 1, False)]["capacity"]
            # Each device holds half the KV bytes of a sequence and about half the weights
            # (norms are replicated).
            assert row["capacity"]["device_bytes_per_sequence"] * 2 == one["device_bytes_per_sequence"]
            weights = row["capacity"]["device_weight_bytes"]
            assert 0.5 * one["device_weight_bytes"] <= weights < 0.51 * one["device_weight_bytes"]
    assert result["environment"]["git_sha"] == "test"
