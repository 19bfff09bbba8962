"""Static analysis of the decode kernels for the H200 (sm_90), on a machine without a GPU.

The Pallas kernels are lowered with jax's AOT path for an abstract H200 and their Triton IR is
compiled to a cubin by the triton package's own sm_90 pipeline (ptxas ships with it); the torch
Triton kernels are compiled from source. `cuobjdump` (also in the triton package) then gives the
registers, the spilled bytes and the SASS. The instruction count of the page loop per warp,
× warps ÷ tokens per iteration, is the per-(token, KV head) count Nsight Compute measured on the
H200 (61 static vs 63 measured for the v3 Pallas kernel: benchmarks/NOTES.md), so it predicts
an instruction-bound kernel's time without a GPU run.

    python -m benchmarks.static_analysis            # the Pallas INT2 kernel over num_warps 1, 2, 4
    python -m benchmarks.static_analysis --sass DIR  # also keep .ttir / .ttgir / .ptx / .sass there
    python -m benchmarks.static_analysis --encode    # the codec's encode kernels, by planes or not
    python -m benchmarks.static_analysis --compile-times  # seconds from Triton IR to cubin per decode kernel
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import tempfile
import time
import warnings

from shared_math.tiling import base2_score_scale

H200 = dict(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
H200_ARCH = 90


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _run_cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([_cuobjdump(), flag, path], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """{"registers", "spills"} of a cubin; spilled registers live in STACK:, local arrays in LOCAL:."""
    words = _run_cuobjdump(cubin, "--dump-resource-usage").split()
    value = lambda key: sum(int(w.split(":")[1]) for w in words if w.startswith(key))  # noqa: E731
    return {"registers": value("REG:"), "spills": value("STACK:") + value("LOCAL:")}


def async_copies(ttgir: str) -> int:
    """Loads a Triton kernel's software pipeliner issued ahead (cp.async), from its TTGIR."""
    return ttgir.count("async_copy_global_to_local")


def sass(cubin: bytes) -> str:
    return _run_cuobjdump(cubin, "-sass")


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA(?:\.U)?\s+0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def loop_profile(sass_text: str) -> dict:
    """The page loop of a kernel: of its loops (spans of backward branches), the longest that
    issues async copies (the software-pipelined one: the Triton INT2 kernel also has a masked,
    unpipelined copy of the page body for a partial page, NOTES v19), else the longest. Instruction count and the count per opcode
    (modifiers dropped: `LOP3.LUT` → `LOP3`)."""
    instructions = [(int(a, 16), text) for a, text in _INSTRUCTION.findall(sass_text)]
    loops = [(int(m.group(1), 16), address) for address, text in instructions
             if (m := _BRANCH.search(text)) and int(m.group(1), 16) < address]
    if not loops:
        raise ValueError("no backward branch in the SASS: the kernel has no loop")

    def pipelined(span):
        return any("LDGSTS" in text for address, text in instructions if span[0] <= address <= span[1])

    start, end = max(loops, key=lambda span: (pipelined(span), span[1] - span[0]))
    body = [_PREDICATE.sub("", text) for address, text in instructions if start <= address <= end]
    opcodes = collections.Counter(text.split()[0].split(".")[0] for text in body)
    return {"instructions": len(body), "opcodes": dict(opcodes.most_common())}


# The ALU pipe's opcodes on sm_90 (integer and logic work, compares, selects, min/max, shuffles of
# bits): Nsight Compute found the write's encode bound by this pipe (benchmarks/NOTES.md v9–v10),
# which issues half a warp instruction a cycle per scheduler. IMAD / VIADD / float arithmetic
# issue on the FMA pipes.
ALU_OPCODES = frozenset({"ISETP", "SEL", "VIMNMX", "VIMNMX3", "VIADDMNMX", "LOP3", "SHF", "FSETP", "FSEL", "FMNMX",
                         "PRMT", "IADD3", "LEA", "SGXT", "POPC", "FLO", "BMSK", "PLOP3", "P2R", "R2P", "IABS"})


