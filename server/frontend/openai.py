"""An OpenAI-compatible front on the HTTP port: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true`` as server-sent events) and ``/v1/embeddings``, over
models that follow Triton's conventions for text, as Triton's OpenAI frontend does.

- Generation: the model takes ``text_input`` (BYTES) and gives ``text_output`` (BYTES); a
  decoupled model streams its pieces. ``max_tokens``, ``stream``, ``temperature``, ``top_p``,
  ``seed`` and ``stop`` reach the model as inputs of those names where its config declares them,
  else as request parameters (``request.parameters()`` in a Python model). The request travels the
  generate extension's path (generate.py), so the worker cannot tell the two apart.
- Chat: the messages become one prompt, a line ``<role>: <content>`` each and ``assistant:``
  last (no tokenizer or chat template is applied), unless the model declares a ``messages``
  input, which then gets the messages as JSON.
- Embeddings: the model's first BYTES input gets each text, its first output is the vector.

Token counts in ``usage`` are the number of pieces the model sent (its own tokens), and the
prompt's whitespace-separated words: shmserve has no tokenizer of the model.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shmserve.shm.streams import StreamEvents

from .codec import BadRequest, parse_json
from .disconnect import ClientGone, unless_gone
from .generate import build_generate_request, output_values
from .link import BrokerError, BrokerLink

JSON = "application/json"
FORWARDED = ("max_tokens", "stream", "temperature", "top_p", "seed", "stop")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
INT32_MAX, INT64_MIN, INT64_MAX = (1 << 31) - 1, -(1 << 63), (1 << 63) - 1
# Each checked field's accepted values, as OpenAI's API reference gives them (null: left out).
INTEGERS = {"max_tokens": (1, INT32_MAX), "max_completion_tokens": (1, INT32_MAX), "n": (1, 1),
            "seed": (INT64_MIN, INT64_MAX), "top_logprobs": (0, 20)}
NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
           "frequency_penalty": (-2.0, 2.0)}
BOOLEANS = ("stream", "echo", "logprobs")


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    return Response(orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}),
                    status_code=status, media_type=JSON)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OpenAIFront:
    """The /v1 routes of one HTTP frontend, on its broker link."""

    def __init__(self, link: BrokerLink) -> None:
        self.link = link

    async def models(self, request: Request) -> Response:
        status, index = await self.link.control({"op": "repository_index", "ready": True})
        if status != 200:
            return openai_error(status, "the model index is not available", "server_error")
        names = sorted({m["name"] for m in index})
        created = int(time.time())
        return Response(orjson.dumps({"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "shmserve"} for n in names]}),
            media_type=JSON)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        try:
            body = await _body(request)
            model, config = await self._model(body)
            texts = body.get("input")
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise OpenAIError(400, "'input' must be a string or a list of strings")
            text_input = next((t["name"] for t in config.get("input", []) if t.get("data_type") == "TYPE_STRING"),
                              None)
            if text_input is None:
                raise OpenAIError(400, f"model '{model}' has no BYTES input to embed text with")
            data = []
            for i, text in enumerate(texts):
                pieces = await unless_gone(self._collect(self._start(model, {text_input: text}, config)),
                                           request.receive)
                if len(pieces) != 1:
                    raise OpenAIError(500, f"model '{model}' gave {len(pieces)} responses for one text")
                vector = next(iter(pieces[0].values()), [])
                data.append({"object": "embedding", "index": i,
                             "embedding": vector if isinstance(vector, list) else [vector]})
        except OpenAIError as e:
            return openai_error(e.status, str(e))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        words = sum(len(t.split()) for t in texts)
        return Response(orjson.dumps({"object": "list", "data": data, "model": model,
                                      "usage": {"prompt_tokens": words, "total_tokens": words}}), media_type=JSON)

    # -- generation -----------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await _body(request)
            model, config = await self._model(body)
            inputs = {t["name"] for t in config.get("input", [])}
            doc = _generate_doc(body, chat, inputs)
            events = self._start(model, doc, config)
        except OpenAIError as e:
            return openai_error(e.status, str(e))
        reply = _Reply(model, chat, prompt_words=len(str(doc.get("text_input", "")).split()))
        if body.get("stream"):
            return StreamingResponse(self._sse(events, reply), media_type="text/event-stream")
        try:
            pieces = await unless_gone(self._collect(events), request.receive)
        except OpenAIError as e:
            return openai_error(e.status, str(e))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        text = "".join(_text(p) for p in pieces)
        return Response(orjson.dumps(reply.whole(text, len(pieces), body.get("max_tokens"))), media_type=JSON)

    async def _sse(self, events: StreamEvents, reply: "_Reply") -> AsyncIterator[bytes]:
        count = 0
        try:
            if reply.chat:
                yield _event(reply.chunk({"role": "assistant", "content": ""}, None))
            while True:
                final, completion, _ = await events.events.get()
                try:
                    doc = completion.doc()
                    if completion.status != 200:
                        yield _event({"error": {"message": doc.get("error", "inference failed"),
                                                "type": "server_error", "param": None, "code": None}})
                        return
                    piece = None if final and not doc.get("outputs") else \
                        _text(output_values(doc, completion.tensor))
                finally:
                    completion.release()
                if piece:
                    count += 1
                    yield _event(reply.chunk({"content": piece} if reply.chat else piece, None))
                if final:
                    break
            yield _event(reply.chunk({} if reply.chat else "", "stop"))
            yield b"data: [DONE]\n\n"
        finally:
            events.close()

    async def _model(self, body: dict) -> tuple[str, dict]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "'model' must name a model")
        try:
            status, config = await self.link.control({"op": "model_config", "model": model, "version": ""})
        except BrokerError as e:
            raise OpenAIError(e.status, str(e)) from None
        if status != 200:
            raise OpenAIError(status, config.get("error", f"The model '{model}' does not exist"))
        return model, config

    def _start(self, model: str, doc: dict, config: dict) -> StreamEvents:
        try:
            req, chunks = build_generate_request(model, "", doc, config)
            return self.link.stream(req, chunks)
        except BadRequest as e:
            raise OpenAIError(e.status, str(e)) from None
        except BrokerError as e:
            raise OpenAIError(e.status, str(e)) from None

    async def _collect(self, events: StreamEvents) -> list[dict]:
        """Every response of a request, each as {output name: values}; an error raises."""
        pieces: list[dict] = []
        error = None
        try:
            while True:
                final, completion, _ = await events.events.get()
                try:
                    doc = completion.doc()
                    if completion.status != 200:
                        error = error or OpenAIError(completion.status, doc.get("error", "inference failed"))
                    elif doc.get("outputs"):
                        pieces.append(output_values(doc, completion.tensor))
                finally:
                    completion.release()
                if final:
                    break
        finally:
            events.close()
        if error is not None:
            raise error
        return pieces


class _Reply:
    """The OpenAI objects of one generation: a whole answer, or the chunks of a stream."""

    def __init__(self, model: str, chat: bool, prompt_words: int) -> None:
        self.model, self.chat, self.prompt_words = model, chat, prompt_words
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def whole(self, text: str, pieces: int, max_tokens: Any) -> dict:
        finish = "length" if isinstance(max_tokens, int) and pieces >= max_tokens > 0 else "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {"prompt_tokens": self.prompt_words, "completion_tokens": pieces,
                 "total_tokens": self.prompt_words + pieces}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage}

    def chunk(self, delta: Any, finish: str | None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}


async def _body(request: Request) -> dict:
    try:
        body = parse_json(await request.body())
    except BadRequest as e:
        raise OpenAIError(400, str(e)) from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request must be a JSON object")
    check_fields(body)
    return body


def check_fields(body: dict) -> None:
    """Refuse a field of the wrong type or out of its range (``INTEGERS``, ``NUMBERS``,
    ``BOOLEANS``; ``stop``), as OpenAI does: nothing unchecked reaches a model's typed input."""
    for key, (low, high) in INTEGERS.items():
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            if key == "n":
                raise OpenAIError(400, "only n=1 is supported")
            raise OpenAIError(400, f"'{key}' must be an integer from {low} to {high}")
    for key, (lo, hi) in NUMBERS.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not lo <= value <= hi):
            raise OpenAIError(400, f"'{key}' must be a number from {lo:g} to {hi:g}")
    for key in BOOLEANS:
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise OpenAIError(400, f"'{key}' must be a boolean (true or false)")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and 0 < len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise OpenAIError(400, "'stop' must be a string or a list of 1 to 4 strings")


