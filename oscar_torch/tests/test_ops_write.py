"""Write path of oscar_torch.ops against shared_math: fused rotate + encode, page scatters, demotion.

Every written row must have exactly the bytes of shared_math.encode of the same float32 row, land
exactly at its (page, slot), and leave the rest of the pools untouched (the pools start as random
sentinel bytes). The pools are updated in place. Cases: parity_tests.cases.WRITE_CASES. The write
kernels' rotation operand and encode by planes, both backends: parity_tests/test_ops_write.py.
"""

import numpy as np
import pytest
import torch

from oscar_torch import library, ops
from oscar_torch.tests.util import DEVICE, ON_GPU, to_numpy, to_torch
from parity_tests.cases import (
    LEVELS,
    WRITE_CASES,
    assert_same_bits,
    bf16_bits,
    random_rotations,
    reference_bf16_scatter,
    reference_demote,
    reference_scatter,
)
from oscar_torch.kernels import write as kwrite
from shared_math import codec as ref
from shared_math.spec import clip_index

F32 = np.float32
CASE_LEVELS = [(case, LEVELS[i % 2]) for i, case in enumerate(WRITE_CASES)] + [(WRITE_CASES[1], LEVELS[0])]


def _id(param):
    case, levels = param
    return f"{case.name}-{levels}"


def assert_pools(got, want, what):
    for name, a, e in zip(("codes", "scale", "minimum"), got, want):
        assert_same_bits(to_numpy(a), e, f"{what} {name}")


# ------------------------------------------------------------------------------ write_int2


