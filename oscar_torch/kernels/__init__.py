"""Triton kernel bodies and launchers of oscar_torch; the public, validating ops are in oscar_torch.ops.

Modules (the same file names as oscar_jax/kernels, so the two can be read side by side):
  codec.py              format v1 encode / decode of rows: the shared block bodies `encode_block` /
                        `decode_block` (@triton.jit on register tiles) and their row launchers.
  write.py              the write path: fused rotate + encode of [T, Hkv, D] rows, page scatters
                        into the INT2 and BF16 page pools (in place), and demotion of whole BF16
                        pages into INT2 pages (all layers in one launch).
  decode_attention/     split-K first-stage kernels over the BF16 tier and the INT2 tier and their
                        merge, one file a tier (bf16_tier, int2_tier, merge; its __init__ says more).
  prefill_attention.py  the causal full-precision kernel of a prefill chunk over itself.

Rules kept on every backend (so the bytes match the interpreter, the GPU and oscar_jax): no
division in the codec, no libdevice rounding, compares on int32 keys, pinned summation order,
format constants from shared_math as tl.constexpr, bfloat16 moved as int16 bit patterns and
converted with integer ops (the interpreter truncates f32 → bf16 casts and gets bf16 `tl.dot`
wrong), power-of-two tiles, dots with M, N, K ≥ 16, masks on every partial block and scatter.
"""
