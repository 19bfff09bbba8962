"""The root conftest's speed-up of the Triton interpreter (triton.language patched once a launch,
not again at every nested @triton.jit call): installed, and a launch leaves the language as it
found it, nested calls computing what they should."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from oscar_torch.tests.util import ON_GPU  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="the interpreter is the CPU suite's")


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _nested(x):
    return _twice(_twice(x)) - 1  # two levels of device functions


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, _nested(tl.load(x_ptr + offsets)) + tl.sum(_twice(tl.load(x_ptr + offsets)), axis=0))


def test_interpreter_patches_the_language_once_a_launch():
    assert interpreter._patch_lang.__name__ == "patch_lang_once"
    before = {name: getattr(tl, name) for name in ("arange", "load", "store", "sum", "where")}
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _kernel[(1,)](x, out, N=8)
    _kernel[(1,)](x, out, N=8)  # a second launch patches again
    assert torch.equal(out, 4 * x - 1 + 2 * x.sum())
    assert {name: getattr(tl, name) for name in before} == before, "a launch left triton.language patched"
