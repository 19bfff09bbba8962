"""The inline-PTX code unpacker (`unpack_asm=True`, GPU only) checked without a GPU.

Interpret mode cannot run PTX, so its three instructions are emulated here from the PTX ISA
definitions (prmt.b32 default mode, shr.b32, lop3.b32) over every 4-byte input pattern class, and
compared bit for bit with the operand bits the jnp path builds (`0x4300 | code` of the plane). What
this cannot check is Triton's packing convention for pack=4 (element i in byte i of the input,
elements 0/1 in the low/high half of $0); the GPU tests (OSCAR_TEST_GPU=1) check the whole kernel.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re

import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax.attention_ops import decode_attention
from oscar_jax.kernels.decode_attention import unpack_plane_ptx
from shared_math.spec import BF16_CODE_BIAS_BITS, CODE_BITS, CODE_MASK, CODES_PER_BYTE


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


def _run_ptx(source: str, word: int) -> tuple[int, int]:
    """Execute the unpacker's PTX on one input register $2; returns ($0, $1)."""
    regs = {"$2": word}
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
    return regs["$0"], regs["$1"]


def test_lop3_emulation_matches_its_truth_table():
    a, b, c = 0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA
    assert _lop3(a, b, c, 0xEA) == (a & b) | c  # the LUT constant is the function of F0, CC, AA


@pytest.mark.parametrize("plane", range(CODES_PER_BYTE))
def test_unpack_ptx_gives_the_bf16_operand_bits_of_its_plane(plane):
    source = unpack_plane_ptx(plane)
    assert len(re.findall(r"^(prmt|shr|lop3)", source, re.M)) == (4 if plane == 0 else 6)
    rng = np.random.default_rng(plane)
    words = np.concatenate([rng.integers(0, 2**32, 2000, dtype=np.uint64),
                            [0, 2**32 - 1, 0x01020304, 0xC0300C03, 0x55AA55AA]]).astype(np.uint64)
    for word in (int(w) for w in words):
        data = [(word >> (8 * i)) & 0xFF for i in range(4)]  # element i = byte i
        want = [BF16_CODE_BIAS_BITS | ((byte >> (plane * CODE_BITS)) & CODE_MASK) for byte in data]
        r0, r1 = _run_ptx(source, word)
        got = [r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16]
        assert got == want, f"word {word:#010x} plane {plane}: {[hex(g) for g in got]} != {[hex(w) for w in want]}"


def test_unpack_asm_refuses_what_it_cannot_run():
    from oscar_jax.tests.test_decode_attention import SINK_SLOTS, build_cache

    cache = build_cache(np.random.default_rng(0), (200,), num_kv_heads=1, head_dim=64, group_size=64)
    call = lambda q, **kw: decode_attention(q, *cache.arrays, sink_slots=SINK_SLOTS, group_size=64,  # noqa: E731
                                            softmax_scale=0.1, unpack_asm=True, **kw)
    with pytest.raises(ValueError, match="interpret mode cannot run PTX"):
        call(jnp.zeros((1, 2, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="q float32"):
        call(jnp.zeros((1, 2, 64), jnp.float32), interpret=False)
    with pytest.raises(ValueError, match="unpack_asm='yes' must be a bool"):
        decode_attention(jnp.zeros((1, 2, 64), jnp.bfloat16), *cache.arrays, sink_slots=SINK_SLOTS, group_size=64,
                         softmax_scale=0.1, unpack_asm="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group_size,page_size", [(128, 128, 64), (128, 32, 64), (64, 16, 16)])
def test_unpack_asm_on_the_gpu_matches_the_default_kernel(head_dim, group_size, page_size):
    from oscar_jax.tests.test_decode_attention import SINK, build_cache

    cache = build_cache(np.random.default_rng(1), (4000, 1337, 300), num_kv_heads=2, head_dim=head_dim,
                        group_size=group_size, page_size=page_size, recent=256)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, head_dim)), jnp.bfloat16)
    kw = dict(sink_slots=SINK // page_size, group_size=group_size, softmax_scale=head_dim**-0.5, interpret=False)
    default = np.asarray(decode_attention(q, *cache.arrays, **kw))
    unpacked = np.asarray(decode_attention(q, *cache.arrays, unpack_asm=True, **kw))
    # the same dot operands (bits) feed the same arithmetic: equal up to float32 reassociation
    np.testing.assert_allclose(unpacked, default, rtol=0, atol=1e-6)
