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
                                                            "gb_per_s": 2.0, "read_gb_per_s": 3.0})


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


def test_time_jax_loop_passes_operands_as_arguments_not_constants():
    """A closed-over array is embedded in the program as a constant (128K × b8: minutes of compile);
    operands must reach the step traced, and the loop must compute with them."""
    import jax
    import jax.numpy as jnp

    from benchmarks import harness

    seen = []

    def step(i, carry, table, scale):
        seen.append(isinstance(table, jax.core.Tracer) and isinstance(scale, jax.core.Tracer))
        return carry + table[i % 4] * scale

    for mode in harness.JAX_TIMING_MODES:
        seen.clear()
        timing = harness.time_jax_loop(step, jnp.zeros(()), reps=8, trials=2,
                                       operands=(jnp.arange(4.0), jnp.float32(2)), mode=mode)
        assert seen and all(seen)
        assert timing["reps"] == 8 and timing["trials"] == 2 and timing["min_s"] <= timing["median_s"]
        assert timing["mode"] == mode and timing["wall_median_s"] > 0
        assert len(seen) == (8 if mode == "unrolled" else 1)  # unrolled: traced once per call


def test_time_jax_loop_takes_the_time_a_queued_program_adds():
    """The per-call time is (two chained programs − one) / reps: the program's fixed cost (dispatch,
    sync) cancels, the work does not. A step of real work: the steady time is positive and close to
    the wall time per call, which also holds the fixed cost."""
    import jax.numpy as jnp

    from benchmarks import harness

    def step(i, carry, m):
        return jnp.tanh(carry @ m)

    # ~1 ms of work a call and five trials: another process on the 2 cores moves a median less
    x = jnp.ones((512, 512), jnp.float32) / 512
    timing = harness.time_jax_loop(step, x, reps=8, trials=5, operands=(x,))
    assert timing["method"] == harness.JAX_TIMING_METHOD
    assert 0 < timing["median_s"] < 2 * timing["wall_median_s"], timing


def test_program_times_cut_a_trace_into_programs():
    """Two programs of three kernels each (out of start order, one overlap, one idle gap)."""
    from benchmarks import harness

    events = [("a", 0, 10), ("b", 15, 5), ("c", 18, 10),  # program 1: span 28, busy 10 + 13 = 23
              ("c", 130, 10), ("a", 100, 10), ("b", 110, 20)]  # program 2: span 40, busy 40
    assert harness.busy_ns(events[:3]) == 23
    assert harness.program_times(events, 2) == [(28, 23), (40, 40)]
    with pytest.raises(ValueError, match="5 kernel events do not split into 2 programs"):
        harness.program_times(events[:5], 2)


def test_time_jax_loop_reports_the_device_span_of_short_calls(monkeypatch):
    """On a GPU, calls under DEVICE_TIMING_BELOW_S take the device span per call of the traced
    programs as median_s (the host-timed one kept as queued_median_s); longer calls, and any call
    on another backend, keep the host-timed median."""
    import jax
    import jax.numpy as jnp

    from benchmarks import harness

    traced = []

    def fake_trace(run, programs):
        traced.append(programs)
        return [(8e-6 * (i + 1), 4e-6) for i in range(programs)]  # spans 8, 16, 24 µs a program

    monkeypatch.setattr(harness, "trace_program_seconds", fake_trace)
    step = lambda i, c: c + 1.0  # noqa: E731
    timing = harness.time_jax_loop(step, jnp.zeros(()), reps=4, trials=3, mode="loop")
    assert traced == [] and timing["method"] == harness.JAX_TIMING_METHOD  # CPU: host-timed
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    timing = harness.time_jax_loop(step, jnp.zeros(()), reps=4, trials=3, mode="loop")
    assert traced == [3]
    assert timing["method"] == harness.DEVICE_TIMING_METHOD
    assert (timing["median_s"], timing["min_s"], timing["max_s"], timing["busy_median_s"]) == (4e-6, 2e-6, 6e-6, 1e-6)
    assert timing["queued_method"] == harness.JAX_TIMING_METHOD and timing["queued_median_s"] > 0
    # a "long" call: below -inf never holds (0.0 would not do: on a loaded CPU the steady time of
    # this trivial loop, a difference of two wall times, can come out negative)
    monkeypatch.setattr(harness, "DEVICE_TIMING_BELOW_S", float("-inf"))
    timing = harness.time_jax_loop(step, jnp.zeros(()), reps=4, trials=3, mode="loop")
    assert traced == [3] and "queued_median_s" not in timing


