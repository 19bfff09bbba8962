"""OscarTorchCache (pools updated in place) and the custom ops behind it.

* A prompt prefilled through `attend` lands in its tiers with the format's bytes (identity
  rotation: bit-identical to shared_math; random rotation: attention over the pools read back
  through the tables matches the float64 reference), a decode step reads all three tiers, and
  `demote` turns the oldest recent page into an INT2 page of every layer.
* The mutating kernels are torch custom ops with fake implementations: `torch.library.opcheck`
  on each, FakeTensorMode shapes, and a function calling them under torch.compile(fullgraph=True)
  (aot_eager, and a cache decode step through inductor; on CPU the ops run the Triton
  interpreter inside the compiled graph) equals eager.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oscar_torch import ops
from oscar_torch.cache import OscarTorchCache, StepPlan
from oscar_torch.tests.util import DEVICE, to_numpy, to_torch
from parity_tests.cases import (
    ATTENTION_TOLERANCES,
    WRITE_CASES,
    assert_same_bits,
    bf16_bits,
    bf16_values,
)
from shared_math import codec as ref
from shared_math.attention import mixed_tier_decode_attention, softmax_attention
from shared_math.spec import OscarConfig
from shared_math.tiers import tier_split

F32 = np.float32
CONFIG = OscarConfig(head_dim=64, group_size=32, sink=32, recent=32, page_size=16)
LAYERS, KV, GQ = 2, 2, 2
PROMPT = 117  # 32 sink + 3 history pages + 37 recent
BF16_PAGES, INT2_PAGES = 12, 8


def _rotations(rng):
    q, _ = np.linalg.qr(rng.standard_normal((KV, CONFIG.head_dim, CONFIG.head_dim)))
    identity = np.broadcast_to(np.eye(CONFIG.head_dim, dtype=F32), (KV, CONFIG.head_dim, CONFIG.head_dim))
    return np.stack([identity, q.astype(F32)])  # layer 0: identity (exact bytes); layer 1: random


class Pages:
    """Sequential page bookkeeping of one sequence (the test's stand-in for an allocator)."""

    def __init__(self):
        self.sink = [1, 2]  # BF16 pages of the two sink pages
        self.recent = [3, 4, 5, 6]  # BF16 pages of the recent window, oldest first
        self.history = [1, 2, 3]  # INT2 pages
        self.free_int2 = [4, 5, 6, 7]

    def tables(self, length: int):
        split = tier_split(length, CONFIG)
        bf16 = self.sink + self.recent[: split.recent_pages]
        bf16 = bf16 + [0] * (2 + 4 + 1 - len(bf16))
        history = self.history[: split.history_pages] + [0] * (5 - split.history_pages)
        as_t = lambda a: torch.tensor(a, dtype=torch.int32, device=DEVICE)  # noqa: E731
        return split, dict(
            bf16_page_table=as_t([bf16]), history_page_table=as_t([history]),
            sink_tokens=as_t([split.sink_tokens]), recent_tokens=as_t([split.recent_tokens]),
            history_tokens=as_t([split.history_tokens]),
        )

    def destinations(self, positions, length):
        """(bf16 page, slot), (int2 page, slot) per position; the other tier gets an out-of-range
        page (no write)."""
        split = tier_split(length, CONFIG)
        page = CONFIG.page_size
        out = np.full((4, len(positions)), [[BF16_PAGES], [0], [INT2_PAGES], [0]], np.int32)
        for i, p in enumerate(positions):
            tier = split.tier_of(p)
            if tier == "sink":
                out[0, i], out[1, i] = self.sink[p // page], p % page
            elif tier == "recent":
                r = p - split.recent_start
                out[0, i], out[1, i] = self.recent[r // page], r % page
            else:
                h = p - split.history_start
                out[2, i], out[3, i] = self.history[h // page], h % page
        return [torch.tensor(row[None], device=DEVICE) for row in out]


def _plan(tables, destinations, new_tokens):
    return StepPlan(**tables, new_tokens=torch.tensor([new_tokens], dtype=torch.int32, device=DEVICE),
                    bf16_write_page=destinations[0], bf16_write_slot=destinations[1],
                    int2_write_page=destinations[2], int2_write_slot=destinations[3])


@pytest.fixture(scope="module")
def prefilled():
    """A 2-layer cache after prefilling one PROMPT-token sequence; returns what the tests need."""
    rng = np.random.default_rng(2025)
    rotations = _rotations(rng)
    cache = OscarTorchCache(CONFIG, num_layers=LAYERS, num_kv_heads=KV, num_bf16_pages=BF16_PAGES,
                            num_int2_pages=INT2_PAGES, k_rotation=to_torch(rotations), k_clip_ratio=[0.96, 0.9],
                            v_clip_ratio=[0.92, 0.92])
    pointers = [getattr(cache, n).data_ptr() for n in ("k_bf16", "k_codes", "v_scale")]
    pages = Pages()
    d = CONFIG.head_dim
    k = rng.standard_normal((LAYERS, PROMPT + 1, KV, d)).astype(F32)
    v = rng.standard_normal((LAYERS, PROMPT + 1, KV, d)).astype(F32)
    q = (3 * rng.standard_normal((LAYERS, PROMPT + 1, KV * GQ, d))).astype(F32)
    _, empty = pages.tables(0)
    plan = _plan(empty, pages.destinations(range(PROMPT), PROMPT), PROMPT)
    prefill_out = [
        cache.attend(layer, to_torch(q[layer, None, :PROMPT]), to_torch(k[layer, None, :PROMPT]),
                     to_torch(v[layer, None, :PROMPT]), plan, "prefill")
        for layer in range(LAYERS)
    ]
    assert pointers == [getattr(cache, n).data_ptr() for n in ("k_bf16", "k_codes", "v_scale")]
    return dict(cache=cache, pages=pages, k=k, v=v, q=q, rotations=rotations, prefill_out=prefill_out)


def _rotated(x, rotation):
    return np.einsum("tkd,kde->tke", x, rotation).astype(F32)


def test_create_zero_pools_with_the_format_layout():
    cache = OscarTorchCache(CONFIG, num_layers=3, num_kv_heads=2, num_bf16_pages=5, num_int2_pages=4,
                            k_rotation=torch.zeros((3, 2, 64, 64), device=DEVICE), k_clip_ratio=[0.96] * 3,
                            v_clip_ratio=torch.full((3,), 0.92))
    assert cache.k_bf16.shape == (3, 5, 2, 16, 64) and cache.k_bf16.dtype == torch.bfloat16
    assert cache.v_codes.shape == (3, 4, 2, 16, 16) and cache.v_codes.dtype == torch.uint8
    assert cache.k_min.shape == (3, 4, 2, 16, 2) and cache.k_min.dtype == torch.float16
    assert cache.nbytes() == 2 * (3 * 5 * 2 * 16 * 64 * 2 + 3 * 4 * 2 * 16 * (16 + 2 * 2 * 2))
    assert all(not t.any() for t in cache.layer_pools(1))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_layers=0), "num_layers=0 must be a positive integer"),
        (dict(k_rotation=torch.zeros((2, 2, 64, 64), dtype=torch.float64)), "k_rotation must have dtype float32"),
        (dict(k_rotation=torch.zeros((2, 3, 64, 64))), r"k_rotation must have shape \[2, 2, 64, 64\]"),
        (dict(k_clip_ratio=[0.9]), r"need one clip ratio per layer \(2\), got 1 and 2"),
        (dict(v_clip_ratio=[0.9, 1.5]), "clip_ratio=1.5"),
        (dict(config="d64"), "config must be an OscarConfig"),
    ],
)
def test_create_rejects_bad_arguments(kwargs, message):
    args = dict(config=CONFIG, num_layers=2, num_kv_heads=2, num_bf16_pages=4, num_int2_pages=4,
                k_rotation=torch.zeros((2, 2, 64, 64)), k_clip_ratio=[0.9, 0.9], v_clip_ratio=[0.9, 0.9])
    args.update(kwargs)
    config = args.pop("config")
    with pytest.raises(ValueError, match=message):
        OscarTorchCache(config, **args)


