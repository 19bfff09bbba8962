"""What the Pallas tier kernels (and the prefill kernel) share: the mask value, the dots, the fused
multiply-add and the online-softmax steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from shared_math.tiling import LN2

# Scores of masked tokens. Finite (not −inf), so that a block with no valid token keeps the
# running maximum finite and exp(m_old − m_new) never becomes exp(−inf + inf) = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# `dot` in the Triton lowering needs M, N, K ≥ 16 (mma tile); blocks are sized to respect it.
MIN_DOT_DIM = 16


def cdiv(a, b):
    return (a + b - 1) // b


def _precision(a, b):
    # float32 operands: IEEE float32 on the GPU. Precision.DEFAULT lowers to TF32 in the Triton
    # lowering, which the H200 parity run measured at 2.4e-4 … 3.7e-3 error (f32 tolerance 2e-5).
    f32 = jnp.dtype(jnp.float32)
    return lax.Precision.HIGHEST if f32 in (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) else lax.Precision.DEFAULT


def dot_nt(a, b):
    """a [M, C] · b [N, C]ᵀ → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, C] · b [C, N] → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


def dot_tn(a, b):
    """a [C, M]ᵀ · b [C, N] → [M, N] float32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b),
                           preferred_element_type=jnp.float32)


# XLA compiles a Pallas kernel's Triton IR without contracting a·b + c into one FFMA (Triton's
# own compile does: the INT2 decode loop's SASS under ncu held separate FMULs and FADDs where
# Triton's held FFMAs), so the kernels spell the hot multiply-adds as one fma by inline PTX when
# they run compiled (benchmarks/DECISIONS.md D14).
FMA_PTX = "fma.rn.f32 $0, $1, $2, $3;"
FMA_CONSTRAINTS = "=f,f,f,f"


def multiply_add(a, b, c, fused: bool):
    """a·b + c of float32 arrays (broadcast together): one rounding by inline PTX with `fused`
    (compiled kernels only: interpret mode cannot run PTX), else the two-rounding a·b + c."""
    if not fused:
        return a * b + c
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
    args = [jnp.broadcast_to(x, shape) for x in (a, b, c)]
    return pl_triton.elementwise_inline_asm(
        FMA_PTX, args=args, constraints=FMA_CONSTRAINTS, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])[0]


def online_softmax_step(scores, valid, m_prev, l_prev):
    """One online-softmax step on a [M, N] score tile in base-2 units (`shared_math.tiling.base2_score_scale`); `valid`
    broadcasts to [M, N].

    Returns (p, correction, m_new, l_new). Masked entries get p = 0 exactly, even while a row
    has seen no valid score yet (then m stays MASK_VALUE and exp2(scores − m) would be 1).
    """
    scores = jnp.where(valid, scores, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1))
    correction = jnp.exp2(m_prev - m_new)
    p = jnp.where(valid, jnp.exp2(scores - m_new[:, None]), 0.0)
    l_new = l_prev * correction + jnp.sum(p, axis=1)
    return p, correction, m_new, l_new


def finalize_rows(l, m):
    """Normaliser and natural log-sum-exp of the finished rows (m in base-2 units); empty rows
    get lse = −inf."""
    nonempty = l > 0.0
    inv_l = 1.0 / jnp.where(nonempty, l, 1.0)
    lse = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * LN2, -jnp.inf)
    return inv_l, lse


def partials_outputs(batch, num_kv_heads, splits, rows, head_dim, block_m) -> dict:
    """pallas_call's out_specs / out_shape of a tier's split-K partials on the (b, h, r, s) grid:
    o float32 [B, K, S, rows, D] and lse float32 [B, K, S, rows], one block_m-row block per program."""
    return dict(
        out_specs=[
            pl.BlockSpec((None, None, None, block_m, head_dim), lambda b, h, r, s: (b, h, s, r, 0)),  # o
            pl.BlockSpec((None, None, None, block_m), lambda b, h, r, s: (b, h, s, r)),  # lse
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
        ],
    )
