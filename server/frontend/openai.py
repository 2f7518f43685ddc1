"""An OpenAI-compatible front on the HTTP port: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true`` as server-sent events) and ``/v1/embeddings``, over
models that follow Triton's conventions for text, as Triton's OpenAI frontend does.

- Generation: the model takes ``text_input`` (BYTES) and gives ``text_output`` (BYTES); a
  decoupled model streams its pieces. The sampling fields (``FORWARDED``) reach the model as
  inputs of those names where its config declares them, else as request parameters
  (``request.parameters()`` in a Python model). A field asking for what no model here gives
  (log probabilities, tool calls) is refused by name, and so is one the route does not know. The request travels the
  generate extension's path (generate.py), so the worker cannot tell the two apart.
- Chat: the messages (their content a string or text parts) become one prompt, a line
  ``<role>: <content>`` each and ``assistant:`` last (no tokenizer or chat template is applied), unless the model declares a ``messages``
  input, which then gets the messages as JSON.
- Embeddings: the model's first BYTES input gets each text, its first output is the vector
  (``encoding_format: "base64"``: its float32 values, little-endian, in base64, as OpenAI sends).

A model's kind is read from its config: a generative model gives a BYTES ``text_output`` (and takes
``text_input``, or ``messages`` for chat); an embedding model takes a BYTES input and its first
output is numeric. A route asked for a model of the other kind answers 400 naming the model and why.

Token counts in ``usage`` are the number of pieces the model sent (its own tokens), and the
prompt's whitespace-separated words: shmserve has no tokenizer of the model.
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shmserve.server.edge.link import BrokerError, BrokerLink
from shmserve.server.edge.requests import BadRequest, parse_json
from shmserve.shm import control_messages as control
from shmserve.shm.streams import StreamEvents

from .disconnect import ClientGone, unless_gone
from .generate import build_generate_request, output_values
from .openai_errors import JSON, MODEL_NOT_FOUND, OpenAIError, error_body, error_response

FORWARDED = ("max_tokens", "stream", "temperature", "top_p", "seed", "stop", "presence_penalty",
             "frequency_penalty")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's
INT32_MAX, INT64_MIN, INT64_MAX = (1 << 31) - 1, -(1 << 63), (1 << 63) - 1
# Each checked field's accepted values, as OpenAI's API reference gives them (null: left out).
INTEGERS = {"max_tokens": (1, INT32_MAX), "max_completion_tokens": (1, INT32_MAX), "n": (1, 1),
            "seed": (INT64_MIN, INT64_MAX), "top_logprobs": (0, 20)}
NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
           "frequency_penalty": (-2.0, 2.0)}
BOOLEANS = ("stream", "echo")
# The request fields each route knows (OpenAI's API reference). A field it does not know is refused
# by name, as Triton's OpenAI frontend refuses one (its schemas forbid extra fields); one it knows
# but cannot honour is refused by name too (``check_unsupported``), never taken and ignored.
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "metadata", "store",
          "service_tier"}
KNOWN = {"completions": COMMON | {"prompt", "echo", "suffix", "best_of"},
         "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "functions", "function_call", "response_format", "modalities",
                           "audio", "prediction", "reasoning_effort", "web_search_options"},
         "embeddings": {"model", "input", "encoding_format", "dimensions", "user"}}
ENCODINGS = ("float", "base64")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the texts of one embeddings request


class OpenAIFront:
    """The /v1 routes of one HTTP frontend, on its broker link."""

    def __init__(self, link: BrokerLink) -> None:
        self.link = link
        self.created = int(time.time())  # a model's 'created': when this frontend started

    async def models(self, request: Request) -> Response:
        try:
            names = await self._ready_models()
        except OpenAIError as e:
            return error_response(e)
        return Response(orjson.dumps({"object": "list", "data": [self._model_object(n) for n in names]}),
                        media_type=JSON)

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: one ready model, as ``client.models.retrieve`` parses it."""
        model = request.path_params["model"]
        try:
            if model not in await self._ready_models():
                raise OpenAIError(404, f"The model '{model}' does not exist or is not ready", "model",
                                  MODEL_NOT_FOUND)
        except OpenAIError as e:
            return error_response(e)
        return Response(orjson.dumps(self._model_object(model)), media_type=JSON)

    async def _ready_models(self) -> list[str]:
        try:
            status, index = await self.link.control(control.RepositoryIndex(ready=True))
        except BrokerError as e:
            raise OpenAIError(e.status, str(e)) from None
        if status != 200:  # the server stops (Triton's "Server not ready"), or the broker failed
            error = index.get("error") if isinstance(index, dict) else None
            raise OpenAIError(status if status >= 500 else 503, error or "the model index is not available")
        return sorted({m["name"] for m in index})

    def _model_object(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "shmserve"}

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        try:
            body = await _body(request)
            check_known(body, "embeddings")
            texts, encoding, dimensions = embedding_fields(body)
            model, config = await self._model(body)
            text_input = embedding_input(model, config)
            data = []
            for i, text in enumerate(texts):
                pieces = await unless_gone(self._collect(self._start(model, {text_input: text}, config)),
                                           request.receive)
                if len(pieces) != 1:
                    raise OpenAIError(500, f"model '{model}' gave {len(pieces)} responses for one text")
                vector = next(iter(pieces[0].values()), [])
                vector = [float(v) for v in (vector if isinstance(vector, list) else [vector])]
                if dimensions is not None and dimensions != len(vector):
                    raise OpenAIError(400, f"model '{model}' gives {len(vector)}-dimensional vectors: "
                                           f"'dimensions' must be {len(vector)} or left out", "dimensions")
                data.append({"object": "embedding", "index": i, "embedding": _encoded(vector, encoding)})
        except OpenAIError as e:
            return error_response(e)
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
            check_unsupported(body, chat)
            check_generative(model, config, chat)
            inputs = {t["name"]: t for t in config.get("input", [])}
            doc, prompt_words = _generate_doc(body, chat, inputs)
            events = self._start(model, doc, config)
        except OpenAIError as e:
            return error_response(e)
        usage = bool(body.get("stream") and (body.get("stream_options") or {}).get("include_usage"))
        echoed = body["prompt"] if not chat and body.get("echo") else ""  # (echo: the prompt, then the completion)
        reply = _Reply(model, chat, prompt_words, usage, max_tokens(body), echoed)
        if body.get("stream"):
            try:
                first = await unless_gone(_first_event(events), request.receive)
            except OpenAIError as e:
                return error_response(e)  # refused before the stream began: its status, Retry-After on a 503
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            return _Stream(events, first, lambda take_first: self._sse(events, reply, take_first))
        try:
            pieces = await unless_gone(self._collect(events), request.receive)
        except OpenAIError as e:
            return error_response(e)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        text = "".join(_text(p) for p in pieces)
        return Response(orjson.dumps(reply.whole(text, len(pieces))), media_type=JSON)

    async def _sse(self, events: StreamEvents, reply: "_Reply", take_first: Callable[[], tuple | None]
                   ) -> AsyncIterator[bytes]:
        count = 0
        try:
            if reply.chat:
                yield _event(reply.chunk({"role": "assistant", "content": ""}, None))
            elif reply.echoed:
                yield _event(reply.chunk(reply.echoed, None))
            while True:
                final, completion, _ = take_first() or await events.next()
                try:
                    answer = completion.answer
                    if completion.status != 200:
                        yield b"data: " + error_body(completion.status, answer.error or "inference failed") + b"\n\n"
                        return
                    piece = _text(output_values(answer, completion.tensor)) if answer.outputs else None
                finally:
                    completion.release()
                if piece is not None:
                    count += 1  # (a response, as in a whole answer's usage: an empty piece too)
                if piece:
                    yield _event(reply.chunk({"content": piece} if reply.chat else piece, None))
                if final:
                    break
            yield _event(reply.chunk({} if reply.chat else "", reply.finish(count)))
            if reply.stream_usage:  # stream_options.include_usage: OpenAI's last chunk, no choices
                yield _event({**reply.chunk(None, None), "choices": [], "usage": reply.usage(count)})
            yield b"data: [DONE]\n\n"
        finally:
            events.close()

    async def _model(self, body: dict) -> tuple[str, dict]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "'model' must name a model", "model")
        try:
            status, config = await self.link.control(control.ModelConfig(model))
        except BrokerError as e:
            raise OpenAIError(e.status, str(e)) from None
        if status == 404:
            raise OpenAIError(404, config.get("error", f"The model '{model}' does not exist"), "model",
                              MODEL_NOT_FOUND)
        if status != 200:
            raise OpenAIError(status, config.get("error", f"model '{model}' is not available"))
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
                final, completion, _ = await events.next()
                try:
                    answer = completion.answer
                    if completion.status != 200:
                        error = error or OpenAIError(completion.status, answer.error or "inference failed")
                    elif answer.outputs:
                        pieces.append(output_values(answer, completion.tensor))
                finally:
                    completion.release()
                if final:
                    break
        finally:
            events.close()
        if error is not None:
            raise error
        return pieces


