"""Condense Nsight Compute's SASS source page into the numbers NOTES.md compares: per kernel, the
hot loop's instruction mix as the GPU executed it, and where the warps stalled.

    ncu --clock-control none --kernel-name regex:int2_tier --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass \\
        python3 -m benchmarks.profile_decode --batch 8 > ncu_sass.txt
    python3 -m benchmarks.ncu_source ncu_sass.txt --out results/ncu_loop_mix.json

The raw page is megabytes (one row per SASS instruction, ~70 columns); this keeps what answers
"which instructions does the loop run, and how many": XLA's compile of a Pallas kernel and our
own compile of the same Triton IR differ (benchmarks/NOTES.md v16, v19, v20), so the static count
(`benchmarks.static_analysis`) is checked against the executed one.

The loop is the set of instructions executed the most often (weighted by count: the executed-count
class holding the largest share of the kernel's executed instructions), e.g. 130,752 times each at
128K b8: one per page a program reads.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
STALL_PREFIX = "stall_"


class NcuSourceError(ValueError):
    """The text is not an ncu source page with the columns this module reads."""


def _column_spans(separator: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"-+", separator)]


def _cells(line: str, spans) -> list[str]:
    return [line[a:b].strip() for a, b in spans]


def _opcode(source: str) -> str:
    """'@!P0 LOP3.LUT R1, …' → 'LOP3' (the predicate and the modifiers dropped)."""
    words = source.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def parse(text: str) -> list[dict]:
    """Every kernel of the page: {"kernel", "columns", "rows"}, rows as lists of cell strings."""
    lines = text.splitlines()
    kernels, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("Kernel Name"):
            i += 1
            continue
        name_parts = [lines[i][len("Kernel Name"):].strip()]
        j = i + 1
        while j < len(lines) and not lines[j].startswith("-"):
            name_parts.append(lines[j].strip())  # long names wrap onto the next lines
            j += 1
        if j + 1 >= len(lines):
            raise NcuSourceError(f"kernel at line {i + 1}: no column header after its name")
        k = j + 1  # the header between the separator and the first instruction row
        while k < len(lines) and not lines[k].startswith("-") and not lines[k].startswith("0x"):
            k += 1
        separator_line = k if lines[k].startswith("-") else j
        spans = _column_spans(lines[separator_line])
        header_start = separator_line + 1
        k = header_start
        while k < len(lines) and not lines[k].startswith("0x"):
            k += 1
        header = lines[header_start:k]
        columns = [" ".join(" ".join(h[a:b].strip() for h in header).split()) for a, b in spans]
        rows = []
        while k < len(lines) and lines[k].startswith("0x"):
            rows.append(_cells(lines[k], spans))
            k += 1
        kernels.append({"kernel": "".join(name_parts), "columns": columns, "rows": rows})
        i = k
    if not kernels:
        raise NcuSourceError("no 'Kernel Name' block: not the output of ncu --page source --print-source sass")
    return kernels


def _find(columns: list[str], wanted: str) -> int:
    squeezed = [c.replace(" ", "") for c in columns]
    key = wanted.replace(" ", "")
    if key not in squeezed:
        raise NcuSourceError(f"no column {wanted!r} (have {columns[:8]} …): run ncu with --section SourceCounters")
    return squeezed.index(key)


def _number(cell: str) -> float:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return 0.0


def loop_mix(kernel: dict) -> dict:
    """The kernel's executed instructions, its loop (module docstring) and the loop's opcode mix,
    and the stall samples of the whole kernel by reason."""
    columns, rows = kernel["columns"], kernel["rows"]
    executed_at, samples_at = _find(columns, EXECUTED), _find(columns, SAMPLES)
    executed = [_number(r[executed_at]) for r in rows]
    classes = collections.Counter(executed)
    classes.pop(0.0, None)
    if not classes:
        raise NcuSourceError(f"{kernel['kernel']}: no instruction was executed")
    loop_count = max(classes, key=lambda count: count * classes[count])
    loop = [r for r, e in zip(rows, executed) if e == loop_count]
    source_at = _find(columns, "Source")
    stalls = {}
    for c, name in enumerate(columns):
        squeezed = name.replace(" ", "")
        if squeezed.startswith(STALL_PREFIX) and "NotIssued" not in squeezed:
            total = sum(_number(r[c]) for r in rows)
            if total:
                stalls[squeezed[len(STALL_PREFIX):]] = int(total)
    return {
        "kernel": kernel["kernel"],
        "sass_instructions": len(rows),
        "executed_warp_instructions": int(sum(executed)),
        "loop_executions": int(loop_count),
        "loop_instructions": len(loop),
        "loop_share_of_executed": loop_count * len(loop) / sum(executed),
        "loop_opcodes": dict(collections.Counter(_opcode(r[source_at]) for r in loop).most_common()),
        "stall_samples": int(sum(_number(r[samples_at]) for r in rows)),
        "stall_samples_by_reason": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", type=Path, help="ncu --page source --print-source sass output")
    parser.add_argument("--out", type=Path, default=None, help="write the condensed JSON here")
    args = parser.parse_args(argv)
    mixes = [loop_mix(k) for k in parse(args.page.read_text(errors="replace"))]
    for mix in mixes:
        top = ", ".join(f"{op} {n}" for op, n in list(mix["loop_opcodes"].items())[:12])
        print(f"{mix['kernel'][:60]}: loop {mix['loop_instructions']} SASS × {mix['loop_executions']} "
              f"({mix['loop_share_of_executed']:.1%} of executed): {top}")
    if args.out:
        args.out.write_text(json.dumps({"source": args.page.name, "kernels": mixes}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
