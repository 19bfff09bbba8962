"""benchmarks.probe_int2_layout --smoke: every layout variant's merged output equals the shipped
launch's (interpret mode, 2K context) and is timed; K and V read their own metadata buffers."""

import json

import pytest


@pytest.mark.slow
def test_probe_smoke_checks_and_times_every_variant(tmp_path):
    from benchmarks import probe_int2_layout as probe

    out = tmp_path / "probe.json"
    probe.main(["--smoke", "--out", str(out)])
    (config,) = json.loads(out.read_text())["configs"]
    names = [v["name"] for v in config["variants"]]
    assert len(names) == len(probe.VARIANTS) == len(set(names))
    for variant in config["variants"]:
        assert "error" not in variant, variant
        assert variant["passed"] and variant["rel_error_vs_shipped"] <= probe.REL_TOL, variant
        assert variant["median_s"] == variant["median_s"] and variant["wall_median_s"] > 0  # timed, not NaN
