"""benchmarks.compare_runs on the fake raw files of test_summarize: identical runs agree, a moved
figure is named with its change, a change of which BF16 variant is fastest is named."""

import pytest

from benchmarks import compare_runs as C
from benchmarks.tests.test_summarize import fake_results, write_files


def _dirs(tmp_path, new_results):
    base = write_files(_mkdir(tmp_path / "base"), fake_results())
    new = write_files(_mkdir(tmp_path / "new"), new_results)
    return base, new


def _mkdir(path):
    path.mkdir()
    return path


def test_identical_runs_agree_on_every_figure(tmp_path):
    report = C.compare(*_dirs(tmp_path, fake_results()), tolerance=0.05)
    groups = {r["group"] for r in report["rows"]}
    assert groups == {"summary", "decode", "write", "e2e"}
    assert report["outside"] == [] and report["missing"] == []
    assert all(r["change"] == 0.0 for r in report["rows"])


def test_a_moved_figure_is_named_with_its_change(tmp_path):
    new = fake_results()
    config = next(c for c in new["decode"]["configs"] if (c["context"], c["batch"]) == (131072, 8))
    config["variants"]["bf16_paged_pallas"]["median_s"] *= 1.10  # the fastest BF16, 10 % slower
    new["e2e"]["capacity"]["int2"]["built_batch"] = 30
    report = C.compare(*_dirs(tmp_path, new), tolerance=0.05)
    rows = {r["label"]: r for r in report["rows"]}
    assert rows["ctx 131072 b8 bf16_paged_pallas"]["change"] == pytest.approx(0.10)
    assert rows["ctx 131072 b8 fastest BF16 (bf16_paged_pallas)"]["outside"]
    assert rows["int2 sequences of 100K built"]["change"] == pytest.approx(-0.25)
    # the speed-ups at 128K b8 follow their baseline
    assert rows["decode_speedup_vs_best_bf16.128k_b8.jax"]["change"] == pytest.approx(0.10)
    assert set(report["outside"]) == {"ctx 131072 b8 bf16_paged_pallas", "ctx 131072 b8 fastest BF16 (bf16_paged_pallas)",
                                      "int2 sequences of 100K built",
                                      "decode_speedup_vs_best_bf16.128k_b8.jax",
                                      "decode_speedup_vs_best_bf16.128k_b8.torch",
                                      "capacity_100k_int2_over_bf16.whole_sequences"}
    text = C.render(report)
    assert "| decode | ctx 131072 b8 bf16_paged_pallas | 3000 | 3300 | µs | +10.0% **outside** |" in text


def test_a_change_of_the_fastest_bf16_is_named(tmp_path):
    new = fake_results()
    config = next(c for c in new["decode"]["configs"] if (c["context"], c["batch"]) == (131072, 1))
    config["variants"]["cudnn_bf16"]["median_s"] = 490e-6  # now faster than FA2's 500
    report = C.compare(*_dirs(tmp_path, new), tolerance=0.05)
    row = next(r for r in report["rows"] if r["label"].startswith("ctx 131072 b1 fastest BF16"))
    assert "flash2_bf16 → cudnn_bf16" in row["label"]
    assert row["base"] == pytest.approx(500.0) and row["new"] == pytest.approx(490.0)
    assert not row["outside"]


def test_a_missing_figure_and_a_bad_tolerance(tmp_path):
    new = fake_results()
    config = next(c for c in new["decode"]["configs"] if (c["context"], c["batch"]) == (8192, 1))
    config["variants"]["oscar_int2_triton"] = {"error": "RuntimeError: out of resources"}
    base, new_dir = _dirs(tmp_path, new)
    report = C.compare(base, new_dir, tolerance=0.05)
    assert "ctx 8192 b1 oscar_int2_triton" in report["missing"]
    with pytest.raises(ValueError, match="tolerance must be a fraction in \\(0, 1\\), got 5"):
        C.compare(base, new_dir, tolerance=5)
