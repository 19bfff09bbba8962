"""calibration.quality_report: REPORT.md from result files, and clear errors for bad files."""

import json
import math

import pytest

from calibration import quality_report as qr


def _result(ppl_oscar=14.0, windows=((10.0, 11.0), (10.0, 12.1))):
    methods = {}
    for name, (w1, w2), ppl in (("bf16", windows[0], 10.488), ("oscar", windows[1], ppl_oscar)):
        methods[name] = {"perplexity": ppl, "kl_vs_bf16": 0.0 if name == "bf16" else 0.02,
                         "top1_agreement": 1.0 if name == "bf16" else 0.94, "bits_per_element": 16.0,
                         "bits_per_element_128k": 2.533, "per_window": [{"perplexity": w1}, {"perplexity": w2}]}
    return {"methods": methods, "config": {"command": "python -m calibration.evaluate --x", "num_windows": 2,
                                           "context": 2048, "tokens_evaluated": 4094, "seconds": 12.5,
                                           "artifact": {"path": "/abs/oscar_jax/artifacts/m", "codec": {"levels": "x"}}},
            "environment": {"git_sha": "0123456789abcdef", "date_utc": "2026-12-01T00:00:00Z"}}


def test_report_tables_come_from_the_files(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "eval_b.json").write_text(json.dumps(_result()))
    (results / "eval_a.json").write_text(json.dumps(_result(ppl_oscar=11.0)))
    (results / "eval_a.png").write_bytes(b"png")
    out = qr.write_report(results)
    text = out.read_text()
    assert out == tmp_path / "REPORT.md"
    assert text.index("## eval_a") < text.index("## eval_b")  # sorted by name
    assert "| oscar | 14.000 | 1.3349 | 0.0200 | 0.9400 | 16.000 | 2.533 |" in text  # 14 / 10.488
    assert "| oscar | 1.0000 | 1.1000 |" in text  # per window: 10/10, 12.1/11
    assert "python -m calibration.evaluate --x" in text and "`0123456789ab`" in text
    assert "`oscar_jax/artifacts/m`" in text and "![eval_a](results/eval_a.png)" in text


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("methods"), "'methods' must be a non-empty object"),
    (lambda d: d["methods"].pop("bf16"), "no 'bf16' reference"),
    (lambda d: d["methods"]["oscar"].update(perplexity=float("nan")), r"methods\['oscar'\].perplexity must be a finite"),
    (lambda d: d["methods"]["oscar"].update(kl_vs_bf16="0.1"), r"kl_vs_bf16 must be a finite number, got '0.1'"),
    (lambda d: d["methods"]["oscar"]["per_window"][1].update(perplexity=None), r"per_window\[1\].perplexity"),
])
def test_bad_result_files_are_named(tmp_path, mutate, message):
    data = _result()
    mutate(data)
    path = tmp_path / "eval_bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(qr.ResultFileError, match=message):
        qr.load_result(path)


def test_unreadable_and_missing_results(tmp_path):
    (tmp_path / "eval_x.json").write_text("{not json")
    with pytest.raises(qr.ResultFileError, match="not a readable JSON file"):
        qr.load_result(tmp_path / "eval_x.json")
    with pytest.raises(FileNotFoundError, match="no eval_"):
        qr.write_report(tmp_path / "empty")


def test_committed_report_is_up_to_date():
    """calibration/REPORT.md is what the command writes from the committed results."""
    committed = (qr.RESULTS.parent / "REPORT.md").read_text(encoding="utf-8")
    assert committed == qr.render(qr.RESULTS, qr.RESULTS.parent), \
        "calibration/REPORT.md is stale: run python -m calibration.quality_report"


def _ablations():
    row = {"perplexity": 10.5, "perplexity_vs_bf16": 1.05, "kl_vs_bf16": 0.06, "top1_agreement": 0.89,
           "bits_per_element": 4.609}
    return {"ablations": {"rotation": {"hadamard": row, "oscar": dict(row, perplexity=10.4, perplexity_vs_bf16=1.04)}},
            "config": {"command": "python -m calibration.ablations --y", "num_windows": 4, "context": 2048},
            "environment": {"git_sha": "fedcba9876543210"}}


def _passkey():
    return {"methods": {"bf16": {"accuracy": 0.9, "by_length": {"1024": 1.0, "2048": 0.8},
                                 "by_depth": {"0.1": 0.8, "0.9": 1.0}}},
            "config": {"command": "python -m calibration.passkey --z", "mode": "prefill", "samples": 2}}


