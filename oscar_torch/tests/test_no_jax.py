"""A PyTorch user never imports JAX: README's PyTorch quickstart path (the model file, the shipped
artifact and the tokenizer through shared_math, the cache and the "oscar" attention through
oscar_torch) leaves no jax, jaxlib, flax or oscar_jax module loaded.

It runs in a fresh interpreter: this pytest process has imported JAX already (the root conftest).
The quickstart's SmolLM2 generate() takes a minute under the Triton interpreter, so its steps run
on SmolLM2's config and tokenizer, and the generate() on a tiny random model with the same code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JAX_SIDE = ("jax", "jaxlib", "flax", "chex", "optax", "orbax", "oscar_jax")

QUICKSTART = """
import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
import transformers

import oscar_torch.hf
from oscar_torch.hf import OscarHFCache, model_fingerprint
from shared_math.models import resolve_model_path, shipped_artifact
from shared_math.tokenizer import load_tokenizer

path = resolve_model_path("smollm2-135m")
config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
tokenizer = load_tokenizer("smollm2-135m")
ids = tokenizer.encode("The capital of France is")
assert tokenizer.decode(ids) == "The capital of France is", ids
cache = OscarHFCache.from_artifact(shipped_artifact("smollm2-135m"), config, max_cache_len=256)
assert cache.config.head_dim == 64 and cache.config.group_size == cache.artifact.group_size

from shared_math.tests.test_artifact import make_artifact
torch.manual_seed(0)
tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
tiny.set_attn_implementation("oscar")
artifact = make_artifact(model_fingerprint(tiny.config), seed=1)
cache = OscarHFCache.from_artifact(artifact, tiny.config, sink=16, recent=16, max_cache_len=64)
out = tiny.generate(torch.tensor([ids * 4]), past_key_values=cache, max_new_tokens=4, do_sample=False,
                    pad_token_id=0)
assert out.shape == (1, len(ids) * 4 + 4), out.shape
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {jax_side!r})))
"""


def test_pytorch_quickstart_imports_no_jax():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", QUICKSTART.format(jax_side=set(JAX_SIDE))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert loaded == "", f"the PyTorch path imported {loaded}"