def test_time_jax_loop_names_a_bad_mode():
    import jax.numpy as jnp

    from benchmarks import harness

    with pytest.raises(ValueError, match="mode='graph'"):
        harness.time_jax_loop(lambda i, c: c, jnp.zeros(()), reps=2, mode="graph")


def test_capacity_only_merges_into_the_existing_e2e_file(fake_gpu, monkeypatch, tmp_path):
    """--capacity-only keeps the steps (and their environment) and replaces the capacity block, stamped
    with this run's git sha; each partial capacity result is saved as it comes."""
    from benchmarks import bench_e2e

    steps = {"section": "e2e", "environment": {"git_sha": "0000000"}, "copy_bandwidth": {"gb_per_s": 9.0},
             "runs": [{"cache": "int2", "context": 30000}], "capacity": {"int2": {"old": True}}}
    (tmp_path / "e2e_h200.json").write_text(json.dumps(steps))
    calls = []

    def fake_run(contexts=None, floor_gb_per_s=None, on_progress=None, **kw):
        calls.append(contexts)
        partial = {"runs": [], "capacity": {"int2": {"max_concurrent_100k": 55, "built_batch": 55}}}
        on_progress(partial)
        assert json.loads((tmp_path / "e2e_h200.json").read_text())["capacity"]["int2"]["built_batch"] == 55
        partial["capacity"]["bf16"] = {"max_concurrent_100k": 7, "built_batch": 7}
        return partial

    monkeypatch.setattr(bench_e2e, "run", fake_run)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    bench_h200.main(["--sections", "e2e", "--capacity-only", "--out", str(tmp_path)])
    assert calls == [()]  # no steps measured
    out = json.loads((tmp_path / "e2e_h200.json").read_text())
    assert out["runs"] == steps["runs"] and out["environment"] == {"git_sha": "0000000"}
    assert out["capacity"]["git_sha"] == "abc1234" and out["capacity"]["environment"]["git_sha"] == "abc1234"
    assert out["capacity"]["bf16"]["built_batch"] == 7 and "old" not in out["capacity"]["int2"]


