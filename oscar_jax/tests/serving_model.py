"""A tiny random-weight model directory for the serving tests: SmolLM2's tokenizer and chat
template, 2 layers, an OSCAR rotation artifact — every file the server reads, loaded through the
same paths as a real checkpoint (an HF directory and --oscar-rotation-path), compiled in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from shared_math.artifact import ModelFingerprint, RotationArtifact, write_artifact
from shared_math.rotation import rotation_from_covariance

HIDDEN, LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 2, 4, 2, 64, 128


def write_tiny_model(directory: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """Write the model into directory/model and its artifact into directory/rotations; returns both."""
    from oscar_jax.serving.chat import read_chat_template
    from oscar_jax.loaders import resolve_model_path
    from oscar_jax.tokenizer import load_tokenizer

    model_dir, rotation_dir = Path(directory) / "model", Path(directory) / "rotations"
    model_dir.mkdir(parents=True, exist_ok=True)
    smollm = resolve_model_path("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    vocab = tokenizer.vocab_size
    tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": read_chat_template(smollm), "eos_token": tokenizer.decode([tokenizer.eos_id]),
        "bos_token": tokenizer.decode([tokenizer.bos_id]), "add_bos_token": False}))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": Q_HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "max_position_embeddings": 4096}))
    rng = np.random.default_rng(seed)

    def normal(*shape, std=0.1):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    # Unit-variance embedding and output head: the logits spread widely, so greedy choices are far
    # from ties (batching and recomputation cannot flip them), and untied, so the next token is not
    # the current one.
    tensors = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=1.0), "lm_head.weight": normal(vocab, HIDDEN, std=1.0),
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            p + "self_attn.q_proj.weight": normal(Q_HEADS * HEAD_DIM, HIDDEN, std=0.3),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.3),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, Q_HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        })
    save_file(tensors, str(model_dir / "model.safetensors"))
    rot, eig = {"k": [], "v": []}, {"k": [], "v": []}
    for name in ("k", "v"):
        for _ in range(LAYERS * KV_HEADS):
            a = rng.standard_normal((256, HEAD_DIM))
            r, e = rotation_from_covariance(a.T @ a, "oscar")
            rot[name].append(r)
            eig[name].append(e)
    shape = (LAYERS, KV_HEADS)
    write_artifact(rotation_dir, RotationArtifact(
        k_rotation=np.array(rot["k"], np.float32).reshape(*shape, HEAD_DIM, HEAD_DIM),
        v_rotation=np.array(rot["v"], np.float32).reshape(*shape, HEAD_DIM, HEAD_DIM),
        k_eigenvalues=np.array(eig["k"], np.float32).reshape(*shape, HEAD_DIM),
        v_eigenvalues=np.array(eig["v"], np.float32).reshape(*shape, HEAD_DIM),
        k_clip_ratio=np.full(LAYERS, 0.96, np.float32), v_clip_ratio=np.full(LAYERS, 0.92, np.float32),
        model=ModelFingerprint(LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM),
        codec={"group_size": 64, "levels": "minmax"}, provenance={"command": "serving test", "tokens": 0}))
    return model_dir, rotation_dir
