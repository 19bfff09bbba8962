"""One helper for the argument checks of oscar_torch's public ops, with uniform messages.

Every public op validates on the host before it launches a kernel: type, dtype, shape, device and
contiguity of each tensor, and the static arguments. Invalid arguments raise ValueError naming the
argument and the offending value; valid but unsupported configurations raise NotImplementedError.
The checks read only metadata (shapes, dtypes, strides, devices), so they also run on FakeTensors
under torch.compile. Value checks (page-id ranges, distinct destinations) read the ids and so
synchronise with the device: they run in eager mode only (`checking_values`); when they are
skipped (torch.compile, CUDA graphs) the kernels mask out-of-range destinations instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from oscar_torch.kernels.codec import interpreting
from shared_math.spec import is_power_of_two

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    x,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """x must be a contiguous torch.Tensor of one of `dtypes` with `shape` (None = any size).

    `layout` names the axes in the message (e.g. "[pages, kv_heads, page_size, head_dim]").
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in tuple(dtypes):
        raise ValueError(f"{name} must have dtype {_dtype_names(dtypes)}, got dtype {str(x.dtype).removeprefix('torch.')}")
    if shape is not None:
        mismatch = len(shape) != x.dim() or any(w is not None and g != w for g, w in zip(x.shape, shape))
        if mismatch:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            where = f" {layout}" if layout else ""
            raise ValueError(f"{name} must have shape {want}{where}, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {tuple(x.stride())} for shape {tuple(x.shape)} "
            f"(call .contiguous())"
        )
    return x


def check_devices(**tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device, and a device the kernels run on: cuda, or cpu under the Triton
    interpreter (TRITON_INTERPRET=1). Returns the device."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    device = first.device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(
                f"{name} is on device {t.device} but {first_name} is on device {device}: "
                f"all tensors of one call must share a device"
            )
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return device
    raise ValueError(
        f"{first_name} is on device {device}: oscar_torch kernels run on cuda, or on cpu under the "
        f"Triton interpreter (TRITON_INTERPRET=1 set before the kernels are defined)"
    )


def check_static_int(name: str, value, *, power_of_two: bool = False, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if power_of_two and not is_power_of_two(value):
        raise ValueError(f"{name}={value!r} must be a power of two")
    return value


def check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite positive number")
    return float(value)


def checking_values() -> bool:
    """Value checks (which read device memory) run in eager mode, not while torch.compile traces
    nor while a CUDA graph is captured (a host read would break the capture); the kernels mask
    out-of-range destinations instead."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def index_vector(name: str, ids, length: int | None = None) -> torch.Tensor:
    """A 1-D integer tensor of page ids or slots, returned as contiguous int32."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got dtype {str(ids.dtype).removeprefix('torch.')}")
    if ids.dim() != 1 or (length is not None and ids.shape[0] != length):
        expected = "[N]" if length is None else f"[{length}] (one per token)"
        raise ValueError(f"{name} must have shape {expected}, got shape {tuple(ids.shape)}")
    if not ids.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(ids.stride())}")
    return ids.to(torch.int32)


def check_range(name: str, ids: torch.Tensor, bound: int, what: str) -> None:
    if not checking_values() or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= bound)
    if bool(bad.any()):
        raise ValueError(f"{name} must lie in [0, {bound}) ({what}), got {ids[bad][:8].tolist()}")


def check_distinct(name: str, *columns: torch.Tensor) -> None:
    """Reject two writes to one destination (a race on the GPU): the rows of the stacked
    `columns` (e.g. page ids and slots) must be distinct."""
    if not checking_values() or columns[0].numel() == 0:
        return
    stacked = torch.stack([c.to(torch.int64) for c in columns], dim=-1)
    unique, counts = torch.unique(stacked, dim=0, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name} must be distinct, got repeated {unique[counts > 1][:8].tolist()}")
