"""The SentencePiece (GGUF `tokenizer.ggml.model == "llama"`) kind of shared_math.tokenizer: a tiny
hand-made vocabulary checks the algorithm (score-ranked merges, byte fallback, user-defined and
control pieces, BOS); the slow tests check Gemma 3 270M's 262K-piece tokenizer on real text.

Reference for the real tokenizer: the `sentencepiece` library running a model proto built from
the same GGUF pieces, scores and types (when sentencepiece is installed). It agrees on 5M
characters of Wikipedia, Shakespeare and KJV text, with one deliberate difference: runs of
spaces. Gemma stores them ("  " … 31 spaces) as USER_DEFINED pieces with literal spaces, which
llama.cpp (and so the GGUF's own runtime) matches in the raw text before spaces become "▁"; a
rebuilt proto escapes them first and emits one "▁" per space, which the model never saw in
training (github.com/kekzl/imp PR 661 measured the perplexity cost). We follow llama.cpp.
"""

import re

import gguf
import numpy as np
import pytest

from shared_math.tokenizer import Tokenizer, load_tokenizer

# id: (piece, score, type) — types as gguf.TokenType (1 normal, 3 control, 4 user-defined, 6 byte)
_PIECES = [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 3), ("\n\n", 0.0, 4),
           ("  ", 0.0, 4), *((f"<0x{b:02X}>", 0.0, 6) for b in range(256)),
           ("▁", -1.0, 1), ("a", -2.0, 1), ("b", -3.0, 1), ("c", -4.0, 1), ("h", -5.0, 1),
           ("ab", -6.0, 1), ("▁a", -7.0, 1), ("bc", -8.0, 1), ("▁ab", -9.0, 1), ("abc", -10.0, 1),
           ("é", -11.0, 1)]


def _write_spm_gguf(path, *, add_bos=True, add_space_prefix=False):
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p for p, _, _ in _PIECES])
    writer.add_token_scores([s for _, s, _ in _PIECES])
    writer.add_token_types([t for _, _, t in _PIECES])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(add_bos)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ids(*pieces):
    index = {p: i for i, (p, _, _) in enumerate(_PIECES)}
    return [index[p] for p in pieces]


@pytest.fixture
def tiny(tmp_path):
    return Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf"))


def test_merges_follow_piece_scores(tiny):
    # "abc": ab (score −6) merges before bc (−8), then ab + c → abc (−10); " ab": ab (−6) before
    # ▁a (−7), then ▁ + ab → ▁ab (−9)
    assert tiny.encode("abc", add_bos=False) == _ids("abc")
    assert tiny.encode(" ab", add_bos=False) == _ids("▁ab")
    assert tiny.encode("bc a", add_bos=False) == _ids("bc", "▁a")
    assert tiny.encode("cab", add_bos=False) == _ids("c", "ab")


def test_bos_byte_fallback_user_defined_and_control(tiny):
    assert tiny.bos_id == 2 and tiny.eos_id == 1 and tiny.add_bos
    assert tiny.encode("a") == [2, *_ids("a")]
    # "z" is not a piece: its UTF-8 byte; "é" is a piece; "ü" falls back to two bytes
    assert tiny.encode("zé", add_bos=False) == _ids("<0x7A>", "é")
    assert tiny.encode("ü", add_bos=False) == _ids("<0xC3>", "<0xBC>")
    # user-defined pieces match raw text whole, before spaces become ▁
    assert tiny.encode("a  b\n\nc", add_bos=False) == _ids("a", "  ", "b", "\n\n", "c")
    assert tiny.encode("<eos>a", add_bos=False) == _ids("<eos>", "a")
    for text in ("abc ab  c\n\nzé ü", " leading", "trailing ", "a\tb"):
        assert tiny.decode(tiny.encode(text, add_bos=False)) == text
    assert tiny.decode(tiny.encode("ab"), skip_special_tokens=True) == "ab"


def test_space_prefix_when_the_gguf_asks(tmp_path):
    tok = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "p.gguf", add_bos=False, add_space_prefix=True))
    assert tok.encode("ab") == _ids("▁ab")
    assert tok.decode(tok.encode("ab")) == "ab"


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M (the real 262,144-piece vocabulary)

TEXTS = ["The capital of France is Paris.", "Hello  world\n\nfoo\tbar  ", "naïve café 東京 🦙 ∑ ÀÉÎÕÜ ß",
         " leading space", "   three leading", "x\n\n\n  y", "<b>bold</b> and </div>", "1234567 + 89 = 3.14159",
         "\u200b zero-width\r\nCRLF", "def f(x):\n    return x  # indented"]


@pytest.fixture(scope="module")
def gemma():
    return load_tokenizer("gemma3-270m")


@pytest.mark.slow
def test_gemma_bos_vocabulary_and_round_trip(gemma):
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.vocab_size) == (2, 1, True, 262144)
    ids = gemma.encode("The capital of France is Paris.")
    assert [gemma.backend.id_to_token(i) for i in ids] == \
        ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    for word in ("▁the", "▁and", "▁language", "▁because", "ing"):  # common words: one piece each
        assert gemma.encode(word.replace("▁", " "), add_bos=False) == [gemma.token_id(word)]
    assert gemma.encode("<start_of_turn>user\n", add_bos=False)[0] == gemma.token_id("<start_of_turn>") == 105
    for text in TEXTS:
        assert gemma.decode(gemma.encode(text, add_bos=False)) == text
        assert gemma.decode(gemma.encode(text), skip_special_tokens=True) == text
    # indentation runs are Gemma's USER_DEFINED space pieces, matched whole (as llama.cpp does)
    assert [gemma.backend.id_to_token(i) for i in gemma.encode("a    b", add_bos=False)] == ["a", "    ", "b"]


def _sentencepiece_reference(path):
    import sentencepiece as spm  # the reference implementation, from the test extra
    from sentencepiece import sentencepiece_model_pb2 as pb

    from shared_math.models import gguf_field, open_gguf

    reader = open_gguf(path)
    unk = int(reader.fields["tokenizer.ggml.unknown_token_id"].contents())
    proto = pb.ModelProto()
    for i, (piece, score, kind) in enumerate(zip(gguf_field(reader, "tokenizer.ggml.tokens"),
                                                 gguf_field(reader, "tokenizer.ggml.scores"),
                                                 gguf_field(reader, "tokenizer.ggml.token_type"))):
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, float(score), 2 if i == unk else int(kind)
    spec = proto.trainer_spec
    spec.model_type, spec.byte_fallback = pb.TrainerSpec.BPE, True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = unk, 2, 1, 0
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces, norm.escape_whitespaces = \
        "identity", False, False, True
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor


@pytest.mark.slow
def test_gemma_matches_sentencepiece_on_real_text(gemma):
    from calibration.data import documents
    from shared_math.models import resolve_model_path

    reference = _sentencepiece_reference(resolve_model_path("gemma3-270m"))
    texts = TEXTS + [d for source in ("wiki", "shakespeare", "kjv") for d in documents(source, "evaluation")[:40]]
    texts = [re.sub(" {2,}", " ", t) for t in texts]  # space runs: see the module docstring
    differ = [t for t in texts if gemma.encode(t, add_bos=False) != reference.encode(t)]
    assert not differ, f"{len(differ)} of {len(texts)} texts differ, e.g. {differ[0][:80]!r}"
    assert np.sum([len(t) for t in texts]) > 100_000