def test_create_refuses_per_channel_keys():
    """Format v2's per-channel key pages have their reference in shared_math; this cache stores v1."""
    v2 = dataclasses.replace(CONFIG, page_size=16, key_layout="channel")
    with pytest.raises(NotImplementedError, match="OscarTorchCache stores keys per token"):
        OscarTorchCache(v2, num_layers=1, num_kv_heads=2, num_bf16_pages=4, num_int2_pages=4,
                        k_rotation=torch.zeros((1, 2, 64, 64)), k_clip_ratio=[1.0], v_clip_ratio=[1.0])


def test_prefill_writes_every_tier_with_the_format_bytes(prefilled):
    cache, pages, k, v = prefilled["cache"], prefilled["pages"], prefilled["k"], prefilled["v"]
    split = tier_split(PROMPT, CONFIG)
    layer = 0  # identity rotation: k' = k exactly
    pools = [to_numpy(p) for p in cache.layer_pools(layer)]
    sink = slice(0, split.sink_tokens)
    hist = slice(split.history_start, split.recent_start)
    rec = slice(split.recent_start, PROMPT)
    page = CONFIG.page_size

    def gather(pool, ids, n):
        return np.concatenate([pool[i].transpose(1, 0, 2) for i in ids])[:n]  # [tokens, K, ·]

    assert_same_bits(gather(pools[0], pages.sink, split.sink_tokens), bf16_bits(k[layer, sink]), "sink K")
    assert_same_bits(gather(pools[1], pages.recent, split.recent_tokens), bf16_bits(v[layer, rec]), "recent V")
    for i, (name, rows, ratio) in enumerate((("K", k, cache.k_clip_ratio[layer]), ("V", v, cache.v_clip_ratio[layer]))):
        want = ref.encode(rows[layer, hist], group_size=CONFIG.group_size, clip_ratio=ratio, levels=CONFIG.levels)
        for j, array in enumerate(want):
            assert_same_bits(gather(pools[2 + 3 * i + j], pages.history, split.history_tokens), array,
                             f"history {name} {j}")
    assert split.history_pages == 3 and page * split.history_pages == split.history_tokens


