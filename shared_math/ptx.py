"""Inline PTX shared by both GPU backends: the code-plane unpacker of the INT2 attention kernels.

Not part of the stored format (that is spec.py): how a kernel turns stored code bytes into
bfloat16 dot operands. One instance of `unpack_plane_ptx(plane)` runs under Triton's
`inline_asm_elementwise` / Pallas' `elementwise_inline_asm` with pack = 4: its input register $2
holds four code bytes (element i in byte i), and its outputs $0 / $1 receive elements (0, 1) /
(2, 3) as bfloat16 halves (element 0 in the low half). Each output is the bit pattern
`BF16_CODE_BIAS_BITS | code`, the exact value 128 + code (spec.py), built by

    PRMT   spread bytes (0, 1) and (2, 3) over the two 16-bit halves of a word
    SHR    bring bit plane `plane` (bits 2·plane, 2·plane + 1 of each byte) to bits 0-1 / 16-17
    LOP3   (x & 0x00030003) | 0x43004300

≈ 1 instruction per code, against ~2.6 for the shift/and/or/convert chain the compilers emit
(benchmarks/NOTES.md). The CPU tests emulate these three instructions (shared_math/tests/test_ptx.py).
"""

from __future__ import annotations

from shared_math.spec import BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE

LOP3_A_AND_B_OR_C = 0xEA  # immLut of (a & b) | c: f(0xF0, 0xCC, 0xAA)
SPREAD_LOW_BYTES = 0x3120  # PRMT selector: byte 0 → bits 0-7, byte 1 → bits 16-23
SPREAD_HIGH_BYTES = 0x1302  # PRMT selector: byte 2 → bits 0-7, byte 3 → bits 16-23
UNPACK_CONSTRAINTS = "=r,=r,r"  # two outputs (4 bfloat16), one input (4 bytes)
UNPACK_PACK = 4


def unpack_plane_ptx(plane: int) -> str:
    """PTX of bit plane `plane` (0 … CODES_PER_BYTE − 1); see the module docstring."""
    if not 0 <= plane < CODES_PER_BYTE:
        raise ValueError(f"plane={plane} must lie in [0, {CODES_PER_BYTE})")
    mask = CODE_MASK | CODE_MASK << 16
    bias = BF16_CODE_BIAS_BITS | BF16_CODE_BIAS_BITS << 16
    shift = [f"shr.b32 lo, lo, {plane * CODE_BITS};", f"shr.b32 hi, hi, {plane * CODE_BITS};"] if plane else []
    return "\n".join([
        "{", ".reg .b32 lo, hi;",
        f"prmt.b32 lo, $2, $2, {SPREAD_LOW_BYTES:#06x};", f"prmt.b32 hi, $2, $2, {SPREAD_HIGH_BYTES:#06x};", *shift,
        f"lop3.b32 $0, lo, {mask:#010x}, {bias:#010x}, {LOP3_A_AND_B_OR_C:#04x};",
        f"lop3.b32 $1, hi, {mask:#010x}, {bias:#010x}, {LOP3_A_AND_B_OR_C:#04x};", "}"])
