"""oscar_torch's codec beyond the shared op suite (parity_tests/test_ops_codec.py, where encode /
decode of every backend, the order statistics and encode by planes are tested against
shared_math.codec bit for bit): small shapes, the errors only torch tensors can make (not a tensor,
strides, devices), and which path a block of encode by planes takes.

Runs the Triton kernels in the interpreter on CPU; with OSCAR_TEST_GPU=1 on a GPU machine the same
tests run them compiled on cuda.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from oscar_torch import ops
from oscar_torch.kernels import codec as kcodec
from oscar_torch.tests.util import DEVICE, to_numpy, to_torch
from parity_tests.cases import DATA, LEVELS, assert_same_bits
from shared_math import codec as ref

F32 = np.float32


def assert_encode_matches(x, *, group_size, clip_ratio, levels, what=""):
    got = ops.encode(to_torch(x), group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    want = ref.encode(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels)
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(to_numpy(a), e, f"{what} {name} G={group_size} c={clip_ratio} {levels}")
    return got


@pytest.mark.parametrize("d,group_size,clip_ratio", [(16, 16, 0.5), (64, 32, 0.92), (128, 64, 0.96), (128, 16, 1.0)])
def test_encode_small_shapes(d, group_size, clip_ratio):
    rng = np.random.default_rng(d + group_size)
    for levels in LEVELS:
        for data in ("heavy", "special"):
            x = DATA[data](rng, (17, d))
            assert_encode_matches(x, group_size=group_size, clip_ratio=clip_ratio, levels=levels, what=data)


# ------------------------------------------------------------------------------- bad inputs
# (the errors of numpy-expressible inputs, both frameworks: parity_tests/test_ops_codec.py)

GOOD = torch.zeros((2, 64), device=DEVICE)
PACKED = torch.zeros((2, 16), dtype=torch.uint8, device=DEVICE)
SCALE = torch.zeros((2, 2), dtype=torch.float16, device=DEVICE)
META = torch.device("meta")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.encode(np.zeros((2, 64), F32), group_size=32, clip_ratio=0.9), "x must be a torch.Tensor"),
        (lambda: ops.encode(torch.zeros((64, 2), device=DEVICE).T, group_size=32, clip_ratio=0.9),
         r"x must be contiguous, got strides \(1, 2\)"),
        (lambda: ops.encode(GOOD.to(META), group_size=32, clip_ratio=0.9), "x is on device meta"),
        (lambda: ops.decode(PACKED[:, :12], SCALE, SCALE, group_size=16), "packed must be contiguous"),
        (lambda: ops.decode(PACKED, SCALE.to(META), SCALE, group_size=32), "scale is on device meta"),
        (lambda: ops.decode(PACKED.to(META), SCALE.to(META), SCALE.to(META), group_size=32),
         "packed is on device meta: oscar_torch kernels run on cuda"),
    ],
)
def test_bad_torch_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------- encode by planes


@triton.jit
def _zeros_encode_block(x, GROUP_SIZE: tl.constexpr, CLIP_INDEX: tl.constexpr, LEVELS: tl.constexpr,
                        ORDER_STATISTIC: tl.constexpr):
    """A stand-in for encode_block that marks its blocks: every output zero."""
    ROWS: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    return (tl.zeros((ROWS, D // 4), tl.int32), tl.zeros((ROWS, D // GROUP_SIZE), tl.float16),
            tl.zeros((ROWS, D // GROUP_SIZE), tl.float16))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="swaps a kernel function, which only the interpreter sees")
def test_encode_by_planes_falls_back_only_where_a_row_declines(monkeypatch):
    """Which path each block takes (encode_block swapped for a stand-in that writes zeros): blocks
    of N(0, 1) rows come from encode_planes (shared_math's bytes), the block with a NaN row and
    only it from encode_block — so a decision that always fell back could not pass unseen."""
    monkeypatch.setattr(kcodec, "encode_block", _zeros_encode_block)
    x = np.random.default_rng(3).standard_normal((48, 128)).astype(F32)
    x[20, 7] = np.nan  # in the second block of 16
    got = kcodec.encode_rows(to_torch(x), group_size=128, clip_index=122, levels="minmax", block_rows=16, planes=True)
    want = ref.encode(x, group_size=128, clip_ratio=0.96)
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        a = to_numpy(a)
        assert_same_bits(np.delete(a, np.s_[16:32], axis=0), np.delete(e, np.s_[16:32], axis=0), name)
        assert not a[16:32].view(f"u{a.itemsize}").any(), f"{name}: the NaN block did not fall back"
