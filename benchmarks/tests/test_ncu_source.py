"""benchmarks.ncu_source on a small page laid out as ncu prints it (fixed-width columns, header
words wrapped over several lines, long kernel names wrapped)."""

import json

import pytest

from benchmarks import ncu_source

WIDTHS = (18, 40, 8, 8, 8, 8, 8)
HEADER = [("Address", "Source", "Warp S", "# Samp", "Instru", "stall_", "stall_"),
          ("", "", "tall S", "les", "ctions", "wait", "math"),
          ("", "", "amplin", "", "Execu", "", ""),
          ("", "", "g (All", "", "ted", "", ""),
          ("", "", "Sampl", "", "", "", ""),
          ("", "", "es)", "", "", "", "")]


def _line(cells):
    return " ".join(str(c).ljust(w) for c, w in zip(cells, WIDTHS)).rstrip()


def _page(name_lines, rows):
    separator = " ".join("-" * w for w in WIDTHS)
    out = [separator, f"Kernel Name        {name_lines[0]}", *[" " * 19 + n for n in name_lines[1:]], separator]
    out += [_line(h) for h in HEADER]
    out += [_line(r) for r in rows]
    return out


def test_loop_mix_takes_the_most_executed_instructions():
    rows = [("0x10", "LDC R1, c[0x0][0x28]", 3, 3, 64, 2, 0),  # once per program
            ("0x20", "@!P0 LOP3.LUT R2, R3, 0x3, RZ, 0xc0, !PT", 40, 40, 4096, 30, 1),
            ("0x30", "FFMA R4, R5, R6, R4", 7, 7, 4096, 0, 7),
            ("0x40", "LOP3.LUT R7, R2, 0x30, RZ, 0xc0, !PT", 9, 9, 4096, 5, 4),
            ("0x50", "BRA 0x20", 1, 1, 4096, 0, 0),
            ("0x60", "EXIT", 0, 0, 0, 0, 0)]
    text = "\n".join(["==PROF== Disconnected"] + _page(["oscar_int2_tier_attention_gro", "up_size_128"], rows)
                     + _page(["_int2_tier_kernel"], rows[:1] + rows[2:3]))
    kernels = ncu_source.parse(text)
    assert [k["kernel"] for k in kernels] == ["oscar_int2_tier_attention_group_size_128", "_int2_tier_kernel"]
    mix = ncu_source.loop_mix(kernels[0])
    assert mix["sass_instructions"] == 6 and mix["executed_warp_instructions"] == 64 + 4 * 4096
    assert (mix["loop_executions"], mix["loop_instructions"]) == (4096, 4)
    assert mix["loop_opcodes"] == {"LOP3": 2, "FFMA": 1, "BRA": 1}  # predicate and modifiers dropped
    assert mix["loop_share_of_executed"] == pytest.approx(4 * 4096 / (64 + 4 * 4096))
    assert mix["stall_samples"] == 60 and mix["stall_samples_by_reason"] == {"wait": 37, "math": 12}
    json.dumps(mix)  # what --out writes


def test_a_page_without_source_counters_is_refused():
    with pytest.raises(ncu_source.NcuSourceError, match="not the output of ncu"):
        ncu_source.parse("==PROF== nothing profiled\n")
    kernel = {"kernel": "k", "columns": ["Address", "Source"], "rows": [["0x10", "EXIT"]]}
    with pytest.raises(ncu_source.NcuSourceError, match="--section SourceCounters"):
        ncu_source.loop_mix(kernel)
