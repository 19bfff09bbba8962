"""Pallas kernel bodies and launchers of oscar_jax; the public, validating ops are in oscar_jax.ops.

Modules (the same file names as oscar_torch/kernels, so the two can be read side by side):
  codec.py   format v1 encode / decode of rows: the shared block body `encode_block` /
             `decode_block` (pure jnp on values) and their row-tiled launchers.
  write.py   the write path: fused rotate + encode of [T, Hkv, D] rows, page scatters into the
             INT2 and BF16 page pools (in place through input_output_aliases), and demotion of
             whole BF16 pages into INT2 pages (all layers in one launch).
  decode_attention/  split-K first-stage kernels over the BF16 tier and the INT2 tier and their
             merge, one file a tier (bf16_tier, int2_tier, merge; its __init__ says more).
  prefill_attention.py  the causal full-precision kernel of a prefill chunk over itself.
  register_cap.py  the opt-in register cap of the INT2 tier kernel (a patch of a private JAX
             function, off by default).

Lowering choice: `pl.pallas_call` with the Triton lowering (`jax.experimental.pallas.triton`,
`plgpu.CompilerParams(num_warps=...)`), not Mosaic GPU. Why:
  * the codec is integer and comparison work on 8-bit codes and int32 bit patterns; the Triton
    lowering handles integer ops on loads widened to int32, masks, gathers/scatters by index
    arrays (page ids, slots) and `jnp.dot` (the key rotation, at IEEE float32 precision);
    Mosaic GPU rejects 8-bit arithmetic and has no `jnp.dot`;
  * the kernels stay line-by-line comparable with the oscar_torch Triton kernels, which must
    produce the same bytes;
  * the Triton lowering is deprecated since jax 0.11 but works in the pinned 0.11.2.
GPU rules respected even though CI runs `interpret=True` on CPU: power-of-two block shapes, no
sort, no dynamic shapes, integer work in int32, explicit masks on every partial block and on
every scatter, no float min/max or negation where the sign of a zero could leak into the bytes
(Triton lowers min/max to minnum/maxnum and negation to 0 − x).

`interpret=None` in every launcher means: interpret on a CPU backend, compile for the GPU
otherwise (`resolve_interpret`).
"""
