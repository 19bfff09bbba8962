"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn, as vLLM and SGLang serve).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream=true: server-
sent events, `data: {chunk}` ... `data: [DONE]`), GET /health, GET /metrics (Prometheus).

Request fields follow OpenAI's API plus vLLM's extensions: max_tokens (max_completion_tokens for
chat), temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, stream,
stream_options.include_usage, return_token_ids (the prompt's and the output's token ids in each
choice), and cache_salt — the tenant whose prefix cache the request may use (requests with
different salts never share cache pages).

Errors are OpenAI's JSON object {"error": {"message", "type", "param", "code"}}: 404 for an
unknown model or route, 422 for a field of the wrong type, 400 for everything else a client can
get wrong (invalid JSON, a value out of range, a prompt too long for --max-model-len, an
unsupported option); each message names the value it rejects. A client that disconnects loses
its request: it is aborted and its pages freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from oscar_jax.serving.async_engine import AsyncEngine, EngineFailure
from oscar_jax.serving.chat import ChatTemplate, TemplateError
from oscar_jax.serving.engine import RequestOutput
from oscar_jax.serving.metrics import CONTENT_TYPE_LATEST
from oscar_jax.serving.sampling import MAX_TEMPERATURE, SamplingParams

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.kind, self.code)


def error_response(status: int, message: str, param=None, kind="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


# ---------------------------------------------------------------------------------------- fields

_MISSING = object()
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def _type_name(value) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


def _field(body: dict, name: str, kind, default=_MISSING, *, nullable: bool = True):
    """body[name] checked against `kind` (int, float, bool, str, list, dict): 422 naming the field,
    the expected type and the value. JSON null means the default where the field is nullable."""
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and nullable and default is not _MISSING):
        if default is _MISSING:
            raise APIError(400, f"'{name}' is a required property", name)
        return default
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else (
        isinstance(value, int) and not isinstance(value, bool)) if kind is int else isinstance(value, kind)
    if not ok:
        raise APIError(422, f"Invalid type for '{name}': expected {_TYPE_NAMES[kind]}, but got "
                            f"{_type_name(value)} instead ({json.dumps(value)[:80]})", name)
    return value


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise APIError(422, f"Invalid type for '{name}': expected an array of integers, got "
                            f"{json.dumps(value)[:80]}", name)
    return value


def _sampling(body: dict, *, max_tokens_field: str, default_max_tokens: int | None, prompt_len: int,
              max_model_len: int) -> SamplingParams:
    max_tokens = _field(body, max_tokens_field, int, None)
    if max_tokens is None and max_tokens_field == "max_completion_tokens":
        max_tokens = _field(body, "max_tokens", int, None)  # chat accepts the older name too
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max(1, max_model_len - prompt_len)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens} must be at least 1", max_tokens_field)
    temperature = _field(body, "temperature", float, 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"temperature={temperature} must be in [0, {MAX_TEMPERATURE}]", "temperature")
    top_p = _field(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p={top_p} must be in (0, 1]", "top_p")
    top_k = _field(body, "top_k", int, 0)
    if top_k < -1:
        raise APIError(400, f"top_k={top_k} must be -1 or 0 (off) or a positive integer", "top_k")
    seed = _field(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise APIError(400, f"seed={seed} must be in [0, 2**63)", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(422, f"Invalid type for 'stop': expected a string or an array of strings, got "
                            f"{json.dumps(stop)[:80]}", "stop")
    if any(not s for s in stop):
        raise APIError(400, f"stop={stop} must not contain an empty string", "stop")
    stop_ids = _int_list(_field(body, "stop_token_ids", list, []), "stop_token_ids")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        value = _field(body, name, float, neutral)
        if value != neutral:
            raise APIError(400, f"{name}={value} is not supported (only {neutral})", name)
    n = _field(body, "n", int, 1)
    if n != 1:
        raise APIError(400, f"n={n} is not supported (one choice per prompt)", "n")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False):
        raise APIError(400, f"logprobs={json.dumps(logprobs)} is not supported", "logprobs")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                          seed=seed, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                          ignore_eos=_field(body, "ignore_eos", bool, False))


# ---------------------------------------------------------------------------------------- app


class Server:
    """The routes' shared state: engine, tokenizer, chat template, names and limits."""

    def __init__(self, engine: AsyncEngine, tokenizer, chat_template: ChatTemplate, model_name: str):
        self.engine, self.tokenizer, self.chat, self.model_name = engine, tokenizer, chat_template, model_name
        self.max_model_len = engine.engine.max_model_len
        self.created = int(time.time())

    def check_model(self, body: dict) -> None:
        model = _field(body, "model", str)
        if model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist (this server serves '{self.model_name}')",
                           "model", "NotFoundError", "model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int, field: str) -> None:
        if not ids:
            raise APIError(400, f"'{field}' is empty: the prompt needs at least one token", field)
        if len(ids) > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"has {len(ids)} tokens (--max-model-len={self.max_model_len})", field)
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; you asked "
                                f"for {len(ids) + max_tokens} ({len(ids)} in the prompt, max_tokens={max_tokens})",
                           "max_tokens")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON ({err}): {raw[:80]!r}") from err
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {_type_name(body)}")
    return body


