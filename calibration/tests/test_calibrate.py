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



def _format_version(directory):
    from safetensors import safe_open

    from shared_math.artifact import artifact_file

    with safe_open(str(artifact_file(directory)), framework="np") as f:
        return f.metadata()["format_version"]


def test_cli_key_layout_channel(tiny_dir, text_file, tmp_path):
    """--key-layout channel: the artifact records key_layout 'channel' as format v2 and --fit-clip
    fits the key clips of the per-channel codec (the key error over groups of --key-group tokens);
    values and rotations are the v1 run's; without the flag the artifact stays format v1."""
    assert _run(tiny_dir, text_file, tmp_path / "v1", "--fit-clip") == 0
    assert _run(tiny_dir, text_file, tmp_path / "v2", "--fit-clip", "--key-layout", "channel",
                "--key-group", "16") == 0
    v1, v2 = read_artifact(tmp_path / "v1"), read_artifact(tmp_path / "v2")
    assert v1.codec == {"group_size": 16, "levels": "minmax"} and v1.key_layout == "token"
    assert _format_version(tmp_path / "v1") == "1"
    assert "key_layout" not in v1.provenance["options"] and "key_group" not in v1.provenance["options"]
    assert v2.codec == {"group_size": 16, "levels": "minmax", "key_layout": "channel", "key_group": 16}
    assert v2.key_layout == "channel" and _format_version(tmp_path / "v2") == "2"
    assert v2.provenance["options"]["key_layout"] == "channel" and v2.provenance["options"]["key_group"] == 16
    for name in ("k_rotation", "v_rotation", "v_clip_ratio"):
        assert np.array_equal(getattr(v1, name), getattr(v2, name))
    r1, r2 = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("v1", "v2"))
    assert r1["clip_search"]["value_output"] == r2["clip_search"]["value_output"]
    assert r1["clip_search"]["key_logit"] != r2["clip_search"]["key_logit"]  # another key codec
    for layer, errs in enumerate(r2["clip_search"]["key_logit"]):  # the fitted clip minimises it
        assert v2.k_clip_ratio[layer] == np.float32(r2["clip_grid"][int(np.argmin(errs))])
    assert _run(tiny_dir, text_file, tmp_path / "d", "--key-layout", "channel") == 0  # default group 64
    assert read_artifact(tmp_path / "d").provenance["options"]["key_group"] == 64


def test_key_logit_error_per_channel_over_groups():
    """The per-channel key error quantizes each channel over whole groups of key_group tokens with
    shared_math's encode_channels (clip index over the group's values), a partial group not at all."""
    from calibration.fit import key_logit_error
    from shared_math.codec import decode_channels, encode_channels

    rng = np.random.default_rng(0)
    t, hq, hkv, d, g = 40, 4, 2, 32, 16
    q, k = rng.standard_normal((t, hq, d)), rng.standard_normal((t, hkv, d))
    k[5, :, 3] = 30.0  # an outlier that a clip below 1 cuts within its group
    eye = np.broadcast_to(np.eye(d), (hkv, d, d))
    kr = k.transpose(1, 0, 2).astype(np.float32)
    for clip in (1.0, 0.88):
        expect = kr.copy()
        pages = kr[:, :32].reshape(hkv, 2, g, d)  # 2 whole groups; tokens 32..39 stay unquantized
        expect[:, :32] = decode_channels(*encode_channels(pages, clip_ratio=clip, levels="minmax")).reshape(hkv, 32, d)
        err = k.transpose(1, 0, 2) - expect
        qr = q.reshape(t, hkv, hq // hkv, d).transpose(1, 0, 2, 3).reshape(hkv, t * hq // hkv, d)
        mask = np.repeat(np.tril(np.ones((t, t), bool)), hq // hkv, axis=0)
        ref = np.sum(np.where(mask, qr @ err.transpose(0, 2, 1), 0) ** 2) / \
            np.sum(np.where(mask, qr @ k.transpose(1, 2, 0), 0) ** 2)
        got = key_logit_error(q, k, eye, group_size=16, clip_ratio=clip, levels="minmax",
                              key_layout="channel", key_group=g)
        np.testing.assert_allclose(got, ref, rtol=1e-12)
    # the clip index is over a group's 16 values, not the 32 channels: c = 0.96 → k = 15 = no clip
    errs = {c: key_logit_error(q, k, eye, group_size=16, clip_ratio=c, levels="minmax", key_layout="channel",
                               key_group=g) for c in (1.0, 0.96, 0.88)}
    assert errs[0.96] == errs[1.0] != errs[0.88]


def test_cli_key_layout_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path), "--key-layout", "page"])
    assert "invalid choice: 'page'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path), "--key-group", "32"])
    assert "--key-group applies only with --key-layout channel" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path), "--key-layout", "channel", "--key-group", "48"])
    assert "key_group=48" in capsys.readouterr().err
