"""The shared IEEE bit-pattern constants and the integer bfloat16 rounding."""

import numpy as np
import pytest

from shared_math import float_bits as fb
from shared_math.spec import FP16_MAX


def test_constants_describe_float32_and_bfloat16():
    assert fb.F32_MAGNITUDE_MASK == 0x7FFFFFFF and fb.F32_SIGN_BIT == -(2**31) and fb.F32_SIGN_SHIFT == 31
    assert fb.F32_EXPONENT_MASK == 0x7F800000 and fb.F32_MANTISSA_MASK == 0x007FFFFF
    assert np.array(fb.FP16_MAX_BITS, np.int32).view(np.float32) == FP16_MAX
    assert fb.BF16_DROPPED_BITS == 16 and fb.BF16_LOW_MASK == 0xFFFF and fb.BF16_KEPT_MASK == ~0xFFFF
    assert fb.BF16_ROUNDING_BIAS == 0x7FFF and fb.BF16_QUIET_BIT == 0x40  # 0x7FC0: the quiet NaN


def test_bf16_rounded_bits_is_round_to_nearest_even():
    """Against ml_dtypes' cast (RNE): random magnitudes over the whole range, exact ties both ways,
    ±inf, ±0, overflow to inf and subnormals."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * np.exp2(rng.uniform(-140, 127, 20000))).astype(np.float32)
    ties = (np.arange(1, 257, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # halfway between bf16 values
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, -1e-40], np.float32)
    x = np.concatenate([x, ties, -ties, special])
    got = fb.bf16_rounded_bits(x.view(np.int32)).view(np.float32)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
