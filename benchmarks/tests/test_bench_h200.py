"""bench_h200's decode section on CPU with the GPU parts faked: a config cut off by the per-call
time limit leaves what it measured in decode_partial_h200.json, and decode_h200.json keeps only
complete configs (merged ones included)."""

import json

import pytest

from benchmarks import bench_decode, bench_h200, harness


class TimeLimit(Exception):
    pass


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "fake", "jax": "-", "torch": "-", "triton": "-",
                                                        "git_sha": "abc1234"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: {"torch": {"gb_per_s": 1.0}, "jax": {"gb_per_s": 2.0},
                                                            "gb_per_s": 2.0})


def _fake_run_config(stop_after):
    def run_config(context, batch, group_size, tuning=None, triton_tuning=None, on_variant=None):
        result = {"context": context, "batch": batch, "variants": {}}
        for i, name in enumerate(["oscar_int2_pallas", "oscar_int2_triton", "cudnn_bf16"]):
            if (context, batch, i) == stop_after:
                raise TimeLimit
            result["variants"][name] = {"median_s": 1e-4 * (i + 1), "passed": True}
            on_variant(result)
        return result
    return run_config


def test_a_cut_off_config_is_kept_apart_and_complete_ones_merge(fake_gpu, monkeypatch, tmp_path):
    earlier = {"context": 8192, "batch": 1, "variants": {"old": {}}, "git_sha": "0000000"}
    (tmp_path / "decode_h200.json").write_text(json.dumps({"configs": [earlier]}))
    monkeypatch.setattr(bench_decode, "run_config", _fake_run_config(stop_after=(131072, 8, 2)))
    with pytest.raises(TimeLimit):
        bench_h200.main(["--sections", "decode", "--contexts", "32768,131072", "--batches", "8", "--merge",
                         "--no-tuning", "--out", str(tmp_path)])
    complete = json.loads((tmp_path / "decode_h200.json").read_text())["configs"]
    assert [(c["context"], c["batch"], c["git_sha"]) for c in complete] == [(8192, 1, "0000000"), (32768, 8, "abc1234")]
    assert sorted(complete[1]["variants"]) == ["cudnn_bf16", "oscar_int2_pallas", "oscar_int2_triton"]
    partial = json.loads((tmp_path / "decode_partial_h200.json").read_text())["configs"]
    assert [(c["context"], c["batch"], c["git_sha"]) for c in partial] == [(131072, 8, "abc1234")]
    assert sorted(partial[0]["variants"]) == ["oscar_int2_pallas", "oscar_int2_triton"]
