"""`python -m calibration` on 1 and on N fake CPU devices, in a fresh process (test_tp_calibration.py).

XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX initialises its backend,
which a pytest process has already done: the test runs this file as a subprocess,
`python calibration/tests/tp_calibration_worker.py DIR TP...`. It writes a random-weight model
with SmolLM2-135M's heads (9 q / 3 KV, head_dim 64, tied embedding, SmolLM2's tokenizer) and a
text file into DIR, calibrates it once per tensor-parallel size into the same output directory
(the provenance records it), and copies each artifact to DIR/tp{N}.safetensors for the test to
compare byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

HIDDEN, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 96, 2, 9, 3, 64, 192
WORDS = ("the", "cache", "holds", "keys", "and", "values", "of", "every", "token", "rotated", "before", "they",
         "are", "quantized", "to", "two", "bits", "per", "element", "while", "recent", "ones", "stay", "in", "bf16")


def write_model(directory: Path) -> Path:
    """An HF directory (config.json, model.safetensors, tokenizer.json) with SmolLM2's heads."""
    from oscar_jax.tokenizer import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({  # the end-of-text token separates documents
        "eos_token": tokenizer.decode([tokenizer.eos_id]), "bos_token": tokenizer.decode([tokenizer.bos_id]),
        "add_bos_token": False}))
    vocab = tokenizer.vocab_size
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": Q_HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "max_position_embeddings": 2048}))
    rng = np.random.default_rng(0)

    def normal(*shape, std=0.2):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=1.0), "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        tensors.update({
            p + "input_layernorm.weight": 1 + normal(HIDDEN, std=0.1),
            p + "post_attention_layernorm.weight": 1 + normal(HIDDEN, std=0.1),
            p + "self_attn.q_proj.weight": normal(Q_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, Q_HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        })
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def write_text(path: Path) -> Path:
    rng = np.random.default_rng(1)
    paragraphs = [" ".join(rng.choice(WORDS, 60)).capitalize() + "." for _ in range(12)]
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    return path


def main(argv) -> int:
    from calibration.calibrate import CalibrationOptions, calibrate

    root, sizes = Path(argv[0]), [int(t) for t in argv[1:]]
    model, text = write_model(root / "model"), write_text(root / "text.txt")
    for size in sizes:
        opts = CalibrationOptions(model_path=str(model), calib_data=str(text), calib_tokens=192, seq_len=96,
                                  heldout_tokens=64, output_dir=str(root / "out"), progress=False,
                                  tensor_parallel_size=size)
        artifact, _ = calibrate(opts, command="calibration tp test")
        shutil.copyfile(root / "out" / "oscar_rotations.safetensors", root / f"tp{size}.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