def test_prefill_output_is_causal_full_precision_attention(prefilled):
    """An empty prefix: the chunk attends to itself in float32 over the rotated q and k."""
    for layer in range(LAYERS):
        rotation = prefilled["rotations"][layer]
        q = prefilled["q"][layer, :PROMPT].reshape(PROMPT, KV, GQ, -1)
        q_rot = np.einsum("tkgd,kde->tkge", q, rotation).reshape(PROMPT, KV * GQ, -1)
        k_rot = _rotated(prefilled["k"][layer, :PROMPT], rotation)
        v = prefilled["v"][layer, :PROMPT]
        want = np.stack([softmax_attention(q_rot[t], k_rot[: t + 1], v[: t + 1], softmax_scale=CONFIG.head_dim**-0.5)
                         for t in range(PROMPT)])
        got = prefilled["prefill_out"][layer][0].cpu().numpy()
        np.testing.assert_allclose(got, want, **ATTENTION_TOLERANCES["float32"])


def _read_back_tiers(cache, layer, pages, split):
    """The tiers of the sequence as stored in the pools (what decode attention must read)."""
    pools = [to_numpy(p) for p in cache.layer_pools(layer)]

    def gather(pool, ids, n):
        return np.concatenate([pool[i].transpose(1, 0, 2) for i in ids])[:n] if n else pool[0, :, :0].transpose(1, 0, 2)

    sink = tuple(bf16_values(gather(pools[i], pages.sink, split.sink_tokens)) for i in (0, 1))
    recent = tuple(bf16_values(gather(pools[i], pages.recent, split.recent_tokens)) for i in (0, 1))
    history = tuple(tuple(gather(pools[i], pages.history, split.history_tokens) for i in (s, s + 1, s + 2))
                    for s in (2, 5))
    return sink, history, recent