def test_capacity_only_needs_the_file_it_merges_into(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    with pytest.raises(SystemExit):
        bench_h200.main(["--sections", "e2e", "--capacity-only", "--out", str(tmp_path)])


def test_capacity_needs_a_preallocated_allocator(fake_gpu, monkeypatch, tmp_path, capsys):
    """A growing allocator fragments (NOTES v5): --capacity-only refuses it, and the e2e section
    measures its steps but skips the capacity search, printing the command that runs it."""
    from benchmarks import bench_e2e

    (tmp_path / "e2e_h200.json").write_text(json.dumps({"runs": []}))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with pytest.raises(SystemExit):
        bench_h200.main(["--sections", "e2e", "--capacity-only", "--out", str(tmp_path)])
    assert "--capacity-only needs the memory preallocated" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(bench_e2e, "run", lambda **kw: calls.append(kw) or {"runs": []})
    bench_h200.main(["--sections", "e2e", "--out", str(tmp_path)])
    assert calls[0]["capacity_context"] is None
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.bench_h200" in capsys.readouterr().out


def test_git_state_flags_a_tree_that_differs_from_head(tmp_path):
    """environment() records whether the tracked files are HEAD's: a stale .git beside a newer tree
    (the device copy of v16) must not pass for the recorded sha."""
    import subprocess

    from benchmarks import harness

    assert harness.git_head(tmp_path) is None and harness.git_tree_matches_head(tmp_path) is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "kernel.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "kernel.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    head = harness.git_head(tmp_path)
    assert len(head) == 40 and harness.git_tree_matches_head(tmp_path) is True
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert harness.git_head(tmp_path) == head and harness.git_tree_matches_head(tmp_path) is False


def test_worktree_tree_names_the_code_that_ran_even_with_a_stale_git(tmp_path):
    """The device receives the working tree beside an old .git: the tree hash of what is on disk must
    equal the tree of the commit the tree came from, whatever HEAD the stale .git holds."""
    import subprocess

    from benchmarks import harness

    assert harness.git_worktree_tree(tmp_path) is None and harness.git_commit_tree("HEAD", tmp_path) is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text(".venv/\n")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    first = harness.git_head(tmp_path)
    (tmp_path / "kernel.py").write_text("a = 2\n")
    subprocess.run(git + ["commit", "-qam", "two"], check=True)
    second = harness.git_head(tmp_path)
    assert harness.git_worktree_tree(tmp_path) == harness.git_commit_tree(second, tmp_path)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text("ignored\n")  # ignored files do not count
    assert harness.git_worktree_tree(tmp_path) == harness.git_commit_tree(second, tmp_path)
    subprocess.run(git + ["reset", "-q", "--soft", first], check=True)  # .git stale: HEAD one, files two
    assert harness.git_head(tmp_path) == first and harness.git_tree_matches_head(tmp_path) is False
    assert harness.git_worktree_tree(tmp_path) == harness.git_commit_tree(second, tmp_path)
    # A sha taken from the stale .git (v19: 5a1626b for a tree of b61ad50) is named a mismatch at
    # the start of a run; the commit the tree came from passes.
    tree = harness.git_worktree_tree(tmp_path)
    assert harness.tree_mismatch(second, tree, cwd=tmp_path) is None
    stale = harness.tree_mismatch(first, tree, cwd=tmp_path)
    assert stale is not None and stale.startswith(f"the tree that ran ({tree[:12]}) differed") and first in stale
    assert "is not a commit of this checkout" in harness.tree_mismatch("0" * 40, tree, cwd=tmp_path)
    (tmp_path / "new.py").write_text("b = 1\n")  # an untracked, unignored file is part of what ran
    assert harness.git_worktree_tree(tmp_path) != harness.git_commit_tree(second, tmp_path)


def test_variants_are_timed_in_both_backends_at_every_config(fake_gpu, monkeypatch, tmp_path):
    seen = []

    def run_config(context, batch, group_size, tuning=None, triton_tuning=None, on_variant=None):
        seen.append((context, batch, tuning, triton_tuning))
        return {"context": context, "batch": batch, "variants": {}}

    monkeypatch.setattr(bench_decode, "run_config", run_config)
    bench_h200.main(["--sections", "decode", "--contexts", "8192", "--batches", "1,32", "--no-tuning", "--splits", "8",
                     "--variants", '[{"pages_per_block": 2}]', "--out", str(tmp_path)])
    expected = [{"pages_per_split": 8}, {"pages_per_block": 2}]
    assert seen == [(8192, 1, expected, expected), (8192, 32, expected, expected)]


@pytest.mark.parametrize("text", ['{"pages_per_block": 2}', "[{}]", "[2]", "not json"])
def test_variants_that_are_not_a_list_of_launch_keywords_are_refused(fake_gpu, tmp_path, text, capsys):
    with pytest.raises(SystemExit):
        bench_h200.main(["--sections", "decode", "--variants", text, "--out", str(tmp_path)])
    assert "--variants" in capsys.readouterr().err
