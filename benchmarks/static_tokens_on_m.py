"""Static sm_90 count of the Pallas INT2 kernel with the scores as [L, BLOCK_M] (tokens on the dot's M) against the
shipped [BLOCK_M, L] form (benchmarks/NOTES.md v15). Experiment; reverted after the count."""
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, "/work/main")
import numpy as np, jax, jax.numpy as jnp
from benchmarks.static_analysis import compile_pallas_for_h200, sass, loop_profile
from oscar_jax.kernels.decode_attention import int2_tier_partials
B, K, L, D, P = 2, 2, 64, 128, 130
rng = np.random.default_rng(0)
kc = jnp.asarray(rng.integers(0, 256, (P, K, L, D // 4), dtype=np.uint8))
meta = jnp.ones((P, K, L, 1), jnp.float16)
table = jnp.ones((B, 64), jnp.int32); hist = jnp.full((B,), 4000, jnp.int32)
variants = [(16, False, 2), (16, True, 2), (8, True, 2), (16, True, 4), (8, True, 4), (4, True, 2)]
if len(sys.argv) > 1:
    variants = [tuple(eval(v)) for v in sys.argv[1:]]
for M, tom, nw in variants:
    q = jnp.zeros((B, K, M, D), jnp.bfloat16)
    def fn(q, kc, meta, table, hist):
        return int2_tier_partials(q, kc, meta, meta, kc, meta, meta, table, hist, group_size=128, softmax_scale=D**-0.5,
                                  pages_per_split=16, pages_per_block=1, block_m=M, interpret=False, num_warps=nw,
                                  num_stages=3, unpack_asm=True, tokens_on_m=tom)
    try:
        res = compile_pallas_for_h200(fn, q, kc, meta, table, hist)
    except Exception as e:
        print(M, tom, nw, "FAILED", type(e).__name__, str(e)[:300]); continue
    for name, u in res.items():
        text = sass(u["compiled"].asm["cubin"])
        lp = loop_profile(text)
        per_tok = lp["instructions"] * nw / L
        top = ", ".join(f"{k} {v}" for k, v in list(lp["opcodes"].items())[:14])
        print(f"M={M} tokens_on_m={tom} warps={nw}: regs {u['registers']} spill {u['spills']} smem {u['shared']} loop {lp['instructions']} /warp -> {per_tok:.1f} per (token, head)\n   {top}", flush=True)
        open(f"/tmp/proto/sass_{M}_{tom}_{nw}.txt", "w").write(text)
