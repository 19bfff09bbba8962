"""oscar_jax's codec kernels beyond the shared op suite (parity_tests/test_ops_codec.py, where
encode / decode of every backend, the order statistics and encode by planes are tested against
shared_math.codec bit for bit): the order statistic's block body on its own, jit, the interpret
default, the compiled encode's SASS, and which path a block of encode by planes takes.

Runs in Pallas interpret mode on CPU; with JAX_PLATFORMS=cuda the same tests compile the kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import ops
from oscar_jax.kernels import codec as kcodec
from parity_tests.cases import assert_same_bits, normal_rows, order_statistic_rows
from shared_math import codec as ref
from shared_math.spec import clip_index

pytestmark = pytest.mark.kernels("pallas")  # the Pallas kernels (interpret mode on CPU), not the XLA path

F32 = np.float32


@pytest.mark.parametrize("clip_ratio", [0.05, 0.5, 0.92, 0.96, 1.0])
def test_clip_threshold_bits_equals_the_sorted_value(clip_ratio):
    """Every exact order statistic's block body, jitted on its own, equals the sorted value (its
    encode bytes: parity_tests/test_ops_codec.py::test_order_statistic_methods_agree_with_sort)."""
    d = 64
    x = order_statistic_rows(d)
    k = clip_index(clip_ratio, d)
    sanitized = ref.sanitize(x)
    want = np.sort(np.abs(sanitized), axis=-1)[:, k : k + 1].view(np.int32)
    abs_bits = jnp.asarray(np.abs(sanitized).view(np.int32))
    for method in kcodec.ORDER_STATISTICS:
        got = jax.jit(
            functools.partial(kcodec.clip_threshold_bits, clip_index=k, order_statistic=method)
        )(abs_bits)
        assert_same_bits(got, want, method)


def test_ops_are_jittable_and_deterministic():
    rng = np.random.default_rng(5)
    x = jnp.asarray(normal_rows(rng, (6, 64)))
    enc = jax.jit(functools.partial(ops.encode, group_size=32, clip_ratio=0.96))
    dec = jax.jit(functools.partial(ops.decode, group_size=32))
    first = enc(x)
    for a, b in zip(first, enc(x)):
        assert_same_bits(a, b, "run twice")
    for a, e in zip(first, ref.encode(np.asarray(x), group_size=32, clip_ratio=0.96)):
        assert_same_bits(a, e, "jit")
    assert_same_bits(dec(*first), ops.decode(*first, group_size=32), "decode under jit")


def test_interpret_default_follows_the_backend():
    assert kcodec.resolve_interpret(None) == (jax.default_backend() == "cpu")
    assert kcodec.resolve_interpret(True) is True and kcodec.resolve_interpret(False) is False


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16_rows", "f32_rows"])
def test_encode_by_planes_compiles_for_h200_and_runs_fewer_instructions(dtype):
    """The Pallas encode with planes, lowered and compiled for sm_90 on the CPU (interpret mode
    applies no GPU lowering rule): no spills, and on the path a block that takes encode_planes runs
    (the shortest way through the SASS: lax.cond's fallback is jumped over) at most 60 % of the
    ALU-pipe instructions an element of encode_block at its shipped 16 rows (NOTES v23: 0.41 bf16,
    0.44 float32)."""
    pytest.importorskip("triton")
    from benchmarks.static_analysis import compile_pallas_for_h200, sass, shortest_path_profile

    alu_per_element = {}
    for planes, rows in ((False, 16), (True, 32)):
        fn = functools.partial(kcodec.encode_rows, group_size=128, clip_index=122, levels="minmax", block_rows=rows,
                               planes=planes, interpret=False)
        (usage,) = compile_pallas_for_h200(fn, jax.ShapeDtypeStruct((4096, 128), dtype)).values()
        assert usage["spills"] == 0 and 0 < usage["registers"] <= 255, usage
        path = shortest_path_profile(sass(usage["compiled"].asm["cubin"]))
        alu_per_element[planes] = path["alu"] * usage["num_warps"] * 32 / (rows * 128)
    assert alu_per_element[True] <= 0.6 * alu_per_element[False], alu_per_element


def test_encode_by_planes_falls_back_only_where_a_row_declines():
    """Which path a block takes: encode_planes_or_block with `load_rows` giving zeros, so that
    a fallback shows — a block of N(0, 1) rows has shared_math's bytes (encode_planes), a block
    holding a NaN row, or a masked-out row only among N(0, 1) rows, as the masks say."""
    x = np.random.default_rng(3).standard_normal((16, 128)).astype(F32)
    zeros = jnp.zeros((16, 128), jnp.float32)
    kw = dict(planes=True, rows_bf16=False, group_size=128, clip_index=122, levels="minmax",
              order_statistic="checked_max")

    def encode(rows, mask=None):
        planes = [jnp.asarray(p) for p in np.split(rows, 4, axis=1)]
        return jax.jit(lambda: kcodec.encode_planes_or_block(lambda: planes, lambda: zeros, mask, **kw))()

    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), encode(x), want):
        assert_same_bits(np.asarray(a), e, f"{name} (planes)")
    declined = x.copy()
    declined[5, 7] = np.nan
    fallback = ref.encode(np.zeros((16, 128), F32), group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), encode(declined), fallback):
        assert_same_bits(np.asarray(a), e, f"{name} (a NaN row: encode_block)")
    masked = jnp.asarray(np.arange(16)[:, None] != 5)  # the NaN row does not exist: planes again
    for name, a, e in zip(("packed", "scale", "minimum"), encode(declined, masked), want):
        assert_same_bits(np.asarray(a)[np.arange(16) != 5], e[np.arange(16) != 5], f"{name} (masked NaN row)")