def _completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise APIError(400, "'prompt' is a required property", "prompt")
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) for p in prompt):
            return [_int_list(p, "prompt") for p in prompt]
    raise APIError(422, "Invalid type for 'prompt': expected a string, an array of strings, an array of token "
                        f"ids or an array of such arrays, got {json.dumps(prompt)[:80]}", "prompt")


def _chat_messages(body: dict) -> list[dict[str, str]]:
    messages = _field(body, "messages", list)
    if not messages:
        raise APIError(400, "'messages' is empty: it needs at least one message", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(422, f"Invalid type for '{where}': expected an object, got {json.dumps(message)[:80]}", where)
        role = message.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"'{where}.role'={json.dumps(role)} must be one of system, user, assistant, "
                                "developer, tool", f"{where}.role")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"'{where}.content' part {json.dumps(part)[:80]} is not supported "
                                        "(text parts only)", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise APIError(422, f"Invalid type for '{where}.content': expected a string or an array of text "
                                f"parts, got {json.dumps(content)[:80]}", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(o.prompt_tokens for o in outputs)
    completion = sum(o.completion_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outputs)}}


def _sse(payload) -> bytes:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n".encode()


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="OSCAR-JAX", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "NotFoundError" if err.status_code == 404 else "invalid_request_error"
        detail = f"{request.method} {request.url.path}: {err.detail}"
        return error_response(err.status_code, detail, kind=kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return error_response(422, str(err))

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return error_response(503, "the engine thread is not running", kind="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "oscar-jax",
            "root": server.model_name, "max_model_len": server.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        server.check_model(body)
        prompts = _completion_prompts(body, server.tokenizer)
        if _field(body, "echo", bool, False):
            raise APIError(400, "echo=true is not supported", "echo")
        if _field(body, "suffix", str, None) is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        params = _sampling(body, max_tokens_field="max_tokens", default_max_tokens=16,
                           prompt_len=max(len(p) for p in prompts), max_model_len=server.max_model_len)
        for ids in prompts:
            server.check_prompt(ids, params.max_tokens, "prompt")
        return await _respond(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        server.check_model(body)
        messages = _chat_messages(body)
        add_generation_prompt = _field(body, "add_generation_prompt", bool, True)
        try:
            text = server.chat.render(messages, add_generation_prompt=add_generation_prompt)
        except TemplateError as err:
            hint = "" if server.chat.available else ": use /v1/completions, or start the server with --chat-template FILE"
            raise APIError(400, f"{err}{hint}", "messages") from err
        ids = server.tokenizer.encode(text)
        params = _sampling(body, max_tokens_field="max_completion_tokens", default_max_tokens=None,
                           prompt_len=len(ids), max_model_len=server.max_model_len)
        server.check_prompt(ids, params.max_tokens, "messages")
        return await _respond(request, body, [ids], params, chat=True)

    async def _respond(request: Request, body: dict, prompts: list[list[int]], params: SamplingParams, *, chat: bool):
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        include_usage = bool(options.get("include_usage", False))
        tenant = _field(body, "cache_salt", str, None)
        return_ids = _field(body, "return_token_ids", bool, False)  # vLLM's extension
        kind = "chatcmpl" if chat else "cmpl"
        call_id = f"{kind}-{uuid.uuid4().hex}"
        ids = [f"{call_id}-{i}" for i in range(len(prompts))]
        queue: asyncio.Queue = asyncio.Queue()
        live: set[str] = set()
        try:
            for request_id, prompt in zip(ids, prompts):
                live.add(request_id)
                try:
                    await server.engine.add(prompt, params, request_id, tenant, queue)
                except ValueError as err:
                    raise APIError(400, str(err), "prompt" if not chat else "messages") from err
        except BaseException:
            for request_id in live:
                server.engine.abort(request_id)
            raise
        index = {request_id: i for i, request_id in enumerate(ids)}
        header = dict(id=call_id, created=int(time.time()), model=server.model_name)

        async def outputs() -> AsyncIterator[RequestOutput]:
            while live:
                try:
                    item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if not stream and await request.is_disconnected():
                        return
                    continue
                if isinstance(item, EngineFailure):
                    live.discard(item.request_id)
                    raise APIError(500, f"the engine failed while serving this request: {item.message}",
                                   kind="server_error")
                if item.finished:
                    live.discard(item.request_id)
                yield item

        def abort_live():
            for request_id in list(live):
                server.engine.abort(request_id)
            live.clear()

        if not stream:
            texts = [""] * len(ids)
            token_ids: list[list[int]] = [[] for _ in ids]
            finals: dict[str, RequestOutput] = {}
            try:
                async for out in outputs():
                    texts[index[out.request_id]] += out.text
                    token_ids[index[out.request_id]] += out.token_ids
                    if out.finished:
                        finals[out.request_id] = out
            finally:
                abort_live()  # the client went away (or the handler was cancelled): free the pages
            if len(finals) < len(ids):
                return Response(status_code=499)  # nobody is listening
            done = [finals[r] for r in ids]
            if chat:
                choices = [{"index": 0, "message": {"role": "assistant", "content": texts[0]}, "logprobs": None,
                            "finish_reason": done[0].finish_reason}]
            else:
                choices = [{"index": i, "text": texts[i], "logprobs": None, "finish_reason": o.finish_reason}
                           for i, o in enumerate(done)]
            if return_ids:
                for choice, prompt, out_ids in zip(choices, prompts, token_ids):
                    choice.update(prompt_token_ids=prompt, token_ids=out_ids)
            if chat:
                return {"object": "chat.completion", **header, "choices": choices, "usage": _usage(done)}
            return {"object": "text_completion", **header, "choices": choices, "usage": _usage(done)}

        async def events() -> AsyncIterator[bytes]:
            finals = []
            obj = "chat.completion.chunk" if chat else "text_completion"
            try:
                if chat:
                    yield _sse({"object": obj, **header, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
                async for out in outputs():
                    if not (out.text or out.finished or (return_ids and out.token_ids)):
                        continue
                    i = index[out.request_id]
                    if chat:
                        delta = {"content": out.text} if out.text else {}
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason}
                    else:
                        choice = {"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
                    if return_ids:
                        choice["token_ids"] = out.token_ids
                    yield _sse({"object": obj, **header, "choices": [choice]})
                    if out.finished:
                        finals.append(out)
                if include_usage:
                    yield _sse({"object": obj, **header, "choices": [], "usage": _usage(finals)})
            except APIError as err:
                yield _sse({"error": {"message": err.message, "type": err.kind, "param": None, "code": None}})
            finally:
                abort_live()  # a disconnect cancels this generator: abort what is still running
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