def _generate_doc(body: dict, chat: bool, inputs: set[str]) -> dict:
    """The generate extension's request for an OpenAI one (see the module's docstring)."""
    doc: dict[str, Any] = {}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            raise OpenAIError(400, "'messages' must be a list of {role, content} objects")
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise OpenAIError(400, f"messages[{i}]: 'role' must be one of {', '.join(ROLES)}, "
                                       f"not {orjson.dumps(m.get('role')).decode()[:64]}")
        if "messages" in inputs:
            doc["messages"] = orjson.dumps(messages).decode()
        else:
            lines = [f"{m['role']}: {m.get('content', '')}" for m in messages]
            doc["text_input"] = "\n".join(lines + ["assistant:"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError(400, "'prompt' must be a string (one prompt per request)")
        doc["text_input"] = prompt
    for key in FORWARDED:
        value = body.get(key)
        if value is None:
            continue
        if key == "stop" and isinstance(value, list):
            value = value[0] if len(value) == 1 else orjson.dumps(value).decode()
        doc[key] = value if key in inputs or isinstance(value, (bool, int, float, str)) else str(value)
    return doc


def _text(outputs: dict) -> str:
    value = outputs.get("text_output", "")
    return "".join(value) if isinstance(value, list) else str(value)


def _event(doc: dict) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"