async def _first_event(events: StreamEvents) -> tuple:
    """A stream's first event, waited for before the answer's status is sent: a request refused
    (the server draining, overloaded) or failed at once gets its own status, not a 200 whose
    stream holds the error. Raises OpenAIError then; the events are closed unless returned."""
    try:
        event = await events.next()
    except BaseException:
        events.close()
        raise
    final, completion, _ = event
    if completion.status == 200:
        return event
    try:
        error = OpenAIError(completion.status, completion.answer.error or "inference failed")
    finally:
        completion.release()
        events.close()
    raise error


class _Stream(StreamingResponse):
    """An OpenAI stream's answer. However it ends (its last chunk sent, or the client gone before
    or while it is sent, so that its body may never start), its events are closed and a first
    event never sent is freed: nothing stays held in the arenas."""

    def __init__(self, events: StreamEvents, first: tuple,
                 body: Callable[[Callable[[], tuple | None]], AsyncIterator[bytes]]) -> None:
        self.events, self.first = events, first
        super().__init__(body(self.take_first), media_type="text/event-stream")

    def take_first(self) -> tuple | None:
        first, self.first = self.first, None
        return first

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            first = self.take_first()
            if first is not None:
                first[1].release()
            self.events.close()


class _Reply:
    """The OpenAI objects of one generation: a whole answer, or the chunks of a stream."""

    def __init__(self, model: str, chat: bool, prompt_words: int, stream_usage: bool = False,
                 max_tokens: Any = None, echoed: str = "") -> None:
        self.model, self.chat, self.prompt_words = model, chat, prompt_words
        self.stream_usage = stream_usage  # every chunk carries 'usage' (null but in the last)
        self.max_tokens = max_tokens
        self.echoed = echoed  # a completion's prompt, given back before it (``echo: true``)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, pieces: int) -> dict:
        return {"prompt_tokens": self.prompt_words, "completion_tokens": pieces,
                "total_tokens": self.prompt_words + pieces}

    def finish(self, pieces: int) -> str:
        """OpenAI's ``finish_reason``: "length" when the model sent ``max_tokens`` pieces."""
        return "length" if isinstance(self.max_tokens, int) and pieces >= self.max_tokens > 0 else "stop"

    def whole(self, text: str, pieces: int) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish(pieces), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = self.echoed + text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(pieces)}

    def chunk(self, delta: Any, finish: str | None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if self.stream_usage:
            out["usage"] = None
        return out


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
                raise OpenAIError(400, "only n=1 is supported", key)
            raise OpenAIError(400, f"'{key}' must be an integer from {low} to {high}", key)
    for key, (lo, hi) in NUMBERS.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not lo <= value <= hi):
            raise OpenAIError(400, f"'{key}' must be a number from {lo:g} to {hi:g}", key)
    for key in BOOLEANS:
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise OpenAIError(400, f"'{key}' must be a boolean (true or false)", key)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and 0 < len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise OpenAIError(400, "'stop' must be a string or a list of 1 to 4 strings", "stop")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise OpenAIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise OpenAIError(400, "'stream_options' must be an object whose 'include_usage' is a boolean",
                              "stream_options")


