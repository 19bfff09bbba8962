"""benchmarks.summarize on small fake raw files: exact keys, computed values, missing files,
malformed files."""

import json

import pytest

from benchmarks import summarize as S

ENV = {"gpu": "NVIDIA H200", "git_sha": "abc123", "date_utc": "2026-11-30T00:00:00Z", "jax": "0.11.2"}
COPY = {"torch": {"gb_per_s": 2000.0}, "jax": {"gb_per_s": 4000.0}, "gb_per_s": 4000.0}


def _variant(median_s, bytes_read, passed=True):
    return {"rel_error": 1e-3, "passed": passed, "bytes_read": bytes_read, "median_s": median_s,
            "gb_per_s": bytes_read / median_s / 1e9}


def _config(context, batch, pallas_s, triton_s, cudnn_s, tuned_s=None):
    int2, bf16 = 3_000_000_000, 8_000_000_000
    variants = {"oscar_int2_pallas": _variant(pallas_s, int2), "oscar_int2_triton": _variant(triton_s, int2),
                "cudnn_bf16": _variant(cudnn_s, bf16), "flash2_bf16": _variant(cudnn_s / 2, bf16),
                "bf16_paged_pallas": {"rel_error": 0.5, "passed": False, "bytes_read": bf16}}
    if tuned_s is not None:
        variants["oscar_int2_pallas[{'pages_per_split': 16}]"] = _variant(tuned_s, int2)
        variants["oscar_int2_pallas[{'pages_per_split': 8}]"] = {"error": "ValueError: bad tiling"}
    return {"context": context, "batch": batch, "group_size": 128, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
            "page_size": 64, "sink": 64, "recent": 256, "int2_bytes_read": int2, "bf16_bytes_read": bf16,
            "variants": variants}


def _timing(median_s, bytes_moved):
    return {"median_s": median_s, "gb_per_s": bytes_moved / median_s / 1e9}


def fake_results():
    decode = {"section": "decode", "environment": ENV, "copy_bandwidth": COPY, "configs": [
        _config(8192, 1, 1e-5, 1.2e-5, 5e-5),
        _config(131072, 1, 100e-6, 125e-6, 1000e-6, tuned_s=80e-6),  # best jax = the tuned 80 µs
        _config(131072, 8, 500e-6, 400e-6, 4000e-6),
    ]}
    write = {"section": "write", "environment": ENV, "copy_bandwidth": COPY,
             "write_pages": [{"tokens": 65536, "group_size": 128, "rows_dtype": "float32", "bytes_moved": 4 * 10**9,
                              **{v: {"jax_torch_bit_identical": True, "pallas": _timing(2e-3, 4e9),
                                     "triton": _timing(1e-3, 4e9)} for v in ("unrotated", "rotated")}}],
             "demote": [{"pages": 32, "layers": 36, "group_size": 128, "bytes_moved": 10**9,
                         "jax_torch_bit_identical": True, "pallas": _timing(1e-3, 1e9), "triton": _timing(1e-3, 1e9)}]}
    runs = []
    for cache, step, floor in (("int2", 0.012, 0.010), ("bf16", 0.030, 0.020)):
        for context in (30000, 100000):
            runs.append({"cache": cache, "context": context, "batch": 1, "median_s": step, "floor_s": floor,
                         "step_over_floor": step / floor, "weight_bytes_read": 16 * 10**9,
                         "kv_bytes_read": 10**9, "logits_finite": True, "deterministic": True})
    e2e = {"section": "e2e", "environment": ENV, "copy_bandwidth": COPY, "model_name": "qwen3-8b shapes",
           "model": {"num_layers": 36}, "oscar": {"page_size": 64, "group_size": 128}, "runs": runs,
           "capacity": {"context": 100000, "memory_bytes": 100 * 2**30, "memory_source": "test",
                        "workspace_reserve_bytes": 4 * 2**30,
                        "int2": {"per_sequence_bytes": 2 * 10**9, "max_concurrent_100k": 40, "built_batch": 40,
                                 "step": {"median_s": 0.04}, "tokens_per_s_at_capacity": 1000.0},
                        "bf16": {"per_sequence_bytes": 15 * 10**9, "max_concurrent_100k": 5, "built_batch": 5,
                                 "step": {"median_s": 0.025}, "tokens_per_s_at_capacity": 200.0}}}
    results = {"decode": decode, "write": write, "e2e": e2e,
               "copy": {"section": "copy", "environment": ENV, "copy_bandwidth": COPY}}
    return json.loads(json.dumps(results))  # no shared sub-objects between files


