"""The text sources, the calibration / evaluation split and token packing."""

import numpy as np
import pytest

from calibration.data import pack_tokens, sequences, split_of, text_file_documents


def test_split_is_a_pure_function_of_the_title():
    titles = [f"title {i}" for i in range(2000)]
    splits = [split_of(t) for t in titles]
    assert splits == [split_of(t) for t in titles]
    share = splits.count("evaluation") / len(splits)
    assert 0.07 < share < 0.13  # one title in ten, by hash


def test_pack_tokens_and_sequences():
    tokenize = lambda text: [len(w) for w in text.split()]  # noqa: E731
    tokens = pack_tokens(["a bb ccc", "dddd"], tokenize, 0, num_tokens=5)
    assert tokens.tolist() == [1, 2, 3, 0, 4] and tokens.dtype == np.int32
    assert [s.tolist() for s in sequences(np.arange(5), 2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="holds 6 tokens, fewer than the 7 requested"):
        pack_tokens(["a bb ccc", "dddd"], tokenize, 0, num_tokens=7)
    with pytest.raises(ValueError, match="num_tokens=0"):
        pack_tokens(["a"], tokenize, 0, num_tokens=0)


def test_text_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        text_file_documents(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not UTF-8"):
        text_file_documents(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="holds no text"):
        text_file_documents(empty)
    good = tmp_path / "good.txt"
    good.write_text("one\ntwo\n\nthree")
    assert text_file_documents(good) == ["one\ntwo", "three"]