def shortest_path_profile(sass_text: str) -> dict:
    """The shortest way from a kernel's entry to an EXIT, following forward branches both ways
    (taken or not; backward branches are not followed: the kernels this is for unroll their
    loops): what a program runs when it skips every optional region, e.g. the encode's fallback to
    encode_block, wherever ptxas placed it (after the first EXIT for a Triton `if`, jumped over for
    Pallas's `lax.cond`; NOTES v23). Count, ALU-pipe count, count per opcode, and `loops`: back
    edges on the path (each loop's body counted once: the count is then a lower bound)."""
    instructions = [(int(address, 16), text.strip()) for address, text in _INSTRUCTION.findall(sass_text)]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    # cost[i]: instructions from i to an EXIT along the shortest way (i included); filled backwards.
    inf = float("inf")
    cost, step = [inf] * (len(instructions) + 1), [None] * len(instructions)
    for i in range(len(instructions) - 1, -1, -1):
        text = instructions[i][1]
        predicated = text.startswith("@")
        opcode = _PREDICATE.sub("", text).split()[0]
        ways = []
        if opcode == "EXIT":
            ways.append((0, None))
        if opcode.startswith("BRA") and (m := _BRANCH.search(text)) and int(m.group(1), 16) > instructions[i][0]:
            target = index.get(int(m.group(1), 16))
            if target is not None:
                ways.append((cost[target], target))
        # Fall through unless unconditional; BRA.DIV leaves only a diverged warp (its target).
        if predicated or opcode.startswith("BRA.DIV") or not (opcode == "EXIT" or opcode.startswith("BRA")):
            ways.append((cost[i + 1], i + 1))
        best = min(ways, key=lambda way: way[0], default=(inf, None))  # none: a backward jump
        cost[i], step[i] = 1 + best[0], best[1]
    if cost[0] == inf:
        raise ValueError("no way from the entry to an EXIT in the SASS")
    body, i, loops = [], 0, 0
    while i is not None:
        text = instructions[i][1]
        body.append(_PREDICATE.sub("", text))
        if (m := _BRANCH.search(text)) and int(m.group(1), 16) < instructions[i][0]:
            loops += 1  # a loop's back edge on the path: its body is counted once, not per iteration
        i = step[i]
    opcodes = collections.Counter(text.split()[0].split(".")[0] for text in body)
    return {"instructions": len(body), "alu": sum(n for op, n in opcodes.items() if op in ALU_OPCODES),
            "loops": loops, "opcodes": dict(opcodes.most_common())}


def _visit_triton_calls(fn, args, visit) -> None:
    """Lower jax.jit(fn)(*args) for an H200 and call visit(backend_config) on the MLIR DictAttr of
    every Pallas Triton kernel in it, in program order, while the lowered module is alive."""
    import jax
    from jax._src.lib.mlir import ir as jax_ir

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(**H200))
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    attributes = child.operation.attributes
                    if child.operation.name == "stablehlo.custom_call" and "triton" in str(
                            attributes["call_target_name"]):
                        visit(jax_ir.DictAttr(attributes["mhlo.backend_config"]))
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)


def triton_backend_configs(fn, *args) -> list[str]:
    """The backend config of every Pallas Triton kernel in jax.jit(fn)(*args) lowered for an H200,
    as text: what XLA keys its kernel cache by (the serialized kernel IR, its name, launch and grid)."""
    configs = []
    _visit_triton_calls(fn, args, lambda config: configs.append(str(config)))
    return configs


