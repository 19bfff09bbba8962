"""End-to-end calibration on a tiny random Llama checkpoint (written by transformers) and a text file."""

import json

import numpy as np
import pytest

from calibration.__main__ import main
from shared_math.artifact import ModelFingerprint, read_artifact

TEXT = "\n\n".join(
    " ".join(f"word{(i * 7 + j * 13) % 97} is {'near' if (i + j) % 3 else 'far from'} word{(i + j) % 89}." for j in range(40))
    for i in range(30)
)


def _tiny_llama(path, head_dim=16):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>"]))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(TEXT)
    return path


def _run(tiny_dir, text_file, out, *extra):
    return main(["--model-path", str(tiny_dir), "--calib-data", str(text_file), "--calib-tokens", "256",
                 "--seq-len", "64", "--heldout-tokens", "64", "--output-dir", str(out), "--no-progress", *extra])


def test_cli_writes_a_valid_artifact_and_report(tiny_dir, text_file, tmp_path, capsys):
    assert _run(tiny_dir, text_file, tmp_path / "a", "--fit-clip") == 0
    art = read_artifact(tmp_path / "a", expected_model=ModelFingerprint(2, 4, 2, 16))
    assert art.k_rotation.shape == (2, 2, 16, 16) and art.codec == {"group_size": 16, "levels": "minmax"}
    assert art.provenance["calibration_tokens"] == 256 and "--fit-clip" in art.provenance["command"]
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert set(report["heldout_errors"]) == {"identity", "hadamard", "oscar"}
    assert set(art.k_clip_ratio.tolist()) <= set(np.float32(report["clip_grid"]).tolist())
    for name in ("report.md", "eigenvalue_spectra.png", "layer_errors.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    # deterministic: the same command gives the same rotations
    assert _run(tiny_dir, text_file, tmp_path / "b", "--fit-clip") == 0
    again = read_artifact(tmp_path / "b")
    assert np.array_equal(art.k_rotation, again.k_rotation) and np.array_equal(art.v_rotation, again.v_rotation)


def test_cli_variants(tiny_dir, text_file, tmp_path):
    assert _run(tiny_dir, text_file, tmp_path / "s", "--value-target", "surrogate", "--per-layer",
                "--levels", "moments", "--k-clip-ratio", "1.0", "--rotation-kind", "hadamard") == 0
    art = read_artifact(tmp_path / "s")
    h = art.k_rotation[0, 0]
    assert np.allclose(np.abs(h), 0.25, atol=1e-6)  # a 16 × 16 Hadamard matrix
    assert art.levels == "moments" and art.k_clip_ratio.tolist() == [1.0, 1.0]


def test_cli_errors(tiny_dir, text_file, tmp_path, capsys):
    assert main(["--model-path", "no-such-model", "--output-dir", str(tmp_path)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert _run(tiny_dir, text_file, tmp_path / "x", "--calib-tokens", "100000") == 2
    assert "fewer than the 100064 requested" in capsys.readouterr().err
    assert main(["--model-path", str(tiny_dir), "--calib-data", str(tmp_path / "none.txt"),
                 "--output-dir", str(tmp_path)]) == 2
    assert "none.txt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path), "--k-clip-ratio", "1.5"])
    assert "clip_ratio=1.5" in capsys.readouterr().err


def test_head_dim_must_be_a_power_of_two(tmp_path, text_file, capsys):
    odd = _tiny_llama(tmp_path / "odd", head_dim=24)
    assert _run(odd, text_file, tmp_path / "o") == 2
    assert "head_dim=24" in capsys.readouterr().err