def test_ablation_and_passkey_sections_come_from_the_files(tmp_path):
    (tmp_path / "eval_a.json").write_text(json.dumps(_result()))
    (tmp_path / "ablations_x.json").write_text(json.dumps(_ablations()))
    (tmp_path / "passkey_x.json").write_text(json.dumps(_passkey()))
    text = qr.render(tmp_path, tmp_path)
    assert text.index("## eval_a") < text.index("## ablations_x") < text.index("## passkey_x")
    assert "**rotation**" in text and "| oscar | 10.400 | 1.0400 | 0.0600 | 0.8900 | 4.609 |" in text
    assert "python -m calibration.ablations --y" in text and "`fedcba987654`" in text
    assert "| method | accuracy | 1024 tok | 2048 tok | depth 0.1 | depth 0.9 |" in text
    assert "| bf16 | 0.900 | 1.000 | 0.800 | 0.800 | 1.000 |" in text


@pytest.mark.parametrize("kind,mutate,message", [
    ("ablations", lambda d: d.pop("ablations"), "'ablations' must be a non-empty object"),
    ("ablations", lambda d: d["ablations"]["rotation"]["oscar"].update(kl_vs_bf16=None),
     r"ablations\['rotation'\]\['oscar'\].kl_vs_bf16 must be a finite number"),
    ("passkey", lambda d: d["methods"]["bf16"].update(accuracy="high"), r"methods\['bf16'\].accuracy"),
    ("passkey", lambda d: d["methods"]["bf16"]["by_depth"].update({"0.5": float("inf")}), r"by_depth\['0.5'\]"),
])
def test_bad_ablation_and_passkey_files_are_named(tmp_path, kind, mutate, message):
    data = _ablations() if kind == "ablations" else _passkey()
    mutate(data)
    path = tmp_path / f"{kind}_bad.json"
    path.write_text(json.dumps(data))
    load = qr.load_ablations if kind == "ablations" else qr.load_passkey
    with pytest.raises(qr.ResultFileError, match=message):
        load(path)


def test_paired_comparison_counts_windows_and_gives_the_log_ratio_spread():
    ours = [{"perplexity": 10.0, "kl_vs_bf16": 0.01}, {"perplexity": 12.0, "kl_vs_bf16": 0.03},
            {"perplexity": 11.0, "kl_vs_bf16": 0.02}]
    theirs = [{"perplexity": 11.0, "kl_vs_bf16": 0.02}, {"perplexity": 11.0, "kl_vs_bf16": 0.04},
              {"perplexity": 11.0, "kl_vs_bf16": 0.01}]
    p = qr.paired(ours, theirs)
    logs = [math.log(10 / 11), math.log(12 / 11), 0.0]
    mean = sum(logs) / 3
    assert p["windows"] == 3 and p["ppl_lower"] == 1 and p["kl_lower"] == 2
    assert p["mean_log_ratio"] == pytest.approx(mean)
    assert p["standard_error"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in logs) / 2 / 3))
    assert qr.paired(ours[:2], [{"perplexity": 1.0}] * 2)["kl_lower"] is None
    with pytest.raises(ValueError, match="same ≥ 2 windows, got 3 and 2"):
        qr.paired(ours, theirs[:2])


def test_mcnemar_counts_discordant_samples_and_gives_the_exact_p():
    ours = [True, True, False, True, False, True]
    theirs = [True, False, True, False, False, False]
    t = qr.mcnemar(ours, theirs)
    assert (t["only_ours"], t["only_theirs"]) == (3, 1)
    assert t["p_value"] == pytest.approx(2 * (1 + 4) / 16)  # n = 4, k = 1: 2·P(X ≤ 1)
    assert qr.mcnemar([True], [True])["p_value"] == 1.0
    assert qr.mcnemar([True] * 7, [False] * 7)["p_value"] == pytest.approx(2 / 128)
    with pytest.raises(ValueError, match="same samples, got 2 and 1"):
        qr.mcnemar([True, False], [True])


def test_passkey_samples_are_validated(tmp_path):
    good = {"methods": {m: {"accuracy": 0.5, "by_length": {"1024": 0.5}, "by_depth": {"0.5": 0.5}}
                        for m in ("oscar", "quarot-int2")},
            "samples": [{"methods": {"oscar": {"correct": True}, "quarot-int2": {"correct": False}}}]}
    path = tmp_path / "passkey_x.json"
    path.write_text(json.dumps(good))
    assert qr.load_passkey(path)["samples"][0]["methods"]["oscar"]["correct"] is True
    good["samples"][0]["methods"].pop("quarot-int2")
    path.write_text(json.dumps(good))
    with pytest.raises(qr.ResultFileError, match=r"samples\[0\].methods must hold exactly"):
        qr.load_passkey(path)