def test_decode_step_reads_all_tiers_and_demote_moves_the_oldest_recent_page(prefilled):
    cache, pages = prefilled["cache"], prefilled["pages"]
    length = PROMPT + 1
    split, tables = pages.tables(length)
    plan = _plan(tables, pages.destinations([PROMPT], length), 1)
    for layer in range(LAYERS):
        rotation = prefilled["rotations"][layer]
        q = prefilled["q"][layer, PROMPT : PROMPT + 1]
        out = cache.attend(layer, to_torch(q[None]), to_torch(prefilled["k"][layer, None, PROMPT : PROMPT + 1]),
                           to_torch(prefilled["v"][layer, None, PROMPT : PROMPT + 1]), plan, "decode")
        sink, history, recent = _read_back_tiers(cache, layer, pages, split)
        # The new token sits in the recent tier, as bf16(k·R).
        assert_same_bits(bf16_bits(recent[0][-1]), bf16_bits(_rotated(prefilled["k"][layer, PROMPT : PROMPT + 1],
                                                                       rotation)[0]), "new token")
        q_rot = np.einsum("kgd,kde->kge", q.reshape(KV, GQ, -1), rotation).reshape(KV * GQ, -1)
        want = mixed_tier_decode_attention(q_rot, sink=sink, history=history, recent=recent,
                                           group_size=CONFIG.group_size, softmax_scale=CONFIG.head_dim**-0.5)
        np.testing.assert_allclose(out[0, 0].cpu().numpy(), want, **ATTENTION_TOLERANCES["float32"])

    # Demote the oldest recent page into a fresh INT2 page, in every layer.
    src, dst = pages.recent[0], pages.free_int2[0]
    before = [to_numpy(cache.k_bf16[layer, src]) for layer in range(LAYERS)]
    cache.demote(torch.tensor([src], dtype=torch.int32, device=DEVICE),
                 torch.tensor([dst], dtype=torch.int32, device=DEVICE))
    for layer in range(LAYERS):
        want = ref.encode(bf16_values(before[layer]), group_size=CONFIG.group_size,
                          clip_ratio=cache.k_clip_ratio[layer], levels=CONFIG.levels)
        got = (cache.k_codes[layer, dst], cache.k_scale[layer, dst], cache.k_min[layer, dst])
        for a, e in zip(got, want):
            assert_same_bits(to_numpy(a), e, f"demoted layer {layer}")