def pallas_triton_kernels(fn, *args) -> list[tuple[str, str, int, int]]:
    """Lower jax.jit(fn)(*args) for an H200: (name, Triton IR text, num_warps, num_stages) of
    every Pallas kernel in it."""
    from jax._src.lib.mlir import ir as jax_ir
    from jax._src.pallas.triton import lowering as triton_lowering

    kernels = []

    def visit(config):
        with triton_lowering._new_ir_context():
            text = jax_ir.Module.parse(jax_ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
        kernels.append((jax_ir.StringAttr(config["name"]).value, text,
                        jax_ir.IntegerAttr(config["num_warps"]).value,
                        jax_ir.IntegerAttr(config["num_stages"]).value))

    _visit_triton_calls(fn, args, visit)
    return kernels


def compile_triton_ir(text: str, num_warps: int, num_stages: int):
    """Compile Triton IR text for sm_90; returns triton's CompiledKernel (asm: ttgir, ptx, cubin).

    `triton.compile` of an IR file starts *after* that file's stage, so it would skip make_ttir
    (inliner, canonicalizer, combine: e.g. `a + dot(q, k)` → `dot(q, k, acc=a)`). XLA's pipeline
    for Pallas kernels runs those passes (xla/backends/gpu/codegen/triton/compilation_pipeline_cuda.cc,
    "Based on make_ttir()"), so they are run here first, as on the H200."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", H200_ARCH, 32)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    backend = CUDABackend(target)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(text)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = ir.parse_mlir_module(path, context)
        module.context = context  # as triton.compile sets it
        module = backend.make_ttir(module, {}, backend.parse_options(options), H200_ARCH)
        with open(path, "w") as f:
            f.write(str(module))
        return triton.compile(path, target=target, options=options)


def compile_pallas_for_h200(fn, *args) -> dict[str, dict]:
    """{kernel name: {"registers", "spills", "shared", "compiled", "compile_s"}} for every Pallas kernel
    of fn; compile_s: this machine's seconds from Triton IR to cubin."""
    results = {}
    for name, text, num_warps, num_stages in pallas_triton_kernels(fn, *args):
        started = time.perf_counter()
        compiled = compile_triton_ir(text, num_warps, num_stages)
        results[name] = {**resource_usage(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
                         "num_warps": num_warps, "compiled": compiled, "compile_s": time.perf_counter() - started}
    return results


# The torch backend's Triton kernels, compiled from source: pointer element types by argument name
# (bfloat16 tensors are passed as int16 views) and the constexprs of the Qwen3-8B decode shapes.
TRITON_POINTERS = {
    "page_table_ptr": "*i32", "history_tokens_ptr": "*i32", "sink_tokens_ptr": "*i32", "recent_tokens_ptr": "*i32",
    "q_ptr": "*i16", "k_ptr": "*i16", "v_ptr": "*i16", "k_codes_ptr": "*u8", "v_codes_ptr": "*u8",
    "k_scale_ptr": "*fp16", "k_min_ptr": "*fp16", "v_scale_ptr": "*fp16", "v_min_ptr": "*fp16",
    "o_ptr": "*fp32", "lse_ptr": "*fp32", "table_slots": "i32",
    "o_a_ptr": "*fp32", "lse_a_ptr": "*fp32", "o_b_ptr": "*fp32", "lse_b_ptr": "*fp32", "out_ptr": "*fp32",
}
# Q_ROWS: the unpadded GQA group of 4 the decode op passes (the partials' ROWS are padded).
TRITON_QWEN3_8B = dict(NUM_HEADS=8, ROWS=16, Q_ROWS=4, D=128, PAGE_SIZE=64, PAGES_PER_SPLIT=16, NUM_SPLITS=4,
                       SCORE_SCALE=base2_score_scale(128**-0.5), BLOCK_M=16, TENSOR_CORES=True, GROUP_SIZE=128,
                       PAGES_PER_BLOCK=1, Q_BF16=True, SINK_SLOTS=1)
# The decode INT2 tier as oscar_torch.attention_ops launches it (scores with tokens on M, 8 rows).
TRITON_QWEN3_8B_DECODE_INT2 = dict(TRITON_QWEN3_8B, ROWS=8, BLOCK_M=8, TOKENS_ON_M=True)


def compile_triton_source(kernel, constants: dict, num_warps: int, num_stages: int, pointers: dict | None = None):
    """Compile a `triton.jit` kernel with `constants` (its constexprs; the other arguments typed by
    TRITON_POINTERS) for sm_90. Needs the real Triton (not TRITON_INTERPRET=1).

    Every pointer and integer argument is marked 16-divisible, as Triton's launcher specialises
    them at run time (torch allocations are 256-byte aligned; the table length is a multiple of
    16 at the benchmarked contexts). Without it the loads look unaligned, the loop is not
    software-pipelined and the kernel compiled here is not the one that runs (166 registers and
    no async copies against 95 registers and 10: benchmarks/NOTES.md v5)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    types = {**TRITON_POINTERS, **(pointers or {})}  # `pointers`: a kernel's own argument types
    signature = {name: types.get(name, "constexpr") for name in names}
    constexprs = {(names.index(name),): value for name, value in constants.items() if name in names}
    missing = [n for n, t in signature.items() if t == "constexpr" and (names.index(n),) not in constexprs
               and inspect.signature(kernel.fn).parameters[n].default is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"no value for the constexpr arguments {missing}")
    aligned = {(names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind != "constexpr"}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned),
                          target=GPUTarget("cuda", H200_ARCH, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def triton_kernel_usage(kernel, constants: dict, num_warps: int, num_stages: int, *, loop: bool = False,
                        pointers: dict | None = None, shortest_path: bool = False) -> dict:
    """{"registers", "spills", "shared", "async_copies"} of a compiled Triton kernel (async copies:
    the loads its software pipeliner issued ahead), plus its loop / shortest path profile if asked."""
    compiled = compile_triton_source(kernel, constants, num_warps, num_stages, pointers)
    usage = {**resource_usage(compiled.asm["cubin"]), "shared": compiled.metadata.shared,
             "async_copies": async_copies(compiled.asm["ttgir"])}
    if loop:
        usage["loop"] = loop_profile(sass(compiled.asm["cubin"]))
    if shortest_path:
        usage["shortest_path"] = shortest_path_profile(sass(compiled.asm["cubin"]))
    return usage


def qwen3_decode_case(num_warps: int | None, pages_per_block: int = 1, unpack_asm: bool = False,
                      channels_on_m: bool = False):
    """(fn, args) of the production decode call at Qwen3-8B head shapes (d 128, G 128, GQA 4,
    pages of 64, bf16 queries) over a small random cache (the kernels do not depend on its size);
    num_warps None: each tier's default launch; channels_on_m: the INT2 tier's values dot
    transposed (NOTES v26)."""
    import jax.numpy as jnp
    import numpy as np

    from oscar_jax.attention_ops import decode_attention

    from shared_math.tiling import decode_pages_per_split, int2_decode_tokens_on_m

    batch, kv_heads, d, page = 2, 2, 128, 64
    # The history table holds enough slots for a production-sized INT2 grid: its layout and launch
    # depend on the program count (shared_math.tiling.int2_decode_tokens_on_m), nothing else does.
    history_slots, bf16_slots, pool_pages = 512, 6, 130
    assert int2_decode_tokens_on_m(batch, kv_heads, history_slots,
                                   decode_pages_per_split(history_slots, 1, page, batch * kv_heads), page)
    rng = np.random.default_rng(0)
    arrays = (
        jnp.zeros((pool_pages, kv_heads, page, d), jnp.bfloat16),  # k_bf16
        jnp.zeros((pool_pages, kv_heads, page, d), jnp.bfloat16),  # v_bf16
        jnp.asarray(rng.integers(0, 256, (pool_pages, kv_heads, page, d // 4), dtype=np.uint8)),
        jnp.ones((pool_pages, kv_heads, page, 1), jnp.float16), jnp.zeros((pool_pages, kv_heads, page, 1), jnp.float16),
        jnp.asarray(rng.integers(0, 256, (pool_pages, kv_heads, page, d // 4), dtype=np.uint8)),
        jnp.ones((pool_pages, kv_heads, page, 1), jnp.float16), jnp.zeros((pool_pages, kv_heads, page, 1), jnp.float16),
        jnp.ones((batch, bf16_slots), jnp.int32), jnp.full((batch,), 64, jnp.int32), jnp.full((batch,), 300, jnp.int32),
        jnp.ones((batch, history_slots), jnp.int32), jnp.full((batch,), 4000, jnp.int32),
    )
    q = jnp.zeros((batch, 4 * kv_heads, d), jnp.bfloat16)

    def fn(q, *cache):
        return decode_attention(q, *cache, sink_slots=1, group_size=128, softmax_scale=d**-0.5, interpret=False,
                                num_warps=num_warps, pages_per_block=pages_per_block, unpack_asm=unpack_asm,
                                channels_on_m=channels_on_m)

    return fn, (q, *arrays)


ENCODE_POINTERS = {"packed_ptr": "*u8", "scale_ptr": "*fp16", "minimum_ptr": "*fp16", "num_rows": "i32"}


def _pallas_path_usage(fn, *args) -> dict:
    """compile_pallas_for_h200 of a one-kernel fn, with the kernel's shortest path in place of the cubin."""
    (usage,) = compile_pallas_for_h200(fn, *args).values()
    usage["shortest_path"] = shortest_path_profile(sass(usage.pop("compiled").asm["cubin"]))
    return usage


def _per_element(usage: dict, rows: int, head_dim: int, num_warps: int) -> dict:
    """A kernel's registers, spills and shortest path per element of its [rows, head_dim] block."""
    elements_per_thread = rows * head_dim / (num_warps * 32)
    path = usage["shortest_path"]
    return dict(registers=usage["registers"], spills=usage["spills"], loops=path["loops"],
                instructions_per_element=path["instructions"] / elements_per_thread,
                alu_per_element=path["alu"] / elements_per_thread)


def encode_table(clip_indices=(122, 117), block_rows=(16, 32, 64), num_warps: int = 4) -> list[dict]:
    """The codec's encode kernels for sm_90 at d 128 (G 128, minmax), both backends: encode_block at
    its shipped 16 rows and encode by planes at each of `block_rows` (NOTES v23). Per element, the
    instructions and ALU-pipe instructions of the shortest path (a block that takes its common case:
    no fallback, no ties)."""
    import functools

    import jax
    import jax.numpy as jnp

    from oscar_jax.kernels import codec as jax_codec
    from shared_math.tiling import select_order_statistic

    rows_of = {"bfloat16": True, "float32": False}
    table = []
    for dtype, k in itertools.product(rows_of, clip_indices):
        for planes, rows in [(False, 16)] + [(True, r) for r in block_rows]:
            fn = functools.partial(jax_codec.encode_rows, group_size=128, clip_index=k, levels="minmax",
                                   block_rows=rows, planes=planes, interpret=False, num_warps=num_warps)
            found = [("pallas", _pallas_path_usage(fn, jax.ShapeDtypeStruct((4096, 128), getattr(jnp, dtype))))]
            if os.environ.get("TRITON_INTERPRET") != "1":
                from oscar_torch.kernels import codec as torch_codec

                constants = dict(D=128, GROUP_SIZE=128, CLIP_INDEX=k, LEVELS="minmax", INPUT_BF16=rows_of[dtype],
                                 ORDER_STATISTIC=select_order_statistic(128, k, rows_bf16=rows_of[dtype]),
                                 BLOCK_ROWS=rows, PLANES=planes)
                pointers = dict(ENCODE_POINTERS, x_ptr="*i16" if rows_of[dtype] else "*fp32")
                found.append(("triton", triton_kernel_usage(torch_codec._encode_kernel, constants, num_warps, 1,
                                                            pointers=pointers, shortest_path=True)))
            table += [dict(backend=backend, rows_dtype=dtype, clip_index=k, planes=planes, block_rows=rows,
                           **_per_element(usage, rows, 128, num_warps)) for backend, usage in found]
    return table


WRITE_POINTERS = {"rotation_ptr": "*i16", "page_ids_ptr": "*i32", "slots_ptr": "*i32", "codes_ptr": "*u8",
                  "scale_ptr": "*fp16", "minimum_ptr": "*fp16", "num_tokens": "i32", "num_pages": "i32",
                  "x_ptr": "*i16", "src_pages_ptr": "*i32", "dst_pages_ptr": "*i32", "bf16_ptr": "*i16",
                  "src_pool_pages": "i32", "dst_pool_pages": "i32"}


def write_table(clip_index: int = 117, block_tokens=(16, 32), num_warps: int = 4, rotated: bool = False) -> list[dict]:
    """The unrotated page write (bf16 rows) and the demotion (pages of 64) for sm_90, planes off /
    on, as encode_table: per element along the shortest path (NOTES v23). rotated: the page write
    of bf16 rows rotated in the kernel (the keys' prefill write; planes: the split rotation plane by
    plane, NOTES v25) instead, and no demotion."""
    import functools

    import jax
    import jax.numpy as jnp

    from oscar_jax.kernels import write as jax_write
    from shared_math.tiling import select_order_statistic

    heads, page, d = 8, 64, 128
    pools = [jax.ShapeDtypeStruct((16, heads, page, w), t) for w, t in ((d // 4, jnp.uint8), (1, jnp.float16),
                                                                       (1, jnp.float16))]
    kw = dict(group_size=d, clip_index=clip_index, levels="minmax", interpret=False, num_warps=num_warps)
    cases = [("write_pages", planes, rows) for planes in (False, True) for rows in block_tokens]
    cases += [] if rotated else [("demote_pages", planes, page) for planes in (False, True)]
    rotation = jax.ShapeDtypeStruct((heads, d, d), jnp.float32) if rotated else None
    table = []
    for kernel, planes, rows in cases:
        if kernel == "write_pages":
            fn = functools.partial(jax_write.write_pages_rows, block_tokens=rows, planes=planes, **kw)
            args = (*pools, jax.ShapeDtypeStruct((256, heads, d), jnp.bfloat16),
                    jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.int32), rotation)
        else:
            fn = functools.partial(jax_write.demote_pages_rows, planes=planes, **kw)
            args = (jax.ShapeDtypeStruct((2, 16, heads, page, d), jnp.bfloat16),
                    *[jax.ShapeDtypeStruct((2,) + p.shape, p.dtype) for p in pools],
                    jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
        found = [("pallas", _pallas_path_usage(fn, *args))]
        if os.environ.get("TRITON_INTERPRET") != "1":
            from oscar_torch.kernels import write as torch_write

            constants = dict(NUM_HEADS=heads, PAGE_SIZE=page, D=d, GROUP_SIZE=d, CLIP_INDEX=clip_index,
                             LEVELS="minmax", PLANES=planes,
                             ORDER_STATISTIC=select_order_statistic(d, clip_index, rows_bf16=not rotated))
            if kernel == "write_pages":
                constants.update(ROTATE=rotated, INPUT_BF16=True, BLOCK_TOKENS=rows, TENSOR_CORES=True,
                                 ROTATION_ROWS=rows)
            found.append(("triton", triton_kernel_usage(getattr(torch_write, f"_{kernel}_kernel"), constants,
                                                        num_warps, 1, pointers=WRITE_POINTERS, shortest_path=True)))
        table += [dict(backend=backend, kernel=kernel, planes=planes, block_rows=rows, clip_index=clip_index,
                       **_per_element(usage, rows, d, num_warps)) for backend, usage in found]
    return table


def _print_table(rows: list[dict], first: str, columns: str) -> None:
    print(f"| backend | {columns} | encode | rows a program | registers | spills | instructions / element "
          "| ALU-pipe / element | loops on the path |")
    print("|---" * 10 + "|")
    for r in rows:
        print(f"| {r['backend']} | {r[first]} | {r['clip_index']} | {'planes' if r['planes'] else 'encode_block'} "
              f"| {r['block_rows']} | {r['registers']} | {r['spills']} | {r['instructions_per_element']:.1f} "
              f"| {r['alu_per_element']:.1f} | {r['loops']} |", flush=True)


def _print_encode_tables() -> None:
    _print_table(encode_table(), "rows_dtype", "rows | k")
    print()
    _print_table(write_table(), "kernel", "kernel (bf16 rows, unrotated) | k")
    print()
    _print_table(write_table(clip_index=122, block_tokens=(32, 64), rotated=True), "kernel",
                 "kernel (bf16 rows, rotated) | k")


def _flat(case):
    fn, call_args = case
    return (fn, *call_args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-warps", default="default,2",
                        help="comma-separated num_warps to compile; 'default': each tier's default launch")
    parser.add_argument("--unpack", default="jnp,asm", help="comma-separated: jnp (default kernel), asm (unpack_asm)")
    parser.add_argument("--sass", default=None, help="directory to keep the IR, PTX and SASS in")
    parser.add_argument("--encode", action="store_true", help="the codec's encode kernels instead (NOTES v23)")
    parser.add_argument("--compile-times", action="store_true",
                        help="the seconds each default decode kernel takes from Triton IR to cubin on this machine")
    parser.add_argument("--channels-on-m", action="store_true",
                        help="the INT2 kernels with the values' dot transposed (channels_on_m, NOTES v26)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.encode:
        _print_encode_tables()
        return
    if args.compile_times:
        for name, usage in compile_pallas_for_h200(*_flat(qwen3_decode_case(None))).items():
            print(f"{usage['compile_s']:6.2f} s  {name}")
        return
    page = 64
    print("| kernel | unpack | warps | registers | spill B | SASS per loop iteration per warp "
          "| warp-instr per (token, head) |")
    print("|---|---|---|---|---|---|---|")
    top = {}
    warps = [None if w == "default" else int(w) for w in args.num_warps.split(",")]
    variants = [(u, w) for u in args.unpack.split(",") for w in warps]
    for unpack, requested_warps in variants:
        fn, call_args = qwen3_decode_case(requested_warps, unpack_asm=unpack == "asm",
                                          channels_on_m=args.channels_on_m)
        for name, usage in compile_pallas_for_h200(fn, *call_args).items():
            kind = name.split("_tier")[0]
            if kind == "oscar_merge" or (kind == "oscar_bf16" and unpack == "asm"):
                continue  # the merge has no page loop; the BF16 tier has no codes (the same kernel as with jnp)
            compiled, num_warps = usage["compiled"], usage["num_warps"]
            text = sass(compiled.asm["cubin"])
            loop = loop_profile(text)
            per_token = loop["instructions"] * num_warps / page
            print(f"| {kind} | {unpack if kind == 'oscar_int2' else '—'} | {num_warps} | {usage['registers']} "
                  f"| {usage['spills']} | {loop['instructions']} | {per_token:.0f} |")
            top[(kind, unpack, num_warps)] = list(loop["opcodes"].items())[:12]
            if args.sass:
                os.makedirs(args.sass, exist_ok=True)
                stem = os.path.join(args.sass, f"{kind}_{unpack}_w{num_warps}")
                for ext, key in (("ttgir", "ttgir"), ("ptx", "ptx")):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(compiled.asm[key])
                with open(f"{stem}.sass", "w") as f:
                    f.write(text)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the torch backend's kernel, compiled from source
        from oscar_torch.kernels.decode_attention import int2_tier as torch_kernels

        from shared_math.tiling import DECODE_NUM_STAGES, INT2_DECODE_NUM_WARPS

        for unpack in args.unpack.split(","):
            for num_warps in (INT2_DECODE_NUM_WARPS if w is None else w for w in warps):
                constants = dict(TRITON_QWEN3_8B_DECODE_INT2, UNPACK_ASM=unpack == "asm",
                                 **({"CHANNELS_ON_M": True} if args.channels_on_m else {}))
                usage = triton_kernel_usage(torch_kernels._int2_tier_kernel, constants, num_warps, DECODE_NUM_STAGES,
                                            loop=True)
                loop = usage["loop"]
                print(f"| torch int2 (Triton) | {unpack} | {num_warps} | {usage['registers']} | {usage['spills']} "
                      f"| {loop['instructions']} | {loop['instructions'] * num_warps / page:.0f} |")
                top[("torch_int2", unpack, num_warps)] = list(loop["opcodes"].items())[:12]
    print()
    for (kind, unpack, num_warps), ops in top.items():
        print(f"{kind} {unpack} {num_warps} warps, loop opcodes: " + ", ".join(f"{op} {n}" for op, n in ops))


if __name__ == "__main__":
    main()
