"""The opt-in register cap of the Pallas INT2 decode kernel (`oscar_jax.kernels.register_cap`).

Pallas has no public way to give a kernel Triton's maxnreg, so the cap replaces a private JAX
function — only where a user opts in. These tests fail loudly when JAX moves that function, changes
its signature or its call site, or gains a public parameter (then the hook should go); they check
that nothing is patched and no kernel is capped by default, and that opted in the cap reaches the
INT2 kernel's Triton module and its sm_90 compile.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from oscar_jax.attention_ops import decode_attention
from oscar_jax.kernels import register_cap
from shared_math.tiling import INT2_CHANNELS_ON_M_MAX_REGISTERS


@pytest.fixture
def not_opted_in(monkeypatch):
    monkeypatch.delenv(register_cap.ENV_VAR, raising=False)
    monkeypatch.setattr(register_cap, "_enabled", False)


@pytest.fixture
def opted_in(monkeypatch):
    """The cap opted in by the environment for one test; JAX's lowering is restored after it."""
    from jax._src.pallas.triton import lowering

    monkeypatch.setattr(lowering, register_cap.LOWERING_FUNCTION, getattr(lowering, register_cap.LOWERING_FUNCTION))
    monkeypatch.setattr(register_cap, "_enabled", False)
    monkeypatch.setenv(register_cap.ENV_VAR, "1")


def test_jaxs_private_lowering_is_the_one_the_hook_wraps():
    """The function the opt-in hook replaces still exists with the parameters it passes through, the
    Pallas call still reaches it through its module (so the replacement takes effect), and
    CompilerParams still has no register cap of its own."""
    from jax._src.pallas.triton import lowering, pallas_call_registration
    from jax.experimental.pallas import triton as pl_triton

    function = getattr(lowering, register_cap.LOWERING_FUNCTION)
    function = getattr(function, "_oscar_original", function)
    assert tuple(inspect.signature(function).parameters) == register_cap.LOWERING_PARAMETERS
    assert register_cap.lowering_function()[1] is function
    assert f"lowering.{register_cap.LOWERING_FUNCTION}(" in inspect.getsource(pallas_call_registration)
    assert set(inspect.signature(pl_triton.CompilerParams).parameters) == {"num_warps", "num_stages"}, (
        "Pallas's Triton CompilerParams changed: if it takes a register cap now, pass it there and drop "
        "oscar_jax.kernels.register_cap")


def test_a_moved_lowering_fails_loudly(monkeypatch, opted_in):
    from jax._src.pallas.triton import lowering

    monkeypatch.delattr(lowering, register_cap.LOWERING_FUNCTION)
    with pytest.raises(RuntimeError, match="which this jax does not have"):
        register_cap.enable()
    monkeypatch.setattr(lowering, register_cap.LOWERING_FUNCTION, lambda jaxpr, grid_mapping: None, raising=False)
    with pytest.raises(RuntimeError, match=r"but this jax's takes \('jaxpr', 'grid_mapping'\)"):
        register_cap.enable()


def test_names_carry_the_cap():
    assert register_cap.requested_cap(register_cap.capped_name("oscar_int2_tier", 168)) == 168
    assert register_cap.capped_name("oscar_int2_tier", 0) == "oscar_int2_tier"
    assert register_cap.requested_cap("oscar_int2_tier_pages_per_block_2") is None


def _qwen3_decode_args():
    pytest.importorskip("triton")
    from benchmarks.static_analysis import qwen3_decode_case

    _, args = qwen3_decode_case(None)  # Qwen3-8B heads on a production-sized INT2 grid: tokens and channels on M
    return args


def _decode(max_registers=None):
    return lambda *a: decode_attention(*a, sink_slots=1, group_size=128, softmax_scale=128**-0.5, interpret=False,
                                       max_registers=max_registers)