def check_known(body: dict, route: str) -> None:
    """Refuse (400) a field the route does not know, by name (``KNOWN``)."""
    unknown = sorted(set(body) - KNOWN[route])
    if unknown:
        raise OpenAIError(400, f"unknown field '{unknown[0]}'" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1
                                                                   else ""), unknown[0])


def check_unsupported(body: dict, chat: bool) -> None:
    """Refuse (400), by name, a known field asking for what no model here gives: log probabilities,
    tool calls, structured output, an echo or suffix of a chat, more than one candidate."""
    check_known(body, "chat" if chat else "completions")
    why = {"logprobs": "the model gives no log probabilities", "tools": "no tool calling",
           "functions": "no function calling", "suffix": "no suffix (insertion)",
           "logit_bias": "no logit bias", "response_format": "no structured output",
           "audio": "no audio output", "prediction": "no predicted output"}
    refused = []
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if chat and not isinstance(logprobs, bool) or not chat and (not isinstance(logprobs, int) or
                                                                     not 0 <= logprobs <= 5):
            raise OpenAIError(400, "'logprobs' must be a boolean" if chat else "'logprobs' must be an integer "
                                   "from 0 to 5", "logprobs")
        if logprobs:
            refused.append("logprobs")
    if body.get("top_logprobs"):
        refused.append("logprobs")
    refused += [key for key in ("tools", "functions", "logit_bias", "audio", "prediction") if body.get(key)]
    if body.get("suffix"):
        refused.append("suffix")
    if body.get("tool_choice") not in (None, "none", "auto") or body.get("function_call") not in (None, "none", "auto"):
        refused.append("tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        refused.append("response_format")
    if body.get("modalities") not in (None, ["text"]):
        refused.append("audio")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise OpenAIError(400, "only best_of=1 is supported", "best_of")
    if refused:
        key = refused[0]
        raise OpenAIError(400, f"'{key}' is not supported: {why[key]}", key)


def embedding_fields(body: dict) -> tuple[list[str], str, int | None]:
    """An embeddings request's texts, ``encoding_format`` and ``dimensions``, checked as OpenAI
    does (token arrays are refused: shmserve has no tokenizer of the model)."""
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise OpenAIError(400, "'input' must be a string or a list of strings", "input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise OpenAIError(400, f"'input' must have at most {MAX_EMBEDDING_INPUTS} texts", "input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise OpenAIError(400, "'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or not 1 <= dimensions <= INT32_MAX):
        raise OpenAIError(400, "'dimensions' must be a positive integer", "dimensions")
    return texts, encoding, dimensions


def _gives_text(config: dict) -> bool:
    return any(o.get("name") == "text_output" and o.get("data_type") == "TYPE_STRING"
               for o in config.get("output", []))


def _text_inputs(config: dict) -> list[str]:
    return [t["name"] for t in config.get("input", []) if t.get("data_type") == "TYPE_STRING"]


def check_generative(model: str, config: dict, chat: bool) -> None:
    """Refuse (400) a model that is not generative (see the module's docstring)."""
    if not _gives_text(config):
        hint = "; use /v1/embeddings for an embedding model" if _text_inputs(config) else ""
        raise OpenAIError(400, f"model '{model}' is not a generative model: it gives no BYTES output "
                               f"'text_output'{hint}", "model")
    wanted = ("text_input", "messages") if chat else ("text_input",)
    if not set(wanted) & set(_text_inputs(config)):
        raise OpenAIError(400, f"model '{model}' is not a generative model for this route: it takes no BYTES "
                               f"input {' or '.join(repr(w) for w in wanted)}", "model")


def embedding_input(model: str, config: dict) -> str:
    """The input an embedding model takes its text on; 400 for a model of another kind."""
    inputs = _text_inputs(config)
    if not inputs:
        raise OpenAIError(400, f"model '{model}' has no BYTES input to embed text with", "model")
    if _gives_text(config):
        raise OpenAIError(400, f"model '{model}' is not an embedding model: it is a generative model (it gives "
                               f"'text_output'); use /v1/completions or /v1/chat/completions", "model")
    outputs = config.get("output", [])
    if not outputs or outputs[0].get("data_type") in ("TYPE_STRING", "TYPE_BOOL"):
        raise OpenAIError(400, f"model '{model}' is not an embedding model: its first output is not a "
                               f"numeric vector", "model")
    return inputs[0]


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """``base64``: the float32 values, little-endian, in base64 (what the openai package decodes)."""
    if encoding == "float":
        return vector
    try:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    except OverflowError:
        raise OpenAIError(500, "the model's vector has values out of float32's range (use 'float')") from None


def _generate_doc(body: dict, chat: bool, inputs: dict[str, dict]) -> tuple[dict, int]:
    """The generate extension's request for an OpenAI one (see the module's docstring)."""
    doc: dict[str, Any] = {}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise OpenAIError(400, "'messages' must be a list of {role, content} objects", "messages")
        texts = [message_text(i, m) for i, m in enumerate(messages)]
        if "messages" in inputs:  # (the words of its messages: the model has no other prompt)
            doc["messages"] = orjson.dumps(messages).decode()
            prompt_words = sum(len(t.split()) for t in texts)
        else:
            lines = [f"{m['role']}: {text}" for m, text in zip(messages, texts)]
            doc["text_input"] = "\n".join(lines + ["assistant:"])
            prompt_words = len(doc["text_input"].split())
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError(400, "'prompt' must be a string (one prompt per request)", "prompt")
        doc["text_input"] = prompt
        prompt_words = len(prompt.split())
    for key in FORWARDED:
        value = max_tokens(body) if key == "max_tokens" else body.get(key)
        if value is None:
            continue
        declared = inputs.get(key)
        if key == "stop" and isinstance(value, list):  # (a list for an input of a variable length)
            value = value if declared and -1 in declared.get("dims", ()) else \
                value[0] if len(value) == 1 else orjson.dumps(value).decode()
        if declared and declared.get("data_type", "").startswith("TYPE_UINT") and isinstance(value, int) \
                and value < 0:
            raise OpenAIError(400, f"'{key}' must not be negative: the model takes it as an unsigned integer", key)
        doc[key] = value if declared or isinstance(value, (bool, int, float, str)) else str(value)
    return doc, prompt_words


def max_tokens(body: dict) -> Any:
    """The most pieces asked for: ``max_completion_tokens`` (chat), which OpenAI has in place of
    the older ``max_tokens``, where given, as Triton reads them."""
    given = body.get("max_completion_tokens")
    return given if given is not None else body.get("max_tokens")


def message_text(i: int, m: dict) -> str:
    """A chat message's text: its content, a string or text parts (``{"type": "text", "text"}``),
    joined; none for an assistant's message that calls tools. 400 for a role OpenAI lacks, a part
    that is not text (an image: no model here takes one), or content missing where OpenAI needs it."""
    role = m.get("role")
    if role not in ROLES:
        raise OpenAIError(400, f"messages[{i}]: 'role' must be one of {', '.join(ROLES)}, "
                               f"not {orjson.dumps(role).decode()[:64]}", f"messages[{i}].role")
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return ""  # (OpenAI: content is required unless the message calls tools)
        raise OpenAIError(400, f"messages[{i}]: 'content' is required", f"messages[{i}].content")
    if not isinstance(content, list) or not content:
        raise OpenAIError(400, f"messages[{i}]: 'content' must be a string or a list of content parts",
                          f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                   f"are supported, not {orjson.dumps(kind).decode()[:64]}",
                              f"messages[{i}].content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _text(outputs: dict) -> str:
    value = outputs.get("text_output", "")
    return "".join(value) if isinstance(value, list) else str(value)


def _event(doc: dict) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"