def write_files(tmp_path, results):
    for section, data in results.items():
        (tmp_path / f"{section}_h200.json").write_text(json.dumps(data))
    return tmp_path


def test_summary_keys_and_values(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    summary = S.summarize(write_files(tmp_path, fake_results()), md)
    on_disk = json.loads((tmp_path / "summary_h200.json").read_text())
    assert on_disk == summary
    assert tuple(summary) == S.SUMMARY_KEYS
    assert summary["decode_speedup_vs_cudnn_bf16_128k_b1"] == {"jax": pytest.approx(1000 / 80),
                                                               "torch": pytest.approx(1000 / 125)}
    assert summary["decode_speedup_vs_cudnn_bf16_128k_b8"] == {"jax": pytest.approx(4000 / 500),
                                                               "torch": pytest.approx(10.0)}
    # batch 8 is present: 3e9 B / 500 µs = 6000 GB/s over 4000 GB/s copy
    assert summary["decode_fraction_of_copy_bandwidth_128k"] == {"jax": pytest.approx(1.5),
                                                                 "torch": pytest.approx(3e9 / 400e-6 / 1e9 / 4000)}
    assert summary["e2e_decode_step_over_bandwidth_floor"] == {"int2": pytest.approx(1.2), "bf16": pytest.approx(1.5)}
    assert summary["concurrent_100k_sequences_int2_over_bf16"] == {"jax": pytest.approx(8.0)}
    assert summary["throughput_at_capacity_100k_int2_over_bf16"] == {"jax": pytest.approx(5.0)}
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert provenance["decode_speedup_vs_cudnn_bf16_128k_b1"]["jax_variant"] == \
        "oscar_int2_pallas[{'pages_per_split': 16}]"
    assert provenance["decode_fraction_of_copy_bandwidth_128k"]["batch"] == 8
    for png in ("decode_time_vs_context.png", "decode_bandwidth.png", "e2e_step_vs_floor.png"):
        assert (tmp_path / png).stat().st_size > 0
    text = md.read_text()
    assert "abc123" in text and "NVIDIA H200" in text
    assert "| decode speedup vs cuDNN BF16, 128K, b1, jax | 12.50× | ≥ 5× | met |" in text
    assert "| e2e decode step / bandwidth floor, 100K, int2 cache | 1.20× | ≤ 1.15× | **not met** |" in text
    assert "| concurrent 100K sequences, INT2 / BF16 | 8.00× | ≥ 6.5× | met |" in text
    assert "| Pallas vs Triton time gap, 128K, b8 | 25.0% | ≤ 15% | **not met** |" in text
    # write: pallas 2000 GB/s / 4000 = 50 % (met), triton 4000 / 4000 worst-case… demote 1000 / 4000 = 25 %
    assert "| write path (worst case) / copy bandwidth, pallas | 25.0% | ≥ 50% | **not met** |" in text
    assert "ValueError: bad tiling" in text  # errored variants are listed
    assert "(this run: batch 8)" in text


def test_decode_rows_name_the_sha_of_their_config(tmp_path):
    """`bench_h200 --merge` keeps configs of earlier runs: each decode row names its own code."""
    results = fake_results()
    results["decode"]["configs"][0]["git_sha"] = "1111111aaaa"
    results["decode"]["configs"][1]["git_sha"] = "2222222bbbb"
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(write_files(tmp_path, results), md, plots=False)
    rows = [line for line in md.read_text().splitlines() if "`oscar_int2_pallas` |" in line]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["`1111111`", "`2222222`", "—"]


def test_benchmarks_md_says_how_each_jax_row_was_timed(tmp_path):
    """Configs timed by one program's wall time (before v16) and by the chained-program difference may
    sit in one merged file: the conditions name both."""
    from benchmarks import harness

    results = fake_results()
    results["decode"]["configs"][1]["variants"]["oscar_int2_pallas"]["method"] = harness.JAX_TIMING_METHOD
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(write_files(tmp_path, results), md, plots=False)
    line = next(x for x in md.read_text().splitlines() if x.startswith("Timing: torch"))
    assert f"`{harness.JAX_TIMING_METHOD}`" in line and "before v16" in line


def test_a_tree_that_differed_from_its_sha_is_a_warning(tmp_path):
    results = fake_results()
    results["write"]["environment"]["git_tree_matches_head"] = False
    S.summarize(write_files(tmp_path, results), tmp_path / "BENCHMARKS.md", plots=False)
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert any("write_h200.json" in w and "differed" in w for w in provenance["warnings"])


def test_the_recorded_tree_is_checked_against_the_sha(tmp_path):
    """git_worktree_tree (harness) against the recorded sha's tree in this checkout: equal → no
    warning (even with the device's stale-.git flag); different or unknown sha → a warning."""
    from benchmarks.harness import git_commit_tree, git_head

    head = git_head(S.REPO_ROOT)
    results = fake_results()
    env = results["write"]["environment"]
    env.update(git_sha=head, git_tree_matches_head=False, git_worktree_tree=git_commit_tree(head, S.REPO_ROOT))

    def warnings():
        S.summarize(write_files(tmp_path, results), tmp_path / "BENCHMARKS.md", plots=False)
        provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
        return [w for w in provenance["warnings"] if "write_h200.json" in w]

    assert warnings() == []
    env["git_worktree_tree"] = "0" * 40
    assert any("differed" in w for w in warnings())
    env["git_sha"] = "f" * 40
    assert any("not a commit of this checkout" in w for w in warnings())


def test_concurrency_counts_built_batches_not_the_accounting(tmp_path):
    results = fake_results()
    results["e2e"]["capacity"]["int2"]["built_batch"] = 30  # 40 by the byte accounting
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["concurrent_100k_sequences_int2_over_bf16"] == {"jax": pytest.approx(6.0)}
    results["e2e"]["capacity"]["bf16"].update(built_batch=0, tokens_per_s_at_capacity=None)
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["concurrent_100k_sequences_int2_over_bf16"] == {"jax": None}
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert any("bf16 0" in w and "byte accounting" in w for w in provenance["warnings"])


def test_fraction_falls_back_to_batch_1(tmp_path):
    results = fake_results()
    results["decode"]["configs"] = results["decode"]["configs"][:2]
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_fraction_of_copy_bandwidth_128k"]["jax"] == pytest.approx(3e9 / 80e-6 / 1e9 / 4000)
    assert summary["decode_speedup_vs_cudnn_bf16_128k_b8"] is None
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert provenance["decode_fraction_of_copy_bandwidth_128k"]["batch"] == 1
    assert any("batch 8" in w for w in provenance["warnings"])


def test_failed_variant_gives_null(tmp_path):
    results = fake_results()
    results["decode"]["configs"][1]["variants"]["oscar_int2_triton"] = {"error": "RuntimeError: no kernel"}
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_speedup_vs_cudnn_bf16_128k_b1"] == {"jax": pytest.approx(12.5), "torch": None}


@pytest.mark.parametrize("missing", ["decode", "write", "e2e", "copy"])
def test_missing_file_gives_nulls_and_a_warning(tmp_path, capsys, missing):
    results = fake_results()
    del results[missing]
    md = tmp_path / "BENCHMARKS.md"
    summary = S.summarize(write_files(tmp_path, results), md)
    assert tuple(summary) == S.SUMMARY_KEYS
    assert f"{missing}_h200.json is missing" in capsys.readouterr().err
    if missing == "decode":
        assert all(summary[k] is None for k in S.SUMMARY_KEYS[:3])
        assert summary["e2e_decode_step_over_bandwidth_floor"] is not None
    if missing == "e2e":
        assert all(summary[k] is None for k in S.SUMMARY_KEYS[3:])
        assert summary["decode_speedup_vs_cudnn_bf16_128k_b1"] is not None
    assert f"`{missing}_h200.json`" in md.read_text()


def test_no_files_at_all(tmp_path):
    summary = S.summarize(tmp_path, tmp_path / "B.md")
    assert summary == {k: None for k in S.SUMMARY_KEYS}
    assert "No result files yet." in (tmp_path / "B.md").read_text()


@pytest.mark.parametrize("section, mutate, message", [
    ("decode", lambda d: d.pop("configs"), r"decode_h200.json: missing key 'configs'"),
    ("decode", lambda d: d["configs"][1]["variants"]["cudnn_bf16"].pop("median_s"),
     r"decode_h200.json: configs\[1\].variants\['cudnn_bf16'\]: missing key 'median_s'"),
    ("decode", lambda d: d["configs"][0].update(context="8192"), r"configs\[0\]\.context: expected int, got str"),
    ("copy", lambda d: d["copy_bandwidth"].pop("gb_per_s"), r"copy_h200.json: copy_bandwidth: missing key 'gb_per_s'"),
    ("write", lambda d: d["demote"][0].pop("triton"), r"write_h200.json: demote\[0\]: missing key 'triton'"),
    ("e2e", lambda d: d["runs"][2].update(cache="fp8"), r"e2e_h200.json: runs\[2\].cache: must be 'int2' or 'bf16'"),
    ("e2e", lambda d: d["capacity"]["int2"].update(max_concurrent_100k=True),
     r"capacity.int2.max_concurrent_100k: expected int, got bool"),
])
def test_malformed_file_raises_a_clear_error(tmp_path, section, mutate, message):
    results = fake_results()
    mutate(results[section])
    write_files(tmp_path, results)
    with pytest.raises(S.ResultsError, match=message):
        S.summarize(tmp_path, None, plots=False)


def test_invalid_json_and_cli_exit(tmp_path):
    write_files(tmp_path, fake_results())
    (tmp_path / "e2e_h200.json").write_text("{not json")
    with pytest.raises(S.ResultsError, match="e2e_h200.json: not valid JSON"):
        S.summarize(tmp_path, None, plots=False)
    with pytest.raises(SystemExit, match="error: e2e_h200.json"):
        S.main(["--results", str(tmp_path), "--markdown", str(tmp_path / "B.md"), "--no-plots"])


def test_torch_uses_the_fastest_passing_triton_tiling(tmp_path):
    results = fake_results()
    variants = results["decode"]["configs"][1]["variants"]
    variants["oscar_int2_triton[{'pages_per_split': 16, 'pages_per_block': 1}]"] = _variant(100e-6, 3_000_000_000)
    variants["oscar_int2_triton[{'pages_per_split': 64, 'pages_per_block': 1}]"] = _variant(
        50e-6, 3_000_000_000, passed=False)  # faster but failed its check: ignored
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_speedup_vs_cudnn_bf16_128k_b1"]["torch"] == pytest.approx(10.0)
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert provenance["decode_speedup_vs_cudnn_bf16_128k_b1"]["torch_variant"] == \
        "oscar_int2_triton[{'pages_per_split': 16, 'pages_per_block': 1}]"


def test_a_config_takes_the_copy_bandwidth_of_its_own_run(tmp_path):
    """Merged files hold configs of several runs: a config's fractions use the copy bandwidth its
    own run recorded (else the file's); a non-positive one is refused."""
    results = fake_results()
    results["decode"]["configs"][2]["copy_gb_per_s"] = 2000.0  # 128K b8
    md = tmp_path / "BENCHMARKS.md"
    summary = S.summarize(write_files(tmp_path, results), md)
    assert summary["decode_fraction_of_copy_bandwidth_128k"] == {"jax": pytest.approx(3.0),
                                                                 "torch": pytest.approx(3e9 / 400e-6 / 1e9 / 2000)}
    assert "| 131072 | 8 | `oscar_int2_pallas` | 500.0 | 6000 | 3.00 |" in md.read_text()
    assert "| 131072 | 1 | `oscar_int2_pallas` | 100.0 | 30000 | 7.50 |" in md.read_text()  # the file's 4000
    results["decode"]["configs"][2]["copy_gb_per_s"] = 0
    with pytest.raises(S.ResultsError, match=r"configs\[2\]: copy_gb_per_s must be > 0"):
        S.summarize(write_files(tmp_path, results), md)
