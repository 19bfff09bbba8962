"""Opt-in register cap for Pallas kernels lowered through Triton — off by default.

`pl_triton.CompilerParams` takes num_warps and num_stages only: there is no public way
to give a Pallas kernel Triton's `maxnreg`. XLA compiles a Pallas kernel's Triton module with its
own pipeline and may hold more registers than the triton package would for the same module: the
decode INT2 tier with its tokens and channels on M holds 217 registers a thread as XLA compiles it
against 168 in the triton package's sm_90 compile of the same Triton IR, so 8 one-warp programs fit
an SM instead of 12. Capped at 160 (`shared_math.tiling.INT2_CHANNELS_ON_M_MAX_REGISTERS`), 12 fit
and the Pallas INT2 decode runs faster on large grids (benchmarks/DECISIONS.md D6).

The only way to set the cap is to replace a private JAX function, so the product does not do it
unless asked:

    OSCAR_JAX_REGISTER_CAP=1 python …            # or, in code, before the first compiled decode call:
    oscar_jax.kernels.register_cap.enable()

Opted in, `enable()` wraps `jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module` (the
Pallas → Triton module lowering) once, so that a module whose name ends in `_max_registers_<n>`
(`capped_name`) gets the Triton module attribute `ttg.maxnreg = n`, which Triton reads where it
lowers Triton GPU IR to LLVM (the kernel's PTX `.maxnreg`). Modules of other names are untouched and
outputs are bit-identical either way. Not opted in, nothing is patched: the decode's default cap is
0 (the compiler's choice) and an explicit `max_registers` > 0 for a compiled kernel is a ValueError
naming this switch. If JAX moves the private function or changes its signature, `enable()` raises
(and oscar_jax/tests/test_register_cap.py fails) instead of running uncapped in silence.
"""

from __future__ import annotations

import inspect
import os
import re

ENV_VAR = "OSCAR_JAX_REGISTER_CAP"  # "1": opt in (read at each compiled decode call)
MAX_REGISTERS_TAG = "_max_registers_"
# What the hook wraps: jax._src.pallas.triton.lowering.<LOWERING_FUNCTION>, with these parameters.
LOWERING_MODULE = "jax._src.pallas.triton.lowering"
LOWERING_FUNCTION = "lower_jaxpr_to_triton_module"
LOWERING_PARAMETERS = ("jaxpr", "grid_mapping", "platform", "compute_capability", "mlir_ctx")
_CAPPED = re.compile(re.escape(MAX_REGISTERS_TAG) + r"(\d+)$")
_enabled = False
_ORIGINAL = "_oscar_original"  # the wrapper's reference to the function it wraps


def opted_in() -> bool:
    """Whether the register cap is on: `enable()` was called or OSCAR_JAX_REGISTER_CAP=1."""
    return _enabled or os.environ.get(ENV_VAR, "") == "1"


def capped_name(name: str, max_registers: int) -> str:
    """`name` asking for at most `max_registers` registers a thread (0: the compiler's choice)."""
    return f"{name}{MAX_REGISTERS_TAG}{max_registers}" if max_registers else name


def requested_cap(module_name: str) -> int | None:
    """The cap a module's name asks for, or None."""
    match = _CAPPED.search(module_name)
    return int(match.group(1)) if match else None


def lowering_function():
    """JAX's private Pallas → Triton module lowering, checked against the signature the hook wraps;
    RuntimeError naming what moved otherwise."""
    try:
        import importlib

        lowering = importlib.import_module(LOWERING_MODULE)
        function = getattr(lowering, LOWERING_FUNCTION)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"oscar_jax's register cap wraps {LOWERING_MODULE}.{LOWERING_FUNCTION}, which this jax "
                           f"does not have ({e}); unset {ENV_VAR} to run uncapped") from e
    function = getattr(function, _ORIGINAL, function)  # the hook installed: what it wraps
    parameters = tuple(inspect.signature(function).parameters)
    if parameters != LOWERING_PARAMETERS:
        raise RuntimeError(f"oscar_jax's register cap wraps {LOWERING_MODULE}.{LOWERING_FUNCTION}{LOWERING_PARAMETERS}, "
                           f"but this jax's takes {parameters}; unset {ENV_VAR} to run uncapped")
    return lowering, function


def enable() -> None:
    """Opt in: wrap JAX's Pallas → Triton lowering once (idempotent) so that capped_name's kernels get
    `ttg.maxnreg`. RuntimeError where this jax's private lowering is not the one the hook knows."""
    global _enabled
    lowering, original = lowering_function()
    if getattr(getattr(lowering, LOWERING_FUNCTION), _ORIGINAL, None) is not None:  # installed before
        _enabled = True
        return
    from jax._src.lib.mlir import ir

    def lower_with_register_cap(*args, **kwargs):
        result = original(*args, **kwargs)
        attributes = result.module.operation.attributes
        if "sym_name" in attributes and (cap := requested_cap(ir.StringAttr(attributes["sym_name"]).value)):
            with result.module.context:
                attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), cap)
        return result

    setattr(lower_with_register_cap, _ORIGINAL, original)
    setattr(lowering, LOWERING_FUNCTION, lower_with_register_cap)
    _enabled = True


def require(max_registers: int) -> None:
    """A compiled kernel's cap: nothing for 0; for a cap, the hook installed where the user opted in,
    else a ValueError naming the switch."""
    if not max_registers:
        return
    if not opted_in():
        raise ValueError(f"max_registers={max_registers} caps a compiled Pallas kernel through a patch of JAX's "
                         f"private Triton lowering, which is off by default: set {ENV_VAR}=1 or call "
                         f"oscar_jax.kernels.register_cap.enable() to opt in, or pass max_registers=0")
    enable()
