"""The inline-PTX code unpacker (shared_math.ptx) checked without a GPU.

Its three instructions are emulated from the PTX ISA definitions (prmt.b32 default mode, shr.b32,
lop3.b32) over random and edge-case 4-byte inputs and compared bit for bit with the operand bits
the operand convention asks for (`BF16_CODE_BIAS_BITS | code << place`, the value 128 + code·2^place).
Not checked here:
Triton's packing convention for pack = 4 (element i in byte i of the input register, elements 0 / 1
in the low / high half of $0); the GPU tests (OSCAR_TEST_GPU=1) check whole kernels.
"""

import re

import numpy as np
import pytest

from shared_math.ptx import operand_bits, plane_factor, plane_place, unpack_pair_plane_ptx, unpack_plane_ptx
from shared_math.spec import BF16_CODE_BIAS, BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE


EXPECTED_PLACES = (0, 2, 4, 5)  # planes 0-2 where the byte holds them; plane 3 shifted below the exponent


def _prmt(a: int, b: int, selector: int) -> int:
    pool = (b << 32) | a  # bytes 0-3 from a, 4-7 from b
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:  # sign replicate
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """immLut = f(0xF0, 0xCC, 0xAA): bit 4a + 2b + c of the table is f(a, b, c)."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def _run_ptx(source: str, word: int, source_register: str = "$2") -> tuple[int, int | None]:
    """Execute an unpacker's PTX on its one input register (`source_register`); returns ($0, $1)
    ($1 None where the unpacker has one output)."""
    regs = {source_register: word}
    value = lambda t: regs[t] if t in regs else int(t, 0)  # noqa: E731
    for line in source.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            regs[args[0]] = _prmt(value(args[1]), value(args[2]), value(args[3]))
        elif op == "shr.b32":
            regs[args[0]] = value(args[1]) >> value(args[2])
        elif op == "lop3.b32":
            regs[args[0]] = _lop3(value(args[1]), value(args[2]), value(args[3]), value(args[4]))
        else:
            raise AssertionError(f"unexpected instruction {op!r}")
    return regs["$0"], regs.get("$1") if source_register != "$1" else None


def test_lop3_emulation_matches_its_truth_table():
    a, b, c = 0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA
    assert _lop3(a, b, c, 0xEA) == (a & b) | c  # the LUT constant is the function of F0, CC, AA


@pytest.mark.parametrize("plane", range(CODES_PER_BYTE))
def test_unpack_ptx_gives_the_bf16_operand_bits_of_its_plane(plane):
    source = unpack_plane_ptx(plane)
    assert len(re.findall(r"^(prmt|shr|lop3)", source, re.M)) == (6 if plane == 3 else 4)  # shift plane 3 only
    rng = np.random.default_rng(plane)
    words = np.concatenate([rng.integers(0, 2**32, 2000, dtype=np.uint64),
                            [0, 2**32 - 1, 0x01020304, 0xC0300C03, 0x55AA55AA]]).astype(np.uint64)
    for word in (int(w) for w in words):
        data = [(word >> (8 * i)) & 0xFF for i in range(4)]  # element i = byte i
        want = [BF16_CODE_BIAS_BITS | ((byte >> (plane * CODE_BITS)) & CODE_MASK) << EXPECTED_PLACES[plane]
                for byte in data]
        assert [operand_bits(byte, plane) for byte in data] == want
        r0, r1 = _run_ptx(source, word)
        got = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
        assert got == want, f"word {word:#010x} plane {plane}: {[hex(g) for g in got]} != {[hex(w) for w in want]}"


def _bf16_value(bits: int) -> float:
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


@pytest.mark.parametrize("plane", range(CODES_PER_BYTE))
def test_operand_value_is_the_code_bias_plus_the_code_times_the_plane_factor(plane):
    assert plane_place(plane) == EXPECTED_PLACES[plane]
    for code in range(CODE_MASK + 1):
        byte = code << (plane * CODE_BITS) | (0xFF ^ CODE_MASK << (plane * CODE_BITS))  # other planes all ones
        assert _bf16_value(operand_bits(byte, plane)) == BF16_CODE_BIAS + code * plane_factor(plane)


def test_plane_out_of_range_is_refused():
    for function in (unpack_plane_ptx, plane_place, plane_factor):
        with pytest.raises(ValueError, match="plane=4"):
            function(CODES_PER_BYTE)



@pytest.mark.parametrize("high", [0, 1])
@pytest.mark.parametrize("plane", range(CODES_PER_BYTE))
def test_pair_unpack_ptx_gives_the_operand_of_its_byte_and_plane(plane, high):
    """The channels-on-M values' unpacker (NOTES v26): $1 holds two 16-bit code pairs (element 0 in the
    low half), $0 gets the operand bits of byte `high` of each pair, for every pair value."""
    source = unpack_pair_plane_ptx(plane, high)
    shifts = 1 if high or plane == 3 else 0
    assert len(re.findall(r"^(shr|lop3)", source, re.M)) == 1 + shifts  # one mask, at most one shift
    pairs = np.arange(2**16, dtype=np.uint64)
    rng = np.random.default_rng(plane + 4 * high)
    words = (pairs | rng.permutation(pairs) << np.uint64(16)).tolist()  # every pair in each half
    for word in words:
        data = [(word >> (8 * (2 * i + high))) & 0xFF for i in range(2)]  # byte `high` of each pair
        r0, _ = _run_ptx(source, word, source_register="$1")
        assert [r0 & 0xFFFF, r0 >> 16] == [operand_bits(byte, plane) for byte in data], f"word {word:#010x}"


def test_pair_unpack_refuses_a_byte_other_than_low_or_high():
    with pytest.raises(ValueError, match="high=2 must be 0"):
        unpack_pair_plane_ptx(0, 2)