@pytest.mark.parametrize("param", CASE_LEVELS, ids=_id)
def test_write_int2_without_rotation_is_encode(param):
    case, levels = param
    rows = case.rows()
    got = ops.write_int2(to_torch(rows), None, group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    want = ref.encode(rows, group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    assert_pools(got, want, case.name)


def test_write_int2_identity_rotation_is_exact():
    case = WRITE_CASES[2]
    rows = case.rows()  # heavy-tailed, no zeros: x·I is exact in any summation order
    identity = np.broadcast_to(np.eye(case.head_dim, dtype=F32), (case.num_kv_heads, case.head_dim, case.head_dim))
    got = ops.write_int2(to_torch(rows), to_torch(identity), group_size=case.group_size, clip_ratio=case.clip_ratio)
    assert_pools(got, ref.encode(rows, group_size=case.group_size, clip_ratio=case.clip_ratio), "identity")


@pytest.mark.parametrize("levels", LEVELS)
def test_write_int2_rotation_matches_float32_product(levels):
    """k' = x·R[h] in IEEE float32 inside the kernel. The reference rotates with numpy's float32
    matmul; the two sum in different orders, so a rotated value on a threshold may round to the
    other side: allow rare one-level code flips and metadata within one float16 step, and require
    most rows to be bit-identical (a wrong head, transposed R or TF32 would break all three)."""
    case = WRITE_CASES[5]
    rng = np.random.default_rng(17)
    rows = rng.standard_normal((case.num_tokens, case.num_kv_heads, case.head_dim)).astype(F32)
    rotation = random_rotations(rng, case.num_kv_heads, case.head_dim)
    got = ops.write_int2(to_torch(rows), to_torch(rotation), group_size=case.group_size,
                         clip_ratio=case.clip_ratio, levels=levels)
    rotated = np.einsum("tkd,kde->tke", rows, rotation).astype(F32)
    _assert_rotated_encoding(got, rotated, group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)


def _assert_rotated_encoding(got, rotated, **codec_args):
    """Rare one-level code flips and metadata within one float16 step of shared_math.encode of
    `rotated`, and most rows bit-identical (a wrong head, transposed R or TF32 would break all)."""
    want = ref.encode(rotated, **codec_args)
    codes = ref.unpack_codes(to_numpy(got[0])).astype(int)
    want_codes = ref.unpack_codes(want[0]).astype(int)
    assert np.abs(codes - want_codes).max() <= 1 and np.mean(codes != want_codes) < 1e-2
    for a, e in zip(got[1:], want[1:]):
        assert np.abs(to_numpy(a).view(np.int16).astype(int) - e.view(np.int16).astype(int)).max() <= 1
    exact_rows = np.all(to_numpy(got[0]) == want[0], axis=-1)
    assert exact_rows.mean() > 0.8, exact_rows.mean()


def test_write_int2_bf16_rows_take_the_split_rotation():
    """bfloat16 rows: three bf16 products of R's parts (on the GPU, tensor cores), as accurate as
    the float32 product: rows rotated in float64 encode the same but for rare flips."""
    rng = np.random.default_rng(5)
    rows = torch.from_numpy(rng.standard_normal((70, 3, 64)).astype(F32)).to(torch.bfloat16)
    rotation = random_rotations(rng, 3, 64)
    got = ops.write_int2(rows.to(DEVICE), to_torch(rotation), group_size=32, clip_ratio=0.96)
    rotated = np.einsum("tkd,kde->tke", rows.double().numpy(), rotation.astype(np.float64)).astype(F32)
    _assert_rotated_encoding(got, rotated, group_size=32, clip_ratio=0.96, levels="minmax")


# ----------------------------------------------------------------------------- write_pages


@pytest.mark.parametrize("param", CASE_LEVELS, ids=_id)
def test_write_pages_scatter_is_encode_in_place(param):
    case, levels = param
    pools = case.int2_pools()
    rows = case.rows()
    page_ids, slots = case.destinations()
    tensors = tuple(to_torch(p) for p in pools)
    pointers = [t.data_ptr() for t in tensors]
    got = ops.write_pages(*tensors, to_torch(rows), to_torch(page_ids), to_torch(slots),
                          group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    assert all(a is b for a, b in zip(got, tensors)) and [t.data_ptr() for t in got] == pointers
    want = reference_scatter(pools, rows, page_ids, slots, group_size=case.group_size,
                             clip_ratio=case.clip_ratio, levels=levels)
    assert_pools(tensors, want, case.name)


def test_write_pages_rotation_equals_write_int2_scattered():
    """The rotated write scatters exactly the rows write_int2 produces (same kernel path)."""
    case = WRITE_CASES[4]
    rng = np.random.default_rng(3)
    rows = case.rows()
    rotation = to_torch(random_rotations(rng, case.num_kv_heads, case.head_dim))
    page_ids, slots = case.destinations()
    tensors = tuple(to_torch(p) for p in case.int2_pools())
    ops.write_pages(*tensors, to_torch(rows), to_torch(page_ids), to_torch(slots), rotation=rotation,
                    group_size=case.group_size, clip_ratio=case.clip_ratio)
    dense = ops.write_int2(to_torch(rows), rotation, group_size=case.group_size, clip_ratio=case.clip_ratio)
    for pool, value in zip(tensors, dense):
        assert torch.equal(pool[torch.as_tensor(page_ids).long(), :, torch.as_tensor(slots).long()], value)


def _rotation_product_rows(monkeypatch, write, head_dim: int) -> set[int]:
    """Rows of the float32 [R, D] x [D, D] products the Triton interpreter computes (numpy matmuls)
    while write() runs."""
    seen, matmul = set(), np.matmul

    def spy(a, b, *args, **kwargs):
        if a.dtype == np.float32 and b.shape[-2:] == (head_dim, head_dim):
            seen.add(a.shape[-2])
        return matmul(a, b, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(np, "matmul", spy)
        write()
    return seen


def test_rotated_write_in_one_block_is_16_token_blocks(monkeypatch):
    """float32 rows rotated in the kernel, 500 tokens (a ragged last block): the default launch
    (interpreted: one block of 512 tokens rotated in 16-row slices, kernels.write._rotation_rows;
    compiled: blocks of 16) writes the bytes of blocks of 16, bit for bit, in both fused writes.
    Interpreted, one 512-row product need not: whether numpy's float32 product rounds by its rows
    depends on the sgemm kernel OpenBLAS picks for the CPU (on the machine of NOTES v22 a 512-row
    product moved a minimum by an ulp here; on an AMD EPYC with OpenBLAS 0.3.34 it does not), so the
    interpreted check reads the products' rows themselves: every rotation product has 16 rows, and
    the one-block launch this test would catch has 512."""
    rng = np.random.default_rng(1)
    rows = to_torch(rng.standard_normal((500, 3, 64)).astype(F32) * 3.0)
    rotation = to_torch(random_rotations(rng, 3, 64))
    common = dict(group_size=32, clip_index=clip_index(0.96, 64), levels="minmax")
    by_16 = kwrite.write_int2_rows(rows, rotation, **common, block_tokens=16)
    default = kwrite.write_int2_rows(rows, rotation, **common)
    for a, b, name in zip(default, by_16, ("codes", "scale", "minimum")):
        assert_same_bits(to_numpy(a), to_numpy(b), f"write_int2 {name}")
    page_ids = to_torch(np.arange(500, dtype=np.int32) // 16)
    slots = to_torch(np.arange(500, dtype=np.int32) % 16)
    pools = [to_torch(np.zeros((32, 3, 16, w), dt)) for w, dt in ((16, np.uint8), (2, np.float16), (2, np.float16))]
    kwrite.write_pages_rows(*pools, rows, page_ids, slots, rotation, **common)
    for pool, value, name in zip(pools, by_16, ("codes", "scale", "minimum")):
        assert_same_bits(to_numpy(pool.permute(0, 2, 1, 3).reshape(32 * 16, 3, -1)[:500]), to_numpy(value),
                         f"write_pages {name}")
    if not ON_GPU:
        assert kwrite._token_block_rows(500, None, True, torch.float32) == 512 and kwrite._rotation_rows(512) == 16
        write = lambda: kwrite.write_int2_rows(rows, rotation, **common)  # noqa: E731
        assert _rotation_product_rows(monkeypatch, write, 64) == {16}
        monkeypatch.setattr(kwrite, "_rotation_rows", lambda block_rows: block_rows)  # one 512-row product
        assert _rotation_product_rows(monkeypatch, write, 64) == {512}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_write_pages_input_dtypes(dtype):
    case = WRITE_CASES[0]
    rows = to_torch(case.rows()).to(dtype)
    page_ids, slots = case.destinations()
    pools = case.int2_pools()
    tensors = tuple(to_torch(p) for p in pools)
    ops.write_pages(*tensors, rows, to_torch(page_ids), to_torch(slots), group_size=case.group_size,
                    clip_ratio=case.clip_ratio)
    expected_rows = rows.to(torch.float32).cpu().numpy()
    want = reference_scatter(pools, expected_rows, page_ids, slots, group_size=case.group_size,
                             clip_ratio=case.clip_ratio, levels="minmax")
    assert_pools(tensors, want, str(dtype))


def test_write_pages_in_blocks_of_16_tokens():
    """The scatter in several programs and a ragged last block (77 tokens in blocks of 16), bit
    for bit: the interpreter's default for unrotated rows is one block (kernels.codec.
    INTERPRET_BLOCK_ROWS), the GPU's 16. (Rotated rows: test_rotated_write_in_one_block_is_16_token_blocks.)"""
    case = WRITE_CASES[4]
    rows = case.rows()
    page_ids, slots = case.destinations()
    pools = case.int2_pools()
    tensors = tuple(to_torch(p) for p in pools)
    kwrite.write_pages_rows(*tensors, to_torch(rows), to_torch(page_ids), to_torch(slots), None,
                            group_size=case.group_size, clip_index=clip_index(case.clip_ratio, case.head_dim),
                            levels="minmax", block_tokens=16)
    assert_pools(tensors, reference_scatter(pools, rows, page_ids, slots, group_size=case.group_size,
                                            clip_ratio=case.clip_ratio, levels="minmax"), "blocks of 16")
    bf16_pool = to_torch(case.bf16_pool())
    before = to_numpy(bf16_pool).copy()
    kwrite.write_bf16_pages_rows(bf16_pool, to_torch(rows), to_torch(page_ids), to_torch(slots), block_tokens=16)
    assert_same_bits(to_numpy(bf16_pool), reference_bf16_scatter(before, rows, page_ids, slots), "bf16 blocks of 16")


def test_kernel_skips_out_of_range_destinations():
    """Without host checks (the custom op called directly, as under torch.compile), destinations
    outside the pool are masked: nothing is written out of bounds, valid tokens still land."""
    case = WRITE_CASES[4]
    num_pages, page_size = case.num_pages, case.page_size
    rows = case.rows()[:6]
    page_ids = np.array([0, -1, num_pages, 2, 1, 3], np.int32)
    slots = np.array([3, 0, 0, page_size, -2, 5], np.int32)
    pools = case.int2_pools()
    tensors = tuple(to_torch(p) for p in pools)
    k = clip_index(case.clip_ratio, case.head_dim)
    library.write_pages(*tensors, to_torch(rows), to_torch(page_ids), to_torch(slots), None, case.group_size, k,
                        "minmax")
    keep = np.array([0, 5])
    want = reference_scatter(pools, rows[keep], page_ids[keep], slots[keep], group_size=case.group_size,
                             clip_ratio=case.clip_ratio, levels="minmax")
    assert_pools(tensors, want, "masked")
    bf16_pool = to_torch(case.bf16_pool())
    before = to_numpy(bf16_pool).copy()
    library.write_bf16_pages(bf16_pool, to_torch(rows), to_torch(page_ids), to_torch(slots))
    assert_same_bits(to_numpy(bf16_pool), reference_bf16_scatter(before, rows[keep], page_ids[keep], slots[keep]),
                     "masked bf16")


def test_empty_writes_leave_pools_untouched():
    case = WRITE_CASES[0]
    pools = case.int2_pools()
    tensors = tuple(to_torch(p) for p in pools)
    empty_rows = torch.zeros((0, case.num_kv_heads, case.head_dim), device=DEVICE)
    no_ids = torch.zeros((0,), dtype=torch.int32, device=DEVICE)
    got = ops.write_pages(*tensors, empty_rows, no_ids, no_ids, group_size=case.group_size, clip_ratio=0.9)
    assert all(a is b for a, b in zip(got, tensors))
    assert_pools(tensors, pools, "empty")
    packed, scale, minimum = ops.write_int2(empty_rows, None, group_size=case.group_size, clip_ratio=0.9)
    assert packed.shape == (0, case.num_kv_heads, case.head_dim // 4) and scale.shape[0] == minimum.shape[0] == 0


# ------------------------------------------------------------------------- write_bf16_pages


def test_write_bf16_pages_rounds_to_nearest_even():
    case = WRITE_CASES[3]  # 16 tokens, 1 head, D = 128
    rows = case.rows()
    one = F32(1.0)
    special = np.array(
        [one + F32(2.0**-8), one + F32(3 * 2.0**-8), -(one + F32(2.0**-8)), F32(1.00390625 + 2.0**-10),
         np.inf, -np.inf, F32(3.3e38), F32(1e-40), F32(-1e-45), 0.0, -0.0, F32(65504.0)],
        F32,
    )
    rows[0, 0, : special.size] = special
    page_ids, slots = case.destinations()
    pool = case.bf16_pool()
    tensor = to_torch(pool)
    assert ops.write_bf16_pages(tensor, to_torch(rows), to_torch(page_ids), to_torch(slots)) is tensor
    want = reference_bf16_scatter(pool, rows, page_ids, slots)
    assert_same_bits(to_numpy(tensor), want, "bf16 RNE")
    # torch's own float32 → bfloat16 cast (round-to-nearest-even on CPU) agrees.
    assert_same_bits(bf16_bits(rows), to_numpy(torch.from_numpy(rows).to(torch.bfloat16)), "torch cast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_write_bf16_pages_input_dtypes(dtype):
    case = WRITE_CASES[1]
    rows = to_torch(case.rows()).to(dtype)
    page_ids, slots = case.destinations()
    pool = case.bf16_pool()
    tensor = to_torch(pool)
    ops.write_bf16_pages(tensor, rows, to_torch(page_ids), to_torch(slots))
    want = reference_bf16_scatter(pool, rows.to(torch.float32).cpu().numpy(), page_ids, slots)
    assert_same_bits(to_numpy(tensor), want, str(dtype))


def test_write_bf16_pages_nan_stays_nan():
    pool = torch.zeros((1, 1, 16, 16), dtype=torch.bfloat16, device=DEVICE)
    rows = torch.full((1, 1, 16), float("nan"), device=DEVICE)
    rows[0, 0, 1] = -float("nan")
    ops.write_bf16_pages(pool, rows, torch.tensor([0], device=DEVICE), torch.tensor([2], device=DEVICE))
    assert torch.isnan(pool[0, 0, 2]).all() and not torch.isnan(pool[0, 0, 3]).any()


# ------------------------------------------------------------------------------- demotion


@pytest.mark.parametrize("param", CASE_LEVELS, ids=_id)
def test_demote_pages_is_encode_of_bf16_pages(param):
    case, levels = param
    layered = case.num_layers > 1
    bf16_pool = case.bf16_pool(layered)
    pools = case.int2_pools(layered)
    src, dst = case.demotions()
    tensors = tuple(to_torch(p) for p in pools)
    got = ops.demote_pages(to_torch(bf16_pool), *tensors, to_torch(src), to_torch(dst),
                           group_size=case.group_size, clip_ratio=case.clip_ratio, levels=levels)
    assert all(a is b for a, b in zip(got, tensors))
    want = reference_demote(bf16_pool, pools, src, dst, group_size=case.group_size, clip_ratio=case.clip_ratio,
                            levels=levels)
    assert_pools(tensors, want, f"{case.name} layered={layered}")


def test_demote_one_layer_of_a_stacked_pool_in_place():
    """A layer view of stacked [Y, ...] pools (what the cache passes) is updated in place."""
    case = WRITE_CASES[4]
    bf16_pool = case.bf16_pool(layers=True)
    pools = case.int2_pools(layers=True)
    src, dst = case.demotions()
    tensors = tuple(to_torch(p) for p in pools)
    ops.demote_pages(to_torch(bf16_pool)[1], *(t[1] for t in tensors), to_torch(src), to_torch(dst),
                     group_size=case.group_size, clip_ratio=case.clip_ratio)
    want = reference_demote(bf16_pool[1], tuple(p[1] for p in pools), src, dst, group_size=case.group_size,
                            clip_ratio=case.clip_ratio, levels="minmax")
    for t, p, w in zip(tensors, pools, want):
        expected = p.copy()
        expected[1] = w
        assert_same_bits(to_numpy(t), expected, "layer view")


# ------------------------------------------------------------------------------- bad inputs

D, G, K, L, P = 64, 32, 2, 16, 3


def _pools(**overrides):
    pools = dict(
        codes=torch.zeros((P, K, L, D // 4), dtype=torch.uint8, device=DEVICE),
        scale=torch.zeros((P, K, L, D // G), dtype=torch.float16, device=DEVICE),
        minimum=torch.zeros((P, K, L, D // G), dtype=torch.float16, device=DEVICE),
    )
    pools.update(overrides)
    return pools


ROWS = torch.zeros((2, K, D), device=DEVICE)
IDS = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
BF16 = torch.zeros((P, K, L, D), dtype=torch.bfloat16, device=DEVICE)
META = torch.device("meta")


def _write(rows=ROWS, page_ids=IDS, slots=IDS, rotation=None, group_size=G, clip_ratio=0.9, levels="minmax", **pools):
    return ops.write_pages(**_pools(**pools), rows=rows, page_ids=page_ids, slots=slots, rotation=rotation,
                           group_size=group_size, clip_ratio=clip_ratio, levels=levels)


def _demote(bf16_pool=BF16, src=IDS, dst=IDS, group_size=G, clip_ratio=0.9, levels="minmax", **pools):
    return ops.demote_pages(bf16_pool, **_pools(**pools), src_pages=src, dst_pages=dst, group_size=group_size,
                            clip_ratio=clip_ratio, levels=levels)


# The errors numpy inputs can make, every backend: parity_tests/test_ops_write.py. Here strides,
# devices, non-tensors and a float64 rotation (which JAX, without x64, never sees).


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: ops.write_int2(ROWS, torch.zeros((K, D, D), dtype=torch.float64, device=DEVICE), group_size=G,
                                clip_ratio=0.9), "rotation must have dtype float32"),
        (lambda: ops.write_int2(ROWS, torch.zeros((K, D, D), device=DEVICE).transpose(1, 2), group_size=G,
                                clip_ratio=0.9), "rotation must be contiguous"),
        (lambda: ops.write_int2(ROWS, torch.zeros((K, D, D), device=META), group_size=G, clip_ratio=0.9),
         "rotation is on device meta"),
        (lambda: _write(codes=torch.zeros((P, L, K, D // 4), dtype=torch.uint8, device=DEVICE).transpose(1, 2)),
         "codes must be contiguous"),
        (lambda: _write(codes=torch.zeros((P, K, L, D // 4), dtype=torch.uint8, device=META)),
         "scale is on device .* but codes is on device meta"),
        (lambda: _write(rows=torch.zeros((K, 2, D), device=DEVICE).transpose(0, 1)), "rows must be contiguous"),
        (lambda: _write(rows=ROWS.to(META)), "rows is on device meta"),
        (lambda: _write(page_ids=[0, 1]), "page_ids must be a torch.Tensor"),
        (lambda: _write(page_ids=torch.zeros((4,), dtype=torch.int32, device=DEVICE)[::2]),
         "page_ids must be contiguous"),
        (lambda: _write(page_ids=IDS.to(META)), "page_ids is on device meta"),
        (lambda: ops.write_bf16_pages(BF16.transpose(0, 1), ROWS, IDS, IDS), "pool must be contiguous"),
        (lambda: ops.write_bf16_pages(BF16, ROWS.to(META), IDS, IDS), "rows is on device meta"),
        (lambda: _demote(bf16_pool=BF16.transpose(1, 2)), "bf16_pool must be contiguous"),
        (lambda: _demote(bf16_pool=BF16.to(META)), "codes is on device .* but bf16_pool is on device meta"),
    ],
)
def test_bad_torch_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.skipif(ON_GPU, reason="CPU tensors are valid under the interpreter only")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    from oscar_torch.kernels import codec as kcodec

    monkeypatch.setattr(kcodec, "INTERPRETING", False)
    with pytest.raises(ValueError, match="x is on device cpu: oscar_torch kernels run on cuda, or on cpu under"):
        ops.encode(torch.zeros((2, 64)), group_size=32, clip_ratio=0.9)


# ------------------------------------------------------------------------- encode by planes


def _rotated_planes_case(rng):
    num_tokens, num_heads, d = 37, 3, 64
    rows = (rng.standard_normal((num_tokens, num_heads, d)) * 3).astype(np.float32)
    rows[num_tokens // 2, num_heads - 1, 5] = np.nan  # token 18, head 2: its block of 16 falls back
    x = torch.from_numpy(rows).to(torch.bfloat16).to(DEVICE)
    rotation = to_torch(random_rotations(rng, num_heads, d))
    return x, rotation, dict(group_size=d, clip_index=clip_index(0.96, d), levels="minmax", block_tokens=16)


@pytest.mark.skipif(ON_GPU, reason="swaps a kernel function, which only the interpreter sees")
def test_rotated_bf16_rows_by_planes_fall_back_only_where_a_row_declines(monkeypatch):
    """Which path each block takes (encode_block swapped for a stand-in writing zeros): the blocks
    of ordinary rows by planes, the block holding a NaN row and only it by encode_block."""
    from oscar_torch.tests.test_ops_codec import _zeros_encode_block

    x, rotation, kw = _rotated_planes_case(np.random.default_rng(43))
    want = [to_numpy(a) for a in kwrite.write_int2_rows(x, rotation, planes=False, **kw)]
    monkeypatch.setattr(kwrite, "encode_block", _zeros_encode_block)
    got = [to_numpy(a) for a in kwrite.write_int2_rows(x, rotation, planes=True, **kw)]
    fell_back = np.zeros(x.shape[:2], bool)
    fell_back[16:32, x.shape[1] - 1] = True
    for name, a, e in zip(("packed", "scale", "minimum"), got, want):
        assert_same_bits(a[~fell_back], e[~fell_back], f"{name}: blocks of ordinary rows by planes")
        assert not a[fell_back].view(f"u{a.itemsize}").any(), f"{name}: the NaN block did not fall back"
