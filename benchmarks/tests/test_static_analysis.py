"""The SASS loop profiler on a known snippet, and the production kernel's instruction budget."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import static_analysis as sa

REPO_ROOT = Path(__file__).resolve().parents[2]

SNIPPET = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LOP3.LUT R2, R0, 0x3, RZ, 0xc0, !PT ;
        /*0030*/               @P0 SHF.R.U32.HI R3, RZ, 0x2, R2 ;
        /*0040*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0050*/                   LOP3.LUT R2, R2, 0x4300, RZ, 0xfc, !PT ;
        /*0060*/              @!P1 BRA 0x20 ;
        /*0070*/                   EXIT ;
"""


def test_loop_profile_counts_the_loop_body_only():
    profile = sa.loop_profile(SNIPPET)
    assert profile["instructions"] == 5  # 0x20 … 0x60
    assert profile["opcodes"] == {"LOP3": 2, "SHF": 1, "HMMA": 1, "BRA": 1}


TWO_LOOPS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/              @!P1 BRA 0x10 ;
        /*0040*/                   FSEL R2, R2, -1e+30, P2 ;
        /*0050*/                   FSEL R3, R3, -1e+30, P2 ;
        /*0060*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0070*/                   LDG.E R6, desc[UR4][R4.64] ;
        /*0080*/              @!P0 BRA 0x40 ;
        /*0090*/                   EXIT ;
"""


def test_loop_profile_takes_the_pipelined_loop_over_a_longer_one():
    """The INT2 kernels have a masked, unpipelined copy of the page body (the block holding a
    partial page, NOTES v19): the page loop is the one issuing async copies, even if shorter."""
    profile = sa.loop_profile(TWO_LOOPS)
    assert profile["instructions"] == 3  # 0x10 … 0x30, not the 5 of 0x40 … 0x80
    assert profile["opcodes"] == {"LDGSTS": 1, "HMMA": 1, "BRA": 1}
    assert sa.loop_profile(TWO_LOOPS.replace("LDGSTS.E.BYPASS.128 [R2],", "LDG.E R7,"))["instructions"] == 5


def test_loop_profile_rejects_straight_line_code():
    with pytest.raises(ValueError, match="no backward branch"):
        sa.loop_profile(SNIPPET.replace("BRA 0x20", "BRA 0x70"))


FALLBACK_AFTER_EXIT = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;
        /*0020*/                   BRA.DIV UR7, 0xc0 ;
        /*0030*/               @P0 BRA 0x80 ;
        /*0040*/                   LOP3.LUT R2, R0, 0x3, RZ, 0xc0, !PT ;
        /*0050*/                   STG.E desc[UR4][R4.64], R2 ;
        /*0060*/              @!P1 EXIT ;
        /*0070*/                   EXIT ;
        /*0080*/                   SEL R2, R0, RZ, P2 ;
        /*0090*/                   VIMNMX R2, R2, R3, !PT ;
        /*00a0*/              @!P2 BRA 0x80 ;
        /*00b0*/                   BRA 0x50 ;
        /*00c0*/                   WARPSYNC.ALL ;
        /*00d0*/                   BRA 0x30 ;
"""


def test_shortest_path_skips_a_fallback_placed_after_the_exit():
    """A Triton `if` whose rare side ptxas put after the first EXIT (and a diverged warp's BRA.DIV
    detour): the path runs entry → EXIT through the common side, ALU ops counted."""
    profile = sa.shortest_path_profile(FALLBACK_AFTER_EXIT)
    assert profile["instructions"] == 7  # 0x00 … 0x60, leaving at the predicated EXIT
    assert profile["opcodes"] == {"S2R": 1, "ISETP": 1, "BRA": 2, "LOP3": 1, "STG": 1, "EXIT": 1}
    assert profile["alu"] == 2 and profile["loops"] == 0


