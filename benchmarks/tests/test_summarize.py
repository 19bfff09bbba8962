"""benchmarks.summarize on small fake raw files: every summary figure recomputed here by the
definitions (fastest BF16 of the same run, default launches only, read-only bandwidth), missing files,
malformed files."""

import json

import pytest

from benchmarks import bench_decode
from benchmarks import summarize as S

ENV = {"gpu": "NVIDIA H200", "git_sha": "abc123", "date_utc": "2026-11-30T00:00:00Z", "jax": "0.11.2"}
# read-only stream 5000 GB/s (file level), copy (read+write) 4000 GB/s: a figure taken against the
# copy instead of the read stream comes out 1.25x off and fails these tests.
COPY = {"torch": {"gb_per_s": 2000.0}, "jax": {"gb_per_s": 4000.0}, "gb_per_s": 4000.0,
        "torch_read_only": {"gb_per_s": 5000.0}, "read_gb_per_s": 5000.0}
INT2_BYTES = 300_000_000  # per sequence
BF16_BYTES = 2_000_000_000


def _variant(median_s, bytes_read, passed=True):
    return {"rel_error": 1e-3, "passed": passed, "bytes_read": bytes_read, "median_s": median_s,
            "gb_per_s": bytes_read / median_s / 1e9}


def _config(context, batch, pallas_s, triton_s, bf16_s: dict, *, sweep_s=None, read=None):
    """bf16_s: {variant: median} of the BF16 variants that passed; every other BF16 variant fails."""
    int2, bf16 = INT2_BYTES * batch, BF16_BYTES * batch
    variants = {"oscar_int2_pallas": _variant(pallas_s, int2), "oscar_int2_triton": _variant(triton_s, int2)}
    for name in S.BF16_VARIANTS:
        variants[name] = (_variant(bf16_s[name], bf16) if name in bf16_s
                          else _variant(1e-9, bf16, passed=False))  # fastest of all, but failed its check
    if sweep_s is not None:  # a faster tuning sweep: never enters the summary
        variants["oscar_int2_pallas[{'pages_per_split': 16}]"] = _variant(sweep_s, int2)
        variants["oscar_int2_triton[{'pages_per_split': 8}]"] = _variant(sweep_s, int2)
        variants["oscar_int2_pallas[{'pages_per_split': 8}]"] = {"error": "ValueError: bad tiling"}
    config = {"context": context, "batch": batch, "group_size": 128, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
              "page_size": 64, "sink": 64, "recent": 256, "int2_bytes_read": int2, "bf16_bytes_read": bf16,
              "variants": variants}
    if read is not None:
        config["read_gb_per_s"] = read
    return config


def _timing(median_s, bytes_moved):
    return {"median_s": median_s, "gb_per_s": bytes_moved / median_s / 1e9}


def fake_results():
    rows_cudnn, rows_fa2 = "cudnn_bf16_rows_as_queries", "flash2_bf16_rows_as_queries"
    decode = {"section": "decode", "environment": ENV, "copy_bandwidth": COPY, "configs": [
        _config(8192, 1, 20e-6, 10e-6, {"cudnn_bf16": 15e-6, "bf16_paged_pallas": 18e-6}),  # Pallas slower than BF16
        _config(32768, 1, 30e-6, 25e-6, {"cudnn_bf16": 120e-6, "flash2_bf16": 100e-6}),
        _config(32768, 8, 100e-6, 80e-6, {"cudnn_bf16": 400e-6, rows_cudnn: 350e-6}),  # rows form fastest
        # 128K b1: FA2 fastest (500); cuDNN, the rows form and the paged kernel slower
        _config(131072, 1, 100e-6, 125e-6, {"cudnn_bf16": 1000e-6, "flash2_bf16": 500e-6, rows_cudnn: 2000e-6,
                                            rows_fa2: 900e-6, "bf16_paged_pallas": 600e-6}, sweep_s=50e-6),
        # 128K b8: the project's paged kernel fastest (3000); read-only stream of its own run 4500
        _config(131072, 8, 1000e-6, 800e-6, {"cudnn_bf16": 4000e-6, "flash2_bf16": 3500e-6,
                                             "bf16_paged_pallas": 3000e-6}, sweep_s=400e-6, read=4500.0),
    ]}
    write = {"section": "write", "environment": ENV, "copy_bandwidth": COPY,
             "write_pages": [{"tokens": 65536, "group_size": 128, "rows_dtype": "float32", "bytes_moved": 4 * 10**9,
                              **{v: {"jax_torch_bit_identical": True, "pallas": _timing(2e-3, 4e9),
                                     "triton": _timing(1e-3, 4e9)} for v in ("unrotated", "rotated")}}],
             "demote": [{"pages": 32, "layers": 36, "group_size": 128, "bytes_moved": 10**9,
                         "jax_torch_bit_identical": True, "pallas": _timing(1e-3, 1e9), "triton": _timing(1e-3, 1e9)}]}
    runs = []
    for cache, step, kv in (("int2", 0.012, 10**9), ("bf16", 0.030, 8 * 10**9)):
        for context in (30000, 100000):
            # floor_s / step_over_floor as an older bench wrote them (against the copy): never read
            runs.append({"cache": cache, "context": context, "batch": 1, "median_s": step, "floor_s": 1.0,
                         "step_over_floor": 99.0, "weight_bytes_read": 16 * 10**9,
                         "kv_bytes_read": kv, "logits_finite": True, "deterministic": True})
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