def test_off_by_default_nothing_is_patched_and_a_cap_is_refused(not_opted_in, monkeypatch):
    """Not opted in: JAX's lowering is JAX's after a compiled decode is traced, the default launch is
    uncapped, and an explicit cap for a compiled kernel names the switch; interpreted, a cap is
    accepted and has no effect (as before)."""
    from jax._src.pallas.triton import lowering

    from oscar_jax import attention_ops

    args = _qwen3_decode_args()
    seen = []
    with monkeypatch.context() as spy:
        spy.setattr(attention_ops, "_decode_attention", lambda q, cache, launch, **kw: seen.append(launch))
        _decode()(*args)
    assert seen[0].channels_on_m and seen[0].max_registers == 0
    jax.make_jaxpr(_decode())(*args)  # traces the compiled decode's Pallas calls (no GPU needed to trace)
    assert not hasattr(getattr(lowering, register_cap.LOWERING_FUNCTION), "_oscar_original")
    with pytest.raises(ValueError, match=f"max_registers=160 caps .* {register_cap.ENV_VAR}=1"):
        jax.make_jaxpr(_decode(160))(*args)
    assert not register_cap.opted_in()


def test_opted_in_the_default_launch_takes_the_cap(opted_in, monkeypatch):
    from oscar_jax import attention_ops

    args = _qwen3_decode_args()
    seen = []
    monkeypatch.setattr(attention_ops, "_decode_attention", lambda q, cache, launch, **kw: seen.append(launch))
    _decode()(*args)
    _decode(0)(*args)
    assert [launch.max_registers for launch in seen] == [INT2_CHANNELS_ON_M_MAX_REGISTERS, 0]


@pytest.mark.parametrize("max_registers", [None, 0, 168, 128])
def test_register_cap_reaches_the_int2_kernels_triton_module(opted_in, max_registers):
    """Opted in, max_registers > 0 names the INT2 tier kernel `…_max_registers_<n>` and sets its Triton
    module's `ttg.maxnreg`, which the sm_90 compile obeys; 0 leaves both alone, and the other tiers'
    kernels never get it. None: shared_math.tiling.int2_decode_max_registers of the call's form (here
    tokens and channels on M: INT2_CHANNELS_ON_M_MAX_REGISTERS)."""
    from benchmarks.static_analysis import compile_triton_ir, pallas_triton_kernels, resource_usage

    args = _qwen3_decode_args()
    cap = INT2_CHANNELS_ON_M_MAX_REGISTERS if max_registers is None else max_registers
    kernels = {name: (text, warps, stages)
               for name, text, warps, stages in pallas_triton_kernels(_decode(max_registers), *args)}
    int2 = next(name for name in kernels if name.startswith("oscar_int2"))
    assert int2.endswith(f"_max_registers_{cap}") == bool(cap), int2
    for name, (text, warps, stages) in kernels.items():
        capped = name == int2 and cap
        assert (f"ttg.maxnreg = {cap} : i32" in text) == bool(capped), name
        assert ("ttg.maxnreg" in text) == bool(capped), name
    text, warps, stages = kernels[int2]
    usage = resource_usage(compile_triton_ir(text, warps, stages).asm["cubin"])
    assert usage["registers"] <= (cap or 255), usage


def test_interpreted_caps_have_no_effect(not_opted_in):
    """Interpret mode takes a valid cap (and names a bad one) without the opt-in: it compiles nothing."""
    from oscar_jax.kernels.decode_attention import int2_tier_partials

    q = jnp.zeros((1, 1, 16, 64), jnp.float32)
    codes, meta = jnp.zeros((1, 1, 16, 16), jnp.uint8), jnp.zeros((1, 1, 16, 1), jnp.float16)
    table, history = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32)
    common = dict(group_size=64, softmax_scale=0.125, pages_per_split=1, pages_per_block=1, block_m=16, interpret=True)
    o, lse = int2_tier_partials(q, codes, meta, meta, codes, meta, meta, table, history, max_registers=160, **common)
    assert bool(jnp.all(o == 0)) and bool(jnp.all(jnp.isneginf(lse)))
    with pytest.raises(ValueError, match="max_registers=16 must be 0"):
        int2_tier_partials(q, codes, meta, meta, codes, meta, meta, table, history, max_registers=16, **common)
