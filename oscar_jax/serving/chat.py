"""The model's chat template, read from its tokenizer metadata and rendered with jinja2.

Where the template lives: a GGUF's `tokenizer.chat_template` field, or `chat_template` in an HF
directory's tokenizer_config.json. It is rendered as transformers renders it — a sandboxed
jinja2 environment, `trim_blocks` and `lstrip_blocks`, `raise_exception`, the special tokens as
`bos_token` / `eos_token`, and `add_generation_prompt`. A model without a template whose
vocabulary has ChatML's tokens is served with ChatML (`oscar_jax.tokenizer.Tokenizer.
apply_chat_template`, SmolLM2's); any other model without one has no chat (Gemma 3 270M, a base
model): rendering names the model's lack and the flag that supplies a template (`--chat-template`,
as vLLM's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or failed to render."""


def read_template_file(path: str | os.PathLike) -> str:
    """A chat template from a file (--chat-template): jinja2 text, checked to parse."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {str(path)!r} does not exist")
    try:
        template = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--chat-template {str(path)!r} is not UTF-8 text ({err})") from err
    if not template.strip():
        raise ValueError(f"--chat-template {str(path)!r} is empty")
    return template


def read_chat_template(model_path: str | os.PathLike) -> str | None:
    """The chat template in a .gguf file's or an HF directory's tokenizer metadata, if any."""
    path = Path(model_path)
    if path.is_dir():
        config = path / "tokenizer_config.json"
        if not config.is_file():
            return None
        template = json.loads(config.read_text()).get("chat_template")
    else:
        from oscar_jax.loaders import gguf_field, open_gguf

        template = gguf_field(open_gguf(path), "tokenizer.chat_template", "", path=path)
    return template if isinstance(template, str) and template else None


CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def speaks_chatml(tokenizer) -> bool:
    """Whether ChatML's delimiters are single tokens of this tokenizer (else ChatML text would be
    plain characters the model never saw in a conversation)."""
    backend = getattr(tokenizer, "backend", None)
    return backend is not None and all(backend.token_to_id(t) is not None for t in CHATML_TOKENS)


class ChatTemplate:
    def __init__(self, template: str | None, tokenizer):
        self.tokenizer = tokenizer
        self.source = template
        self.available = template is not None or speaks_chatml(tokenizer)
        self._compiled = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._compiled = env.from_string(template)
            except jinja2.TemplateError as err:
                raise ValueError(f"the model's chat template does not parse: {err}") from err

    def _token(self, token_id):
        return self.tokenizer.decode([token_id]) if token_id is not None else ""

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation ([{"role": ..., "content": ...}, ...])."""
        if not self.available:
            raise TemplateError("this model has no chat template in its tokenizer metadata and does not speak ChatML")
        if self._compiled is None:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._token(self.tokenizer.bos_id),
                                         eos_token=self._token(self.tokenizer.eos_id))
        except TemplateError:
            raise
        except jinja2.TemplateError as err:
            raise TemplateError(f"the chat template failed on these messages: {err}") from err


def _raise(message):
    raise TemplateError(f"the chat template rejected the messages: {message}")