def test_the_bf16_baselines_are_the_benchs():
    assert S.BF16_VARIANTS == bench_decode.BF16_VARIANTS
    assert tuple(S.DEFAULTS.values()) == bench_decode.INT2_DEFAULTS


def test_every_summary_figure_by_the_definitions(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    summary = S.summarize(write_files(tmp_path, fake_results()), md)
    on_disk = json.loads((tmp_path / "summary_h200.json").read_text())
    assert on_disk == summary
    assert tuple(summary) == S.SUMMARY_KEYS
    approx = pytest.approx
    # speed-up: the fastest passing BF16 of the same config over the default launch (never a sweep)
    assert summary["decode_speedup_vs_best_bf16"] == {
        "128k_b1": {"jax": approx(500 / 100), "torch": approx(500 / 125)},     # FA2
        "128k_b8": {"jax": approx(3000 / 1000), "torch": approx(3000 / 800)},  # the paged BF16 kernel
        "32k_b1": {"jax": approx(100 / 30), "torch": approx(100 / 25)},        # FA2
        "32k_b8": {"jax": approx(350 / 100), "torch": approx(350 / 80)},       # the rows-as-queries cuDNN
    }
    # fraction: bytes / default time / the read-only stream of the config's run (else the file's)
    read_b1, read_b8 = 5000e9, 4500e9
    assert summary["decode_fraction_of_read_bandwidth"] == {
        "128k_b1": {"jax": approx(INT2_BYTES / 100e-6 / read_b1), "torch": approx(INT2_BYTES / 125e-6 / read_b1)},
        "128k_b8": {"jax": approx(8 * INT2_BYTES / 1000e-6 / read_b8), "torch": approx(8 * INT2_BYTES / 800e-6 / read_b8)},
        "32k_b1": {"jax": approx(INT2_BYTES / 30e-6 / read_b1), "torch": approx(INT2_BYTES / 25e-6 / read_b1)},
        "32k_b8": {"jax": approx(8 * INT2_BYTES / 100e-6 / read_b1), "torch": approx(8 * INT2_BYTES / 80e-6 / read_b1)},
    }
    # e2e: step / ((weights + KV) / read-only bandwidth); the plain BF16 / INT2 step ratio
    assert summary["e2e_step_over_read_floor_100k_b1"] == {"int2": approx(0.012 / (17e9 / 5000e9)),
                                                           "bf16": approx(0.030 / (24e9 / 5000e9))}
    assert summary["e2e_bf16_over_int2_step_100k_b1"] == approx(0.030 / 0.012)
    # capacity: the byte ratio and whole sequences built, side by side
    assert summary["capacity_100k_int2_over_bf16"] == {"exact": approx(15 / 2), "whole_sequences": approx(40 / 5)}
    assert summary["throughput_at_capacity_100k_int2_over_bf16"] == approx(5.0)

    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert provenance["decode_128k_b1"]["best_bf16"] == "flash2_bf16"
    assert provenance["decode_128k_b8"]["best_bf16"] == "bf16_paged_pallas"
    assert provenance["decode_32k_b8"]["best_bf16"] == "cudnn_bf16_rows_as_queries"
    assert provenance["decode_128k_b1"]["jax"]["variant"] == "oscar_int2_pallas"
    assert provenance["decode_128k_b1"]["jax"]["over_floor"] == approx(read_b1 / (INT2_BYTES / 100e-6))
    for png in ("decode_time_vs_context.png", "decode_bandwidth.png", "e2e_step_vs_floor.png"):
        assert (tmp_path / png).stat().st_size > 0

    text = md.read_text()
    assert "abc123" in text and "NVIDIA H200" in text
    assert "| decode speed-up vs fastest BF16, 128k_b1, jax | 5.00× | ≥ 5× | met |" in text
    assert "| decode speed-up vs fastest BF16, 128k_b1, torch | 4.00× | ≥ 5× | **not met** |" in text
    # the 8K b1 Pallas default (20 µs) is slower than cuDNN (15 µs): the ≥ 1× target says so
    assert "| decode speed-up vs fastest BF16, slowest (context, batch) ≥ 4K, jax | 0.75× | ≥ 1× | **not met** |" in text
    assert "| Pallas time over Triton's, minus one, 128k_b8 | +25.0% | ≤ 10% | **not met** |" in text
    assert "| e2e BF16 step / INT2 step, 100K b1 | 2.50× | ≥ 1.6× | met |" in text
    assert "| tokens/s at capacity, 100K, INT2 / BF16 | 5.00× | ≥ 6× | **not met** |" in text
    assert "| sequences of 100K that fit, INT2 / BF16 (exact) | 7.50× | (reported) | — |" in text
    # write: pallas 2000 GB/s / 4000 copy = 50 %, demote 1000 / 4000 = 25 %: the write path reads and writes
    assert "| write path (worst case) / copy bandwidth (it reads and writes), pallas | 25.0% | ≥ 50% | **not met** |" in text
    # the headline table: 128K b8 — fastest BF16 named, default launches, fractions of read, × floor
    assert ("| 131072 | 8 | `bf16_paged_pallas` | 3000.0 | 1000.0 | 3.00× | 53% | 1.88 | 800.0 | 3.75× | 67% | 1.50 "
            "| 4500 | 4000 |") in text
    # sweeps in their own table, errors listed there
    sweeps = text[text.index("### Tuning sweeps"):]
    assert "oscar_int2_pallas[{'pages_per_split': 16}]" in sweeps and "ValueError: bad tiling" in sweeps
    every = text[text.index("### Every variant"):text.index("### Tuning sweeps")]
    assert "pages_per_split" not in every and "`cudnn_bf16_rows_as_queries`" in every


def test_decode_rows_name_the_sha_of_their_config(tmp_path):
    """`bench_h200 --merge` keeps configs of earlier runs: each decode row names its own code."""
    results = fake_results()
    results["decode"]["configs"][0]["git_sha"] = "1111111aaaa"
    results["decode"]["configs"][1]["git_sha"] = "2222222bbbb"
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(write_files(tmp_path, results), md, plots=False)
    rows = [line for line in md.read_text().splitlines() if "`oscar_int2_pallas` |" in line]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["`1111111`", "`2222222`", "—", "—", "—"]


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


def test_whole_sequences_count_built_batches_not_the_accounting(tmp_path):
    results = fake_results()
    results["e2e"]["capacity"]["int2"]["built_batch"] = 30  # 40 by the byte accounting
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["capacity_100k_int2_over_bf16"] == {"exact": pytest.approx(7.5),
                                                       "whole_sequences": pytest.approx(6.0)}
    results["e2e"]["capacity"]["bf16"].update(built_batch=0, tokens_per_s_at_capacity=None)
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["capacity_100k_int2_over_bf16"] == {"exact": pytest.approx(7.5), "whole_sequences": None}
    assert summary["throughput_at_capacity_100k_int2_over_bf16"] is None
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert any("bf16 0" in w and "byte accounting" in w for w in provenance["warnings"])


def test_a_missing_config_or_read_bandwidth_gives_null_and_a_warning(tmp_path):
    results = fake_results()
    results["decode"]["configs"] = [c for c in results["decode"]["configs"] if c["batch"] != 8]
    for key in ("torch_read_only", "read_gb_per_s"):  # a file from before the read stream was recorded
        results["decode"]["copy_bandwidth"].pop(key)
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_speedup_vs_best_bf16"]["128k_b8"] is None
    assert summary["decode_speedup_vs_best_bf16"]["128k_b1"] == {"jax": pytest.approx(5.0), "torch": pytest.approx(4.0)}
    assert summary["decode_fraction_of_read_bandwidth"]["128k_b1"] == {"jax": None, "torch": None}
    provenance = json.loads((tmp_path / "summary_h200_provenance.json").read_text())
    assert any("batch 8: 128k_b8 is null" in w for w in provenance["warnings"])
    assert any("no read-only bandwidth" in w for w in provenance["warnings"])


def test_a_sweep_never_stands_in_for_a_failed_default(tmp_path):
    results = fake_results()
    results["decode"]["configs"][3]["variants"]["oscar_int2_triton"] = {"error": "RuntimeError: no kernel"}
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_speedup_vs_best_bf16"]["128k_b1"] == {"jax": pytest.approx(5.0), "torch": None}
    assert summary["decode_fraction_of_read_bandwidth"]["128k_b1"]["torch"] is None


def test_with_every_bf16_variant_failed_the_speedups_are_null(tmp_path):
    results = fake_results()
    for name in S.BF16_VARIANTS:
        results["decode"]["configs"][4]["variants"][name]["passed"] = False
    summary = S.summarize(write_files(tmp_path, results), None, plots=False)
    assert summary["decode_speedup_vs_best_bf16"]["128k_b8"] == {"jax": None, "torch": None}
    assert summary["decode_fraction_of_read_bandwidth"]["128k_b8"]["jax"] == pytest.approx(
        8 * INT2_BYTES / 1000e-6 / 4500e9)  # the fraction needs no baseline


@pytest.mark.parametrize("missing", ["decode", "write", "e2e", "copy"])
def test_missing_file_gives_nulls_and_a_warning(tmp_path, capsys, missing):
    results = fake_results()
    del results[missing]
    md = tmp_path / "BENCHMARKS.md"
    summary = S.summarize(write_files(tmp_path, results), md)
    assert tuple(summary) == S.SUMMARY_KEYS
    assert f"{missing}_h200.json is missing" in capsys.readouterr().err
    if missing == "decode":
        assert all(summary[k] is None for k in S.SUMMARY_KEYS[:2])
        assert all(summary[k] is not None for k in S.SUMMARY_KEYS[2:])
    if missing == "e2e":
        assert all(summary[k] is None for k in S.SUMMARY_KEYS[2:])
        assert all(summary[k] is not None for k in S.SUMMARY_KEYS[:2])
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


def test_a_config_takes_the_bandwidths_of_its_own_run(tmp_path):
    """Merged files hold configs of several runs: a config's fractions use the read-only stream its own
    run recorded (else the file's) and its table row shows the copy of its run; non-positive ones are
    refused."""
    results = fake_results()
    results["decode"]["configs"][4]["copy_gb_per_s"] = 2000.0  # 128K b8, read 4500 of its own run
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(write_files(tmp_path, results), md, plots=False)
    assert "| 4500 | 2000 |" in md.read_text()
    for key in ("copy_gb_per_s", "read_gb_per_s"):
        bad = fake_results()
        bad["decode"]["configs"][4][key] = 0
        with pytest.raises(S.ResultsError, match=rf"configs\[4\]: {key} must be > 0"):
            S.summarize(write_files(tmp_path, bad), md)


def _pcts(p50, p99):
    return {"p50": p50, "p99": p99, "mean": p50}


def _serve_run(kind, tokens_per_s, *, prompt_len=32768, rate=float("inf"), prefill=True):
    run = {"kind": kind, "prompt_len": prompt_len, "rate": rate, "requests": 4, "output_tokens": 512,
           "output_tokens_per_s": tokens_per_s, "duration_s": 512 / tokens_per_s, "ttft_s": _pcts(1.5, 3.25),
           "itl_s": _pcts(0.0125, 0.5), "decode_step_s": _pcts(0.01, 0.02), "max_decode_batch": 4,
           "host_share_at_batch_32": None, "steps": 200, "max_num_seqs": 4}
    if prefill:  # older files have no prefill figures, nor decode tokens/s
        run.update(prefill_step_s=_pcts(0.25, 0.5), prefill_step_device_share=_pcts(0.5, 0.9),
                   decode_tokens_per_s=400.0)
    return run


def _serve_file(runs, capacity, targets):
    setup = {"model": {"num_layers": 2}, "prompt_lens": [32768], "output_len": 128, "rates": ["inf"],
             "kv_cache_memory_bytes": 8 * 2**30, "prefill_chunk": 2048, "sink": 64, "recent": 256, "page_size": 64,
             "decode_buckets": "max", "prefill_split": "whole"}
    return {"environment": dict(ENV, gpu="NVIDIA H100 80GB HBM3", git_sha="3a4677ad99afb39b"), "setup": setup,
            "capacity": capacity, "compile_s": {k: 90.25 for k in capacity}, "results": runs, "http": None,
            "targets": targets}


def test_the_serving_section_from_bench_serves_files(tmp_path):
    """Per serve_*.json: conditions, a row per run, INT2 / BF16 tokens/s at the same (prompt, rate), the
    file's targets; an int2-only file says its BF16 run is missing; another shape is skipped, not fatal;
    the summary does not change."""
    write_files(tmp_path, fake_results())
    S.summarize(tmp_path, tmp_path / "before.md", plots=False)
    summary_before = (tmp_path / "summary_h200.json").read_text()
    provenance_before = (tmp_path / "summary_h200_provenance.json").read_text()
    both = _serve_file([dict(_serve_run("int2", 60.0), overlap=True), dict(_serve_run("int2", 50.0), overlap=False),
                        _serve_run("bf16", 20.0, prefill=False), _serve_run("int2", 30.0, rate=2.0)],
                       {"int2": 8, "bf16": 1},
                       {"int2_over_bf16_output_tokens_per_s": {"prompt_len": 32768, "value": 3.0, "target": 3.5,
                                                               "met": False},
                        "itl_p99_over_median_step": {"value": 1.25, "target": 1.5, "met": True}})
    int2_only = _serve_file([dict(_serve_run("int2", 45.0), overlap=True)], {"int2": 16}, {})
    (tmp_path / "serve_a_both.json").write_text(json.dumps(both))  # inf is written as Infinity, as bench_serve does
    (tmp_path / "serve_b_int2_only.json").write_text(json.dumps(int2_only))
    (tmp_path / "serve_c_other.json").write_text(json.dumps({"environment": ENV, "setup": {}, "runs": []}))
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(tmp_path, md, plots=False)
    text = md.read_text()
    assert (tmp_path / "summary_h200.json").read_text() == summary_before
    assert (tmp_path / "summary_h200_provenance.json").read_text() == provenance_before
    section = text[text.index("## Serving (`bench_serve`)"):text.index("## Summary")]
    assert text.replace(section, "") == (tmp_path / "before.md").read_text()  # nothing else changed
    a, b, c = (section.index(f"### `serve_{n}.json`") for n in ("a_both", "b_int2_only", "c_other"))
    assert a < b < c
    first, second, third = section[a:b], section[b:c], section[c:]
    assert ("GPU NVIDIA H100 80GB HBM3, git `3a4677a`" in first and "KV cache 8.00 GiB" in first
            and "decode buckets `max`, prefill split `whole`" in first and "capacity (sequences) int2 8 / bf16 1" in first
            and "compile int2 90.2 / bf16 90.2 s" in first)
    # kind, prompt, rate, overlap, requests, tok/s, TTFT p50/p99 s, ITL p50/p99 ms, decode step ms, prefill ms,
    # device share (files before the overlap field: —)
    assert ("| int2 | 32768 | all at once | on | 4 | 60.00 | 1.50 | 3.25 | 12.50 | 500.00 | 10.00 | 400.0 | 250.0 "
            "| 50.0 % |") in first
    assert "| int2 | 32768 | all at once | off | 4 | 50.00 |" in first
    assert "| bf16 | 32768 | all at once | — | 4 | 20.00 | 1.50 | 3.25 | 12.50 | 500.00 | 10.00 | — | — | — |" in first
    assert "| int2 | 32768 | 2/s | — | 4 | 30.00 |" in first
    # 60 / 20: not the 2/s run's 30, nor the run without overlap's 50
    assert "INT2 / BF16 output tokens/s: 3.00× at prompt 32768, all at once." in first
    assert "2/s" not in first.split("INT2 / BF16 output tokens/s:")[1]
    assert "`int2_over_bf16_output_tokens_per_s` 3.00 (target 3.5, prompt 32768): **not met**" in first
    assert "`itl_p99_over_median_step` 1.25 (target 1.5): met" in first
    assert "run missing" not in first
    assert "| int2 | 32768 | all at once | on | 4 | 45.00 |" in second
    # the file does not say which kinds were asked for
    assert "No BF16 run in this file." in second and "INT2 / BF16 output tokens/s" not in second
    cut = _serve_file([_serve_run("int2", 45.0)], {"int2": 16}, {})
    cut["setup"]["kinds"] = ["int2", "bf16"]
    assert "BF16 run missing: the run was cut off." in S._serve_file("x.json", cut, ["h"] * 14)
    cut["setup"]["kinds"] = ["int2"]
    assert "BF16" not in "".join(S._serve_file("x.json", cut, ["h"] * 14))
    # its runs record overlap: its targets as bench_serve evaluates them now (0.5 s over 10 ms), not the file's (none)
    assert "capacity (sequences) int2 16;" in second
    assert "Targets (`bench_serve.targets`): `itl_p99_over_median_step` 50.00 (target 1.5): **not met**." in second
    assert "Skipped: not bench_serve's shape (serve_c_other.json: missing key 'results')." in third


def test_without_serve_files_there_is_no_serving_section_and_no_plots_keeps_the_pngs(tmp_path):
    write_files(tmp_path, fake_results())
    (tmp_path / "decode_bandwidth.png").write_bytes(b"png")
    (tmp_path / "serve_bad.json").write_text("{not json")
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(tmp_path, md, plots=False)
    text = md.read_text()
    assert "Skipped: not bench_serve's shape (not valid JSON" in text
    assert (tmp_path / "decode_bandwidth.png").read_bytes() == b"png"  # not redrawn, still shown
    assert "![decode_bandwidth](decode_bandwidth.png)" in text and "decode_time_vs_context.png" not in text
    (tmp_path / "serve_bad.json").unlink()
    S.summarize(tmp_path, md, plots=False)
    assert "## Serving" not in md.read_text()


def test_the_serving_plot_draws_ratios_and_latencies_and_the_section_shows_it(tmp_path):
    """INT2 / BF16 per file (the overlap run where a file ran both; the ceiling where the file has
    the INT2 run's prefill time) and one latency bar pair per run; drawn with plots, shown when there."""
    pytest.importorskip("matplotlib")
    int2 = dict(_serve_run("int2", 60.0), overlap=True, prefill_steps_total_s=10.0)
    bf16 = dict(_serve_run("bf16", 20.0), overlap=True, duration_s=30.0)
    slow = dict(_serve_run("int2", 5.0), overlap=False)
    (tmp_path / "serve_a.json").write_text(json.dumps(_serve_file([int2, slow, bf16], {"int2": 8, "bf16": 1}, {})))
    ratios, latencies = S._serve_points(S.load_serve(tmp_path))
    assert ratios == [{"label": "a\n32K", "output": 3.0, "decode": 1.0, "ceiling": 3.0}]  # 60/20, 400/400, 30/10
    assert [r["label"] for r in latencies] == ["a\nint2, overlap", "a\nint2, no overlap", "a\nbf16, overlap"]
    assert latencies[0] == {"label": "a\nint2, overlap", "itl_p50": 0.0125, "itl_p99": 0.5, "step": 0.01}
    write_files(tmp_path, fake_results())
    md = tmp_path / "BENCHMARKS.md"
    S.summarize(tmp_path, md, plots=False)
    assert S.SERVE_PLOT not in md.read_text()  # not drawn, not shown
    S.summarize(tmp_path, md, plots=True)
    assert (tmp_path / S.SERVE_PLOT).stat().st_size > 10_000
    section = md.read_text().split("## Serving (`bench_serve`)")[1]
    assert f"![serve_ratios_and_latency]({S.SERVE_PLOT})" in section