def test_shortest_path_jumps_over_a_fallback_and_flags_loops():
    """A Pallas lax.cond whose rare side is jumped over; a loop on the path is counted once and flagged."""
    jumped = """
        /*0000*/              @!P0 BRA 0x40 ;
        /*0010*/                   SEL R2, R0, RZ, P2 ;
        /*0020*/                   SEL R2, R0, RZ, P2 ;
        /*0030*/                   SEL R2, R0, RZ, P2 ;
        /*0040*/                   VIADDMNMX R2, R2, R3, R4, PT ;
        /*0050*/              @!P1 BRA 0x40 ;
        /*0060*/                   EXIT ;
"""
    profile = sa.shortest_path_profile(jumped)
    assert profile["opcodes"] == {"BRA": 2, "VIADDMNMX": 1, "EXIT": 1}
    assert profile["alu"] == 1 and profile["loops"] == 1
    with pytest.raises(ValueError, match="no way from the entry"):
        sa.shortest_path_profile(jumped.replace("EXIT", "BRA 0x60"))


@pytest.mark.parametrize("unpack_asm,budget", [(False, 34), (True, 24)])
def test_int2_decode_kernel_instruction_budget(unpack_asm, budget):
    """The INT2 kernel at Qwen3-8B shapes as decode launches it (scores with tokens on M, one warp):
    32 warp instructions per (token, KV head) with the compiler's unpacking, 22 with the inline-PTX
    unpacker (which this also proves ptxas accepts); 61 at v3 (4 warps), which Nsight measured as
    the bound (63), 34 for v14's 2-warp kernel (benchmarks/NOTES.md v15). A change that adds work
    fails here."""
    pytest.importorskip("triton")
    fn, args = sa.qwen3_decode_case(num_warps=None, unpack_asm=unpack_asm)
    kernels = sa.compile_pallas_for_h200(fn, *args)
    (name,) = [n for n in kernels if n.startswith("oscar_int2")]
    usage = kernels[name]
    loop = sa.loop_profile(sa.sass(usage["compiled"].asm["cubin"]))
    per_token_head = loop["instructions"] * usage["num_warps"] / 64
    assert usage["spills"] == 0
    assert per_token_head <= budget, f"{per_token_head:.1f} warp instructions per (token, head)"
    assert loop["opcodes"].get("I2F", 0) == 0  # codes become bf16 operands by bit pattern, not conversion


def test_channels_on_m_int2_decode_kernel_budget():
    """The INT2 kernel with the values' dot transposed over 16-bit code pairs (channels_on_m, NOTES
    v26) at the decode launch: its V pairs staged in shared memory and read by ldmatrix (LDSM), half
    the MMAs of the shipped loop (64 a page against 96) and under 17 warp instructions per (token, KV
    head) (sm_90: 1014 a page, 15.8; the shipped kernel 1325, 20.7), at ≤ 176 registers (12 one-warp
    programs per SM instead of 8) without spills."""
    pytest.importorskip("triton")
    fn, args = sa.qwen3_decode_case(num_warps=None, unpack_asm=True, channels_on_m=True)
    kernels = sa.compile_pallas_for_h200(fn, *args)
    (name,) = [n for n in kernels if n.startswith("oscar_int2")]
    usage = kernels[name]
    loop = sa.loop_profile(sa.sass(usage["compiled"].asm["cubin"]))
    assert usage["spills"] == 0 and usage["registers"] <= 176, usage
    assert loop["opcodes"].get("LDSM", 0) >= 8 and loop["opcodes"]["HMMA"] == 64, loop["opcodes"]
    assert loop["instructions"] * usage["num_warps"] / 64 < 17, loop["instructions"]


def test_main_tables_the_page_loops_of_both_backends():
    """The CLI compiles the whole decode call (two tiers and the merge, which has no page loop)
    and tables the page loop of each INT2 kernel. It runs in a child process without
    TRITON_INTERPRET: once a session has imported the Triton kernels under the interpreter they
    are interpreted functions, which cannot be compiled (this failed in CI, not when run alone)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.static_analysis", "--num-warps", "4", "--unpack", "asm"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "int2" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["oscar_int2", "torch int2 (Triton)"]
    assert all(int(row.split("|")[6]) > 0 for row in rows)  # SASS instructions of the loop


def test_main_times_the_compile_of_each_default_decode_kernel():
    """--compile-times: one line per kernel of the default decode call (two tiers and the merge),
    each with the positive seconds its Triton IR took to become a cubin here."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.static_analysis", "--compile-times"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines() if line.strip()]
    assert sorted(words[2].split("_tier")[0] for words in lines) == ["oscar_bf16", "oscar_int2", "oscar_merge"]
    assert all(float(words[0]) > 0 and words[1] == "s" for words in lines)
