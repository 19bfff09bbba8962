"""IEEE 754 binary32 / bfloat16 bit-pattern constants and the integer bfloat16 rounding, for every
backend (NumPy reference, Pallas and Triton kernels, parity tests).

Not format constants: they describe the machine's float types. They live here once so that the
kernels' integer tricks (order-preserving keys, exact bfloat16 widening and rounding) and the
references that check them read the same numbers.
"""

from __future__ import annotations

import numpy as np

from shared_math.spec import FP16_MAX

_INT32 = np.iinfo(np.int32)
_F32 = np.finfo(np.float32)
BF16_MANTISSA_BITS = 7  # bfloat16: 1 sign, 8 exponent, 7 mantissa bits

F32_MAGNITUDE_MASK = int(_INT32.max)  # bits & mask = the bits of |x|
F32_SIGN_BIT = int(_INT32.min)  # the sign bit as an int32
F32_SIGN_SHIFT = _INT32.bits - 1  # arithmetic shift: 0 for x ≥ +0, all ones for x ≤ −0
F32_MANTISSA_MASK = (1 << int(_F32.nmant)) - 1
F32_EXPONENT_MASK = F32_MAGNITUDE_MASK & ~F32_MANTISSA_MASK
FP16_MAX_BITS = int(np.float32(FP16_MAX).view(np.int32))  # largest |x| bits after sanitize
# Thresholds in ordered-key space that every key meets / that no key of |x| ≤ FP16_MAX meets.
ORDERED_KEY_BELOW_ALL = int(_INT32.min)
ORDERED_KEY_ABOVE_ALL = int(_INT32.max)

BF16_DROPPED_BITS = int(_F32.nmant) - BF16_MANTISSA_BITS  # 16: a bfloat16 is the top half of a float32
BF16_ROUNDING_BIAS = (1 << (BF16_DROPPED_BITS - 1)) - 1  # round-to-nearest-even: + 0x7FFF + lsb
BF16_KEPT_MASK = -(1 << BF16_DROPPED_BITS)  # int32 0xFFFF0000: the float32 bits a bfloat16 keeps
BF16_QUIET_BIT = 1 << (BF16_MANTISSA_BITS - 1)  # the quiet-NaN bit of a bfloat16 pattern
BF16_LOW_MASK = (1 << BF16_DROPPED_BITS) - 1  # the float32 bits a bfloat16 value leaves zero


def bf16_rounded_bits(bits):
    """int32 float32 bit patterns → the float32 bit patterns of their round-to-nearest-even
    bfloat16 (low 16 bits zero), for finite input. Integer operators only, so the same
    expression runs on NumPy, JAX and torch integer arrays (a compiler may elide a float
    convert pair; it cannot elide these)."""
    lsb = (bits >> BF16_DROPPED_BITS) & 1
    return (bits + BF16_ROUNDING_BIAS + lsb) & BF16_KEPT_MASK