def test_attend_rejects_bad_steps(prefilled):
    cache = prefilled["cache"]
    _, tables = prefilled["pages"].tables(PROMPT)
    dst = prefilled["pages"].destinations([0], PROMPT)
    plan = _plan(tables, dst, 1)
    q = torch.zeros((1, 1, KV * GQ, 64), device=DEVICE)
    kv = torch.zeros((1, 1, KV, 64), device=DEVICE)
    for args, message in [
        ((q, kv, kv, plan, "chunked"), "phase='chunked' must be one of"),
        ((q, kv, kv, dict(tables), "decode"), "plan must be a StepPlan"),
        ((q[..., :32].contiguous(), kv, kv, plan, "decode"), r"q must have shape \[\*, \*, \*, 64\]"),
        ((q[:, :, :3].contiguous(), kv, kv, plan, "decode"), "query heads Hq=3 must be a multiple"),
        ((q, kv[:, :, :1].contiguous(), kv, plan, "decode"), r"k must have shape \[1, 1, 2, 64\]"),
        ((q.expand(1, 2, -1, -1).contiguous(), kv.expand(1, 2, -1, -1).contiguous(),
          kv.expand(1, 2, -1, -1).contiguous(), plan, "decode"), "decode appends one token"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.attend(0, *args)
    with pytest.raises(ValueError, match="src_pages must have dtype int32"):
        cache.demote(torch.tensor([1]), torch.tensor([1], dtype=torch.int32))


# ------------------------------------------------------------------- custom ops and compile

CASE = WRITE_CASES[4]  # 77 tokens, 2 kv heads, D = 64, G = 16, 9 pages


def _step_inputs():
    rows = to_torch(CASE.rows())
    page_ids, slots = (to_torch(a) for a in CASE.destinations())
    src, dst = (to_torch(a) for a in CASE.demotions())
    bf16_pool = torch.zeros((CASE.num_pages, CASE.num_kv_heads, CASE.page_size, CASE.head_dim),
                            dtype=torch.bfloat16, device=DEVICE)
    int2 = tuple(to_torch(p) for p in CASE.int2_pools())
    return bf16_pool, int2, rows, page_ids, slots, src, dst


def _step(bf16_pool, codes, scale, minimum, rows, page_ids, slots, src, dst):
    """A small step through the public ops: BF16 write, INT2 write, demotion (all in place)."""
    ops.write_bf16_pages(bf16_pool, rows, page_ids, slots)
    ops.write_pages(codes, scale, minimum, rows * 2, page_ids, slots, group_size=CASE.group_size, clip_ratio=0.96)
    ops.demote_pages(bf16_pool, codes, scale, minimum, src, dst, group_size=CASE.group_size, clip_ratio=0.92,
                     levels="moments")
    return ops.decode(codes, scale, minimum, group_size=CASE.group_size)  # reads the pools back


def test_custom_ops_are_registered_with_their_mutations():
    schemas = {name: str(getattr(torch.ops.oscar, name).default._schema)
               for name in ("write_pages", "write_bf16_pages", "demote_pages", "encode", "bf16_tier_partials")}
    assert "Tensor(a0!) codes" in schemas["write_pages"] and "Tensor(a2!) minimum" in schemas["write_pages"]
    assert "Tensor(a0!) pool" in schemas["write_bf16_pages"]
    assert "Tensor(a1!) codes" in schemas["demote_pages"] and "bf16_pool" in schemas["demote_pages"]
    assert "!" not in schemas["encode"] and "!" not in schemas["bf16_tier_partials"]


def test_opcheck_of_the_mutating_ops():
    """torch.library.opcheck: schema (declared mutations only), fake tensors, autograd
    registration, and AOT dispatch, on real inputs."""
    bf16_pool, int2, rows, page_ids, slots, src, dst = _step_inputs()
    clip = 60  # clip index of c = 0.96 at D = 64
    torch.library.opcheck(torch.ops.oscar.write_bf16_pages.default, (bf16_pool, rows, page_ids, slots))
    torch.library.opcheck(torch.ops.oscar.write_pages.default,
                          (*int2, rows, page_ids, slots, None, CASE.group_size, clip, "minmax"))
    torch.library.opcheck(torch.ops.oscar.demote_pages.default,
                          (bf16_pool[None], *(p[None] for p in int2), src, dst, CASE.group_size, clip, "moments"))


def test_fake_implementations_give_output_shapes():
    with FakeTensorMode():
        x = torch.empty((5, 128))
        packed, scale, minimum = torch.ops.oscar.encode(x, 64, 120, "minmax")
        assert packed.shape == (5, 32) and packed.dtype == torch.uint8 and scale.shape == minimum.shape == (5, 2)
        assert torch.ops.oscar.decode(packed, scale, minimum, 64).shape == (5, 128)
        q = torch.empty((2, 3, 16, 128))
        o, lse = torch.ops.oscar.int2_tier_partials(
            q, torch.empty((4, 3, 16, 32), dtype=torch.uint8), *(torch.empty((4, 3, 16, 2), dtype=torch.float16),) * 2,
            torch.empty((4, 3, 16, 32), dtype=torch.uint8), *(torch.empty((4, 3, 16, 2), dtype=torch.float16),) * 2,
            torch.empty((2, 9), dtype=torch.int32), torch.empty((2,), dtype=torch.int32), 64, 0.1, 4, 2, 16)
        assert o.shape == (2, 3, 3, 16, 128) and lse.shape == (2, 3, 3, 16)


def test_step_runs_under_torch_compile_fullgraph_and_equals_eager():
    torch._dynamo.reset()
    eager_inputs = _step_inputs()
    compiled_inputs = tuple(
        tuple(t.clone() for t in x) if isinstance(x, tuple) else x.clone() for x in eager_inputs
    )

    def flat(inputs):
        bf16_pool, int2, rows, page_ids, slots, src, dst = inputs
        return (bf16_pool, *int2, rows, page_ids, slots, src, dst)

    eager = _step(*flat(eager_inputs))
    # aot_eager: dynamo capture + AOTAutograd functionalization of the in-place custom ops (the
    # parts a graph break or a missing mutation annotation would break), without inductor's C++
    # build; the cache test below goes through inductor.
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")(*flat(compiled_inputs))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0, equal_nan=True)  # sentinel bytes may be NaN
    for a, b in zip(flat(eager_inputs)[:4], flat(compiled_inputs)[:4]):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)


def _decode_step_inputs(prefilled):
    """(q, k, v, plan) of sequence 1's next token (position PROMPT) on the prefilled cache."""
    pages, length = prefilled["pages"], PROMPT + 1
    _, tables = pages.tables(length)
    plan = _plan(tables, pages.destinations([PROMPT], length), 1)
    q, k, v = (to_torch(prefilled[x][1, None, PROMPT : PROMPT + 1]) for x in ("q", "k", "v"))
    return q, k, v, plan


@pytest.mark.slow
def test_cache_decode_step_runs_under_torch_compile_fullgraph(prefilled):
    """One decode step of the cache (rotation, BF16 writes, split-K attention over both tiers,
    merge) as a single graph; the same pools and output as eager on a copy of the cache."""
    torch._dynamo.reset()
    cache, (q, k, v, plan) = prefilled["cache"], _decode_step_inputs(prefilled)
    saved = {n: getattr(cache, n).clone() for n in ("k_bf16", "v_bf16")}
    eager = cache.attend(1, q, k, v, plan, "decode")
    after_eager = {n: getattr(cache, n).clone() for n in saved}
    for n, t in saved.items():
        getattr(cache, n).copy_(t)
    compiled = torch.compile(cache.attend, fullgraph=True)(1, q, k, v, plan, "decode")
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for n, t in after_eager.items():  # the compiled step wrote the same bytes in place
        assert torch.equal(getattr(cache, n).view(torch.int16), t.view(torch.int16)), n


@pytest.mark.gpu
def test_cache_decode_step_replays_as_a_cuda_graph(prefilled):
    """A decode step (rotation, BF16 writes, both tiers' attention, merge) captured once in a CUDA
    graph and replayed: the same output and the same pool bytes as eager. The plan tensors are
    static; a serving loop refills them in place before each replay."""
    cache, (q, k, v, plan) = prefilled["cache"], _decode_step_inputs(prefilled)
    names = ("k_bf16", "v_bf16")
    saved = {n: getattr(cache, n).clone() for n in names}

    def restore():
        for n, t in saved.items():
            getattr(cache, n).copy_(t)

    eager = cache.attend(1, q, k, v, plan, "decode")
    after_eager = {n: getattr(cache, n).clone() for n in names}
    restore()
    side = torch.cuda.Stream()  # warm-up off the capture stream, as CUDA graphs require
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cache.attend(1, q, k, v, plan, "decode")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.attend(1, q, k, v, plan, "decode")
    restore()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    for n, t in after_eager.items():
        assert torch.equal(getattr(cache, n).view(torch.int16), t.view(torch.int16)), n
