"""Chat templates: where they are read from, ChatML for tokenizers that speak it, and a clear
refusal for models with neither (Gemma 3 270M's GGUF has no template)."""

import asyncio
import json
import types

import httpx
import pytest

from oscar_jax.serving.chat import ChatTemplate, TemplateError, read_chat_template, read_template_file
from shared_math.tokenizer import load_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def _gguf(path, template=None):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class _Vocab:
    """A tokenizer whose vocabulary holds the given strings (the only thing ChatML support asks)."""

    def __init__(self, *tokens):
        self.backend = types.SimpleNamespace(token_to_id=lambda t: tokens.index(t) if t in tokens else None)
        self.bos_id = self.eos_id = None

    def decode(self, ids):
        return ""


def test_read_chat_template_from_gguf_and_hf_dirs(tmp_path):
    assert read_chat_template(_gguf(tmp_path / "none.gguf")) is None
    assert read_chat_template(_gguf(tmp_path / "one.gguf", "{{ messages[0].content }}")) == "{{ messages[0].content }}"
    hf = tmp_path / "hf"
    hf.mkdir()
    assert read_chat_template(hf) is None  # no tokenizer_config.json
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X"}))
    assert read_chat_template(hf) == "X"


def test_without_a_template_chatml_only_for_tokenizers_that_speak_it():
    smollm2 = load_tokenizer("smollm2-135m")  # its vocabulary has ChatML's delimiters
    chat = ChatTemplate(None, smollm2)
    assert chat.available and chat.render(MESSAGES).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    plain = ChatTemplate(None, _Vocab("a", "<|im_start|>"))  # one delimiter is not ChatML
    assert not plain.available
    with pytest.raises(TemplateError, match="no chat template in its tokenizer metadata and does not speak ChatML"):
        plain.render(MESSAGES)
    given = ChatTemplate("<turn>{{ messages[0].content }}", _Vocab())  # a template makes chat available
    assert given.available and given.render(MESSAGES) == "<turn>hi"


def test_template_files_are_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jinja"):
        read_template_file(tmp_path / "missing.jinja")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty.jinja' is empty"):
        read_template_file(tmp_path / "empty.jinja")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="binary.jinja' is not UTF-8"):
        read_template_file(tmp_path / "binary.jinja")
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="chat template does not parse"):
        ChatTemplate(read_template_file(tmp_path / "bad.jinja"), _Vocab())


def test_chat_request_to_a_model_without_chat_is_a_400_naming_the_way_out():
    from oscar_jax.serving.server import Server, create_app

    engine = types.SimpleNamespace(engine=types.SimpleNamespace(max_model_len=64))  # never reached
    app = create_app(Server(engine, _Vocab(), ChatTemplate(None, _Vocab()), "base-model"))

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={"model": "base-model", "messages": MESSAGES})

    response = asyncio.run(post())
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "does not speak ChatML" in message and "--chat-template FILE" in message and "/v1/completions" in message
