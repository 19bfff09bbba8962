"""probe_pallas_registers on the CPU (interpret mode, where a cap has no effect): its plumbing —
each cap's output compared bit for bit with the first, one config per (context, batch) written."""

import json

from benchmarks import probe_pallas_registers


def test_calls_only_writes_each_cap_with_its_bit_identity(tmp_path):
    out = tmp_path / "probe.json"
    probe_pallas_registers.main(["--contexts", "1024", "--batches", "1,2", "--caps", "0,160,none", "--calls-only",
                                 "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["caps"] == [0, 160, None]
    assert [(c["context"], c["batch"]) for c in result["configs"]] == [(1024, 1), (1024, 2)]
    for config in result["configs"]:
        assert list(config["variants"]) == ["0", "160", "None"]
        assert all(v == {"bit_identical_to_first": True} for v in config["variants"].values())
