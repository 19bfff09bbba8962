"""OSCAR for PyTorch: Triton kernels with the same op names and the same bytes as oscar_jax.

  ops.py            public ops (validate, then launch): encode, decode, write_int2, write_pages,
                    write_bf16_pages, demote_pages, decode_attention, prefill_attention
  attention_ops.py  decode / prefill attention over the paged mixed-tier cache (+ merge_partials)
  library.py        every kernel launch as a torch custom op (torch.ops.oscar.*) with a fake
                    implementation; the pool writers declare their mutations
  cache.py          OscarTorchCache: the paged pools of all layers, updated in place
  validation.py     the one argument-check helper (ValueError naming the value)
  kernels/          Triton kernel bodies and launchers, file for file as oscar_jax/kernels

Kernels run on cuda, or on cpu under the Triton interpreter (TRITON_INTERPRET=1 set before this
package is imported). Format: FORMAT.md; the reference: shared_math.
"""
