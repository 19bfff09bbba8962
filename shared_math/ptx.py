"""How both GPU backends' INT2 attention kernels turn stored code bytes into bfloat16 dot operands:
the operand convention and the inline PTX that builds it.

Not part of the stored format (that is spec.py). Code c of bit plane p (bits 2p, 2p + 1 of a byte)
becomes the bfloat16 whose bits are `BF16_CODE_BIAS_BITS | c << plane_place(p)`: the exact value

    BF16_CODE_BIAS + c · plane_factor(p),      plane_factor(p) = 2 ** plane_place(p),

because 0x4300 is 128.0 and its 7 mantissa bits count units of 1. Planes 0–2 stay where the byte
holds them (places 0, 2, 4: factors 1, 4, 16), so a mask alone extracts them; plane 3 (bits 6-7)
would reach the exponent and is shifted right by one to place 5 (factor 32). The kernels take
the factors back out where it costs a vector, not a matrix: the query plane is multiplied by
1 / factor (exact: a power of two), the output plane is carried in units of its factor and
divided once at the end (benchmarks/DECISIONS.md D11). The code bias (128) is subtracted in the
minimum terms.

One instance of `unpack_plane_ptx(plane)` runs under Triton's `inline_asm_elementwise` /
Pallas' `elementwise_inline_asm` with pack = 4: its input register $2 holds four code bytes
(element i in byte i), and its outputs $0 / $1 receive elements (0, 1) / (2, 3) as bfloat16
halves (element 0 in the low half), built by

    PRMT   spread bytes (0, 1) and (2, 3) over the two 16-bit halves of a word
    SHR    plane 3 only: bring bits 6-7 of each byte to bits 5-6
    LOP3   (x & plane_mask(p) in both halves) | 0x43004300

The CPU tests emulate these instructions (shared_math/tests/test_ptx.py).
"""

from __future__ import annotations

from shared_math.float_bits import BF16_MANTISSA_BITS
from shared_math.spec import BF16_CODE_BIAS, BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE

LOP3_A_AND_B_OR_C = 0xEA  # immLut of (a & b) | c: f(0xF0, 0xCC, 0xAA)
SPREAD_LOW_BYTES = 0x3120  # PRMT selector: byte 0 → bits 0-7, byte 1 → bits 16-23
SPREAD_HIGH_BYTES = 0x1302  # PRMT selector: byte 2 → bits 0-7, byte 3 → bits 16-23
UNPACK_CONSTRAINTS = "=r,=r,r"  # two outputs (4 bfloat16), one input (4 bytes)
UNPACK_PACK = 4
PAIR_UNPACK_CONSTRAINTS = "=r,r"  # one output (2 bfloat16), one input (2 code pairs of 16 bits)
PAIR_UNPACK_PACK = 2
BITS_PER_BYTE = 8
BYTES_PER_PAIR = 2  # a code pair: bytes 2j, 2j + 1 of a row, read as one 16-bit element
_HIGHEST_PLACE = BF16_MANTISSA_BITS - CODE_BITS  # 5: bits 5-6, the top of the mantissa


def _check_plane(plane: int) -> None:
    if not 0 <= plane < CODES_PER_BYTE:
        raise ValueError(f"plane={plane} must lie in [0, {CODES_PER_BYTE})")


def plane_place(plane: int) -> int:
    """The mantissa bit where the operand of bit plane `plane` holds its code (0, 2, 4, 5)."""
    _check_plane(plane)
    return min(plane * CODE_BITS, _HIGHEST_PLACE)


def plane_shift(plane: int) -> int:
    """Right shift that brings the plane's bits to their place (0 for planes 0–2, 1 for plane 3)."""
    return plane * CODE_BITS - plane_place(plane)


def plane_mask(plane: int) -> int:
    """The bits of a (shifted) byte that hold the plane's code at its place."""
    return CODE_MASK << plane_place(plane)


def plane_factor(plane: int) -> float:
    """The operand of code c is BF16_CODE_BIAS + c · plane_factor(plane)."""
    return float(1 << plane_place(plane))


def operand_bits(byte: int, plane: int) -> int:
    """The bfloat16 bits of the operand a code byte gives for `plane` (what every unpacker builds)."""
    return BF16_CODE_BIAS_BITS | ((byte >> plane_shift(plane)) & plane_mask(plane))


assert all(BF16_CODE_BIAS + CODE_MASK * plane_factor(p) < 2 * BF16_CODE_BIAS for p in range(CODES_PER_BYTE))


def _both_halves(bits: int) -> int:
    """A 16-bit pattern in both halves of a 32-bit word (two bfloat16 operands a register)."""
    return bits | bits << 16


def unpack_plane_ptx(plane: int) -> str:
    """PTX of bit plane `plane` (0 … CODES_PER_BYTE − 1); see the module docstring."""
    mask, bias = _both_halves(plane_mask(plane)), _both_halves(BF16_CODE_BIAS_BITS)
    shift = plane_shift(plane)
    shifts = [f"shr.b32 lo, lo, {shift};", f"shr.b32 hi, hi, {shift};"] if shift else []
    return "\n".join([
        "{", ".reg .b32 lo, hi;",
        f"prmt.b32 lo, $2, $2, {SPREAD_LOW_BYTES:#06x};", f"prmt.b32 hi, $2, $2, {SPREAD_HIGH_BYTES:#06x};", *shifts,
        f"lop3.b32 $0, lo, {mask:#010x}, {bias:#010x}, {LOP3_A_AND_B_OR_C:#04x};",
        f"lop3.b32 $1, hi, {mask:#010x}, {bias:#010x}, {LOP3_A_AND_B_OR_C:#04x};", "}"])


def unpack_pair_plane_ptx(plane: int, high: int) -> str:
    """PTX of bit plane `plane` of one byte of 16-bit code pairs (`high` 0: the low byte, byte 2j of
    the row; 1: the high byte, byte 2j + 1), under pack = 2: $1 holds two pairs (element 0 in the low
    half), $0 receives their two operands as bfloat16 halves. The wanted byte of each pair is
    shifted to the bottom of its half (with the plane's own shift), then masked and biased as in
    unpack_plane_ptx; the bits a shift moves across halves fall outside the mask."""
    _check_plane(plane)
    if high not in (0, 1):
        raise ValueError(f"high={high} must be 0 (the low byte) or 1 (the high byte)")
    mask, bias = _both_halves(plane_mask(plane)), _both_halves(BF16_CODE_BIAS_BITS)
    shift = high * BITS_PER_BYTE + plane_shift(plane)
    source = "t" if shift else "$1"
    return "\n".join([
        "{", ".reg .b32 t;", *([f"shr.b32 t, $1, {shift};"] if shift else []),
        f"lop3.b32 $0, {source}, {mask:#010x}, {bias:#010x}, {LOP3_A_AND_B_OR_C:#04x};", "}"])
