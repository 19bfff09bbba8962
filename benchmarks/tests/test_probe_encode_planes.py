"""probe_encode_planes: the variants it times and the rows it feeds them (its timing needs a GPU)."""

import numpy as np
import pytest

from benchmarks import probe_encode_planes as probe


def test_variants_start_from_the_shipped_encode_and_end_with_every_block_falling_back():
    variants = probe.variants([16, 32, 64])
    assert variants[0] == {"planes": False, "block_rows": 16, "rows": "normal"}
    assert [v["block_rows"] for v in variants if v["planes"] and v["rows"] == "normal"] == [16, 32, 64]
    assert variants[-1] == {"planes": True, "block_rows": 64, "rows": "nan_every_64"}


def test_nan_rows_put_one_declined_row_in_every_block():
    x = probe.make_rows(256, "nan_every_64")  # 2,048 rows
    bad = np.flatnonzero(np.isnan(x).any(axis=1))
    assert np.array_equal(bad, np.arange(0, 2048, 64))
    assert not np.isnan(probe.make_rows(256, "normal")).any()
    with pytest.raises(ValueError, match="rows='ties'"):
        probe.make_rows(4, "ties")


@pytest.mark.parametrize("planes", [False, True])
def test_pallas_variant_checks_the_bytes_it_times(planes):
    """The probe's Pallas check path (interpreted here): the outputs it compares with shared_math."""
    from shared_math import codec

    rows = probe.make_rows(8, "nan_every_64")  # 64 rows: one falls back
    kw = dict(group_size=128, clip_index=122, levels="minmax", block_rows=32, planes=planes)
    encode, values = probe._pallas(rows, "bfloat16", kw)
    for got, want in zip(encode(check=True), codec.encode(values, group_size=128, clip_ratio=0.96)):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_write_section_checks_every_variant_it_would_time(monkeypatch):
    """The write section on a small case, Pallas interpreted: every variant (planes off / on,
    write_pages_rows and demote_pages_rows) writes shared_math's bytes; the timer is stubbed."""
    from benchmarks import harness

    monkeypatch.setattr(harness, "time_jax_loop", lambda *a, **k: {"median_s": 1.0})
    out = probe.write_kernel_variants(128, [32], ["pallas"], copy_gb_per_s=1.0, demote_pages=2, layers=1)
    assert [(e["kernel"], e["planes"]) for e in out] == [
        ("write_pages_rows", False), ("write_pages_rows", True), ("demote_pages_rows", False),
        ("demote_pages_rows", True)]
    assert all(e["bytes_equal_shared_math"] and e["timing"] == {"median_s": 1.0} for e in out), out


def test_rotated_section_checks_every_variant_it_would_time(monkeypatch):
    """The rotated section on a small case, Pallas interpreted: planes on writes planes off's pools
    before either is timed; the timer is stubbed."""
    from benchmarks import harness

    monkeypatch.setattr(harness, "time_jax_loop", lambda *a, **k: {"median_s": 1.0})
    out = probe.rotated_write_variants(128, ["pallas"], copy_gb_per_s=1.0)
    assert [e["planes"] for e in out] == [False, True]
    assert all(e["bytes_equal_pallas_planes_off"] and e["timing"] == {"median_s": 1.0} for e in out), out


def test_xla_section_reports_rows_against_shared_math():
    """The xla section's record on this machine (XLA:CPU): every row encode_planes calls exact has
    shared_math's bytes (on the H200, XLA:GPU's did not: NOTES v24)."""
    records = probe.xla_jit_rows()
    assert len(records) == 6 and all(r["rows_called_exact"] >= 35 for r in records)
    assert all(not any(r["differ"].values()) and r["kinds_of_differing_rows"] == [] for r in records)
