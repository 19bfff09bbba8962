"""A register cap for Pallas kernels lowered through Triton, which `pl_triton.CompilerParams` cannot carry.

XLA compiles a Pallas kernel's Triton module with its own pipeline and ptxas, and may hold more
registers than the triton package would for the same module: the decode INT2 tier at 128K batch 8
held 217 registers a thread as XLA compiled it against 168 in the triton package's sm_90 compile of
the same Triton IR (so 8 one-warp programs an SM instead of 12; benchmarks/DECISIONS.md D6). Triton's
`maxnreg` option is a module attribute, `ttg.maxnreg`, read where Triton GPU IR is lowered to LLVM
(it becomes the kernel's PTX `.maxnreg`); Pallas builds the module but has no parameter for it.

A kernel asks for a cap through its name: `capped_name(name, n)` appends `_max_registers_<n>`, and
`install()` (idempotent) wraps jax's Pallas → Triton module lowering so that a module whose name
ends so gets `ttg.maxnreg = n`. Modules of other names are untouched. The hook reaches into jax's
private Pallas Triton lowering (jax 0.11); if that moves, `install()` warns once and kernels run
uncapped (same results, the compiler's register count) instead of failing.
"""

from __future__ import annotations

import re
import warnings

MAX_REGISTERS_TAG = "_max_registers_"
_CAPPED = re.compile(re.escape(MAX_REGISTERS_TAG) + r"(\d+)$")
_installed = False
_unavailable = False  # jax's hook was not found: said once, then every kernel runs uncapped quietly


def capped_name(name: str, max_registers: int) -> str:
    """`name` asking for at most `max_registers` registers a thread (0: the compiler's choice)."""
    return f"{name}{MAX_REGISTERS_TAG}{max_registers}" if max_registers else name


def requested_cap(module_name: str) -> int | None:
    """The cap a module's name asks for, or None."""
    match = _CAPPED.search(module_name)
    return int(match.group(1)) if match else None


def install() -> bool:
    """Wrap jax's Pallas → Triton lowering once; False (and one warning) where it cannot be."""
    global _installed, _unavailable
    if _installed or _unavailable:
        return _installed
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering
        original = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        _unavailable = True
        warnings.warn(f"oscar_jax: no register cap for Pallas kernels with this jax ({e}); they run uncapped",
                      RuntimeWarning, stacklevel=2)
        return False

    def lower_with_register_cap(*args, **kwargs):
        result = original(*args, **kwargs)
        attributes = result.module.operation.attributes
        if "sym_name" in attributes and (cap := requested_cap(ir.StringAttr(attributes["sym_name"]).value)):
            with result.module.context:
                attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), cap)
        return result

    lowering.lower_jaxpr_to_triton_module = lower_with_register_cap
    _installed = True
    return True
