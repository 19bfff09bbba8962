"""Tokenizer built with the `tokenizers` library from a GGUF vocabulary or an HF tokenizer.json.

From a GGUF (`tokenizer.ggml.model == "gpt2"`, byte-level BPE as SmolLM2 uses): the vocabulary
is `tokenizer.ggml.tokens` (id = index), merges `tokenizer.ggml.merges` ("a b" strings, in rank
order), special tokens are the CONTROL entries of `tokenizer.ggml.token_type`. The pre-tokenizer
follows `tokenizer.ggml.pre`: "smollm" / "starcoder" split every digit on its own and then apply
GPT-2's byte-level regex (what SmolLM2's tokenizer.json does); "gpt2" / "default" apply the
regex only. Other pre-tokenizers (llama-bpe, qwen2, ...) use different regexes: load those
models from an HF directory, whose tokenizer.json carries the exact pipeline.

From a GGUF with `tokenizer.ggml.model == "llama"` (SentencePiece BPE, as Gemma 3 uses): the GGUF
holds pieces and scores, no merges. SentencePiece's BPE repeatedly merges the adjacent pair of
symbols whose concatenation is a vocabulary piece of the highest score (leftmost on ties); the
same result comes from a `tokenizers` BPE whose merges are every split (a, b) of every NORMAL
piece a + b with a and b in the vocabulary, ranked by the score of a + b (`_spm_merges`). Spaces
become "▁" (no dummy prefix unless `tokenizer.ggml.add_space_prefix`), characters outside the
vocabulary fall back to their UTF-8 byte pieces <0xNN> (BYTE entries), CONTROL entries (<bos>,
<eos>, <start_of_turn>, ...) are special tokens and USER_DEFINED entries ("\\n\\n", runs of
spaces or tabs, HTML tags) are matched whole in the raw text before anything else, as
SentencePiece's prefix matcher does. BOS is prepended when `tokenizer.ggml.add_bos_token` says
so (Gemma: true, <bos> = 2).

Chat format (ChatML, SmolLM2's template): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
message, then `<|im_start|>assistant\\n` to prompt a reply. When the model's own template inserts
a default system message (SmolLM2's does: "You are a helpful AI assistant named SmolLM, ..."),
it is prepended whenever the conversation does not start with a system message.

Backend-neutral (the `tokenizers` library and shared_math.models): both runtimes and a PyTorch
user load the tokenizer here without importing JAX.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as _HFTokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from shared_math.models import gguf_field, open_gguf, resolve_model_path

_NORMAL = 1  # gguf.TokenType.NORMAL
_CONTROL = 3  # gguf.TokenType.CONTROL
_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_DIGIT_SPLITTING_PRE = ("smollm", "starcoder")
_REGEX_ONLY_PRE = ("gpt2", "default")
# The default system turn inside a ChatML template, as SmolLM2 writes it.
# A literal only: no quotes or braces, so "'<|im_start|>system\n' + messages[0]..." never matches.
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n([^'\"{}]*?)<\|im_end\|>")


def _gguf_special_tokens(reader, path) -> dict:
    """bos_id, eos_id (None where the GGUF names none) and add_bos, as the GGUF's metadata states."""
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    return dict(bos_id=int(bos.contents()) if bos is not None else None,
                eos_id=int(eos.contents()) if eos is not None else None,
                add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False, path=path)))


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(self, backend: _HFTokenizer, *, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False, default_system_prompt: str | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.default_system_prompt = default_system_prompt

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        found = self.backend.token_to_id(token)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return found

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """ChatML text for `messages` ([{"role": ..., "content": ...}, ...])."""
        for message in messages:
            if not (isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
                raise ValueError(f"each message needs 'role' and 'content' strings, got {message!r}")
        parts = []
        if self.default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
            parts.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        reader = open_gguf(path)
        kind = gguf_field(reader, "tokenizer.ggml.model", path=path)
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default", path=path)
        if kind == "llama":
            return cls._from_gguf_sentencepiece(reader, path)
        if kind != "gpt2":
            raise NotImplementedError(
                f"{str(path)!r}: tokenizer model {kind!r} is not supported (gpt2 byte-level BPE, "
                "llama SentencePiece BPE)"
            )
        if pre not in _DIGIT_SPLITTING_PRE + _REGEX_ONLY_PRE:
            raise NotImplementedError(
                f"{str(path)!r}: pre-tokenizer {pre!r} is not supported from GGUF "
                f"({_DIGIT_SPLITTING_PRE + _REGEX_ONLY_PRE}); load the HF directory instead"
            )
        tokens = gguf_field(reader, "tokenizer.ggml.tokens", path=path)
        merges = [tuple(m.split(" ")) for m in gguf_field(reader, "tokenizer.ggml.merges", path=path)]
        types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens), path=path)
        backend = _HFTokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in _DIGIT_SPLITTING_PRE else byte_level
        )
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind_id in enumerate(types) if kind_id in (_CONTROL, _USER_DEFINED)
        ])
        template = gguf_field(reader, "tokenizer.chat_template", "", path=path)
        return cls(backend, **_gguf_special_tokens(reader, path),
                   default_system_prompt=_default_system_prompt(template))

    @classmethod
    def _from_gguf_sentencepiece(cls, reader, path) -> "Tokenizer":
        """The `tokenizer.ggml.model == "llama"` kind: SentencePiece BPE from pieces and scores."""
        tokens = list(gguf_field(reader, "tokenizer.ggml.tokens", path=path))
        scores = list(gguf_field(reader, "tokenizer.ggml.scores", path=path))
        types = list(gguf_field(reader, "tokenizer.ggml.token_type", path=path))
        if not len(tokens) == len(scores) == len(types):
            raise ValueError(f"{str(path)!r}: {len(tokens)} tokens, {len(scores)} scores, {len(types)} token types")
        vocab = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)  # a repeated piece keeps its first id, as SentencePiece does
        unk = reader.fields.get("tokenizer.ggml.unknown_token_id")
        unk_token = tokens[int(unk.contents())] if unk is not None else None
        backend = _HFTokenizer(BPE(vocab, _spm_merges(tokens, scores, types, vocab), unk_token=unk_token,
                                   fuse_unk=True, byte_fallback=True))
        prefix = bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", False, path=path))
        steps = ([normalizers.Prepend(_SPM_SPACE)] if prefix else []) + [normalizers.Replace(" ", _SPM_SPACE)]
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence(
            [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _USER_DEFINED])
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == _CONTROL])
        return cls(backend, **_gguf_special_tokens(reader, path))

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{str(path)!r} does not exist")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as err:
            raise ValueError(f"{str(path)!r} is not a readable tokenizer.json ({err})") from err
        settings = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            settings = json.loads(config_path.read_text())

        def token_id(key):
            token = settings.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if token else None

        template = settings.get("chat_template") or ""
        if not isinstance(template, str):
            template = ""
        return cls(backend, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
                   add_bos=bool(settings.get("add_bos_token", False)),
                   default_system_prompt=_default_system_prompt(template))


def _spm_merges(tokens, scores, types, vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven BPE: every split (a, b) of a NORMAL
    piece a + b whose halves are both vocabulary pieces, ranked by the score of a + b (highest
    first; ties by the merged piece's id, then by the left half's length)."""
    ranked = []
    for i, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        if kind != _NORMAL or len(piece) < 2 or vocab.get(piece) != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(score), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _default_system_prompt(template: str) -> str | None:
    """The system turn a ChatML template inserts by itself (SmolLM2's does), else None."""
    match = _DEFAULT_SYSTEM.search(template)
    return match.group(1) if match else None


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """Tokenizer for a known model name, a .gguf file, or an HF directory with tokenizer.json."""
    path = resolve_model_path(name_or_path)
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)
