"""The OpenAI-compatible endpoints with the openai package as the client, against a real server
serving the bundled echo_llm (decoupled, Triton's text conventions) and text_embedding models."""
from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import urllib.request

from conftest import PRODUCT_MODELS, raw_request

MODELS = ["echo_llm", "text_embedding", "add_sub"]


@pytest.fixture(scope="module")
def oserver(module_factory):
    args = ["--model-control-mode=explicit"]
    for m in MODELS:
        args += ["--load-model", m]
    return module_factory.start([PRODUCT_MODELS], args)


@pytest.fixture(scope="module")
def oai(oserver):
    with openai.OpenAI(base_url=f"http://{oserver.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_models_lists_what_is_ready(oai):
    assert sorted(m.id for m in oai.models.list().data) == sorted(MODELS)


def test_completion_collects_the_streamed_tokens(oai):
    answer = oai.completions.create(model="echo_llm", prompt="shared memory is fast", max_tokens=3)
    choice = answer.choices[0]
    assert choice.text == "shared memory is" and choice.finish_reason == "length"
    assert answer.object == "text_completion" and answer.model == "echo_llm"
    assert answer.usage.completion_tokens == 3 and answer.usage.prompt_tokens == 4


def test_completion_stream(oai):
    chunks = list(oai.completions.create(model="echo_llm", prompt="one two", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "one two [end]"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_completion_and_its_stream(oai):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    answer = oai.chat.completions.create(model="echo_llm", messages=messages)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == "hello there [end]"
    stream = oai.chat.completions.create(model="echo_llm", messages=messages, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "hello there [end]"


def test_embeddings(oai):
    answer = oai.embeddings.create(model="text_embedding", input=["shared memory", "shared memory!", "gpu"])
    vectors = [np.array(d.embedding) for d in answer.data]
    assert [d.index for d in answer.data] == [0, 1, 2] and all(len(v) == 64 for v in vectors)
    assert np.isclose(np.linalg.norm(vectors[0]), 1.0)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # similar texts lie closer


def test_errors_in_openai_form(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no_such_model", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="add_sub", input="x")
    assert "no BYTES input" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="echo_llm", prompt="x", n=2)


def test_a_restricted_inference_group_guards_the_openai_routes(server_factory):
    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode=explicit", "--load-model", "echo_llm",
                                                "--http-restricted-api=inference:key=secret"])
    request = urllib.request.Request(f"http://{s.url}/v1/completions", method="POST",
                                     data=b'{"model": "echo_llm", "prompt": "hi"}')
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 403
    with openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0,
                       default_headers={"key": "secret"}) as client:
        assert client.completions.create(model="echo_llm", prompt="hi").choices[0].text == "hi [end]"


def test_a_restricted_metadata_group_guards_model_retrieval_in_openai_form(server_factory):
    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode=explicit", "--load-model", "echo_llm",
                                                "--http-restricted-api=metadata:key=secret"])
    with openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0) as client:
        for call in (client.models.list, lambda: client.models.retrieve("echo_llm")):
            with pytest.raises(openai.PermissionDeniedError) as e:
                call()
            assert e.value.body["message"] == "This API is restricted, expecting header 'key'", e.value.body
    with openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0,
                       default_headers={"key": "secret"}) as client:
        assert client.models.retrieve("echo_llm").id == "echo_llm"
    assert raw_request(s.port, "GET", "/v2", b"").json() == \
        {"error": "This API is restricted, expecting header 'key'"}  # Triton's form outside /v1


def test_a_body_over_the_limit_is_refused_in_openai_form(server_factory):
    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode=explicit", "--load-model", "echo_llm",
                                                "--http-max-input-size=1000"])
    with openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:  # 400, as Triton answers a body over the limit
            client.completions.create(model="echo_llm", prompt="x" * 2000)
    assert "--http-max-input-size" in e.value.body["message"], e.value.body


CHAT = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": "a b", "max_tokens": 2 ** 63}, "'max_tokens' must be an integer from 1 to 2147483647"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": 2 ** 31}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": 0}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": "5"}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": True}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "a b", "seed": 2 ** 64}, "'seed' must be an integer"),
    ("/v1/completions", {"prompt": "a b", "temperature": 3}, "'temperature' must be a number from 0 to 2"),
    ("/v1/completions", {"prompt": "a b", "top_p": "high"}, "'top_p' must be a number"),
    ("/v1/completions", {"prompt": "a b", "stream": "yes"}, "'stream' must be a boolean"),
    ("/v1/completions", {"prompt": "a b", "stream": 1}, "'stream' must be a boolean"),
    ("/v1/completions", {"prompt": "a b", "stop": [1]}, "'stop' must be a string or a list"),
    ("/v1/completions", {"prompt": "a b", "n": True}, "only n=1"),
    ("/v1/chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}, "'role' must be one of system"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0]: 'role' must be one of"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "'stream' must be a boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "'max_completion_tokens' must be"),
    # What no model here can honour is refused by name, as Triton's frontend refuses it, never ignored
    ("/v1/completions", {"prompt": "a b", "colour": "red"}, "unknown field 'colour'"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "unknown field 'echo'"),
    ("/v1/completions", {"prompt": "a b", "suffix": "end"}, "'suffix' is not supported"),
    ("/v1/completions", {"prompt": "a b", "logit_bias": {"50256": -100}}, "'logit_bias' is not supported"),
    ("/v1/completions", {"prompt": "a b", "best_of": 3}, "only best_of=1"),
    ("/v1/completions", {"prompt": "a b", "logprobs": 2}, "'logprobs' is not supported"),
    ("/v1/completions", {"prompt": "a b", "logprobs": 6}, "'logprobs' must be an integer from 0 to 5"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "'logprobs' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "'logprobs' must be a boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "'logprobs' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "'tools' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "'tools' is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}},
     "'response_format' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]: only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]: 'content' is required"),
    ("/v1/embeddings", {"input": "a", "colour": "red"}, "unknown field 'colour'"),
])
def test_fields_of_the_wrong_type_or_range_are_refused_in_openai_form(oserver, path, body, needle):
    resp = raw_request(oserver.port, "POST", path, json.dumps({"model": "echo_llm", **body}).encode())
    assert resp.status == 400, resp
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"], error
    assert "Python" not in error["message"]


def test_every_openai_role_is_accepted(oai):
    roles = ["system", "developer", "user", "assistant", "tool", "function"]
    messages = [{"role": r, "content": f"from {r}"} for r in roles]
    answer = oai.chat.completions.create(model="echo_llm", messages=messages, max_tokens=2, seed=2 ** 63 - 1,
                                         temperature=2, top_p=0, stop=["x", "y"], stream=False)
    assert answer.choices[0].message.content == "from function"


def test_what_openai_clients_send_today_is_honoured(oai):
    """``max_completion_tokens`` (OpenAI's name in place of ``max_tokens``) bounds the answer, and a
    stream so bounded ends with "length" as the whole answer does (it ended with "stop"); a
    message's content as text parts, and an assistant's message that called a tool (no content)
    followed by the tool's answer, are chat as OpenAI's client sends it (both were refused); a
    completion's ``echo`` gives the prompt back before it (it was dropped), and ``logprobs: 0``
    asks for none."""
    chat = [{"role": "user", "content": "alpha beta gamma"}]
    answer = oai.chat.completions.create(model="echo_llm", messages=chat, max_completion_tokens=1)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 1, answer
    whole = oai.completions.create(model="echo_llm", prompt="one two three", max_tokens=2)
    streamed = list(oai.completions.create(model="echo_llm", prompt="one two three", max_tokens=2, stream=True))
    assert whole.choices[0].finish_reason == streamed[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    parts = [{"role": "user", "content": [{"type": "text", "text": "alpha "}, {"type": "text", "text": "beta"}]}]
    assert oai.chat.completions.create(model="echo_llm", messages=parts).choices[0].message.content == \
        "alpha beta [end]"
    tool_turn = [{"role": "user", "content": "weather?"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "sunny today"}]
    assert oai.chat.completions.create(model="echo_llm", messages=tool_turn).choices[0].message.content == \
        "sunny today [end]"
    echoed = oai.completions.create(model="echo_llm", prompt="one two", echo=True, logprobs=0)
    assert echoed.choices[0].text == "one two" + oai.completions.create(model="echo_llm", prompt="one two").choices[0].text
    echoed = list(oai.completions.create(model="echo_llm", prompt="one two", echo=True, stream=True))
    assert "".join(c.choices[0].text for c in echoed).startswith("one twoone")


def test_fields_reach_a_models_typed_inputs_as_it_declares_them(server_factory):
    """``stop`` as a list reaches an input of variable length as its elements (it came as one JSON
    string), the penalties reach their inputs (they were checked and dropped), and a negative
    ``seed`` for an unsigned input is a 400 naming ``seed`` (it was the generate extension's
    words, naming no field)."""
    from conftest import TESTS

    s = server_factory.start([TESTS / "models" / "openai"], ["--model-control-mode=explicit",
                                                             "--load-model", "typed_llm"])
    with openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0) as client:
        got = client.completions.create(model="typed_llm", prompt="hi", stop=["a", "b"], seed=7, presence_penalty=0.5)
        assert json.loads(got.choices[0].text) == {"presence_penalty": [0.5], "seed": [7], "stop": ["a", "b"],
                                                   "text_input": ["hi"]}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="typed_llm", prompt="hi", seed=-1)
        assert e.value.body["param"] == "seed" and "must not be negative" in e.value.body["message"]


def test_a_model_is_retrieved_by_its_id(oai):
    model = oai.models.retrieve("echo_llm")
    assert (model.id, model.object, model.owned_by) == ("echo_llm", "model", "shmserve")
    assert model.created == next(m.created for m in oai.models.list().data if m.id == "echo_llm")


@pytest.mark.parametrize("call", [
    lambda c: c.models.retrieve("no_such_model"),
    lambda c: c.completions.create(model="no_such_model", prompt="x"),
    lambda c: c.chat.completions.create(model="no_such_model", messages=CHAT),
    lambda c: c.embeddings.create(model="no_such_model", input="x"),
])
def test_a_missing_model_is_a_404_in_openai_form(oai, call):
    with pytest.raises(openai.NotFoundError) as e:
        call(oai)
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found", error
    assert error["param"] == "model" and "no_such_model" in error["message"], error


def test_an_unknown_v1_route_or_method_answers_in_openai_form(oserver):
    for method, path, status in [("GET", "/v1/no/such/route", 404), ("GET", "/v1/completions", 405)]:
        resp = raw_request(oserver.port, method, path, b"")
        assert resp.status == status, resp
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


@pytest.mark.parametrize("chat", [False, True])
def test_stream_options_include_usage_adds_a_final_usage_chunk(oai, chat):
    if chat:
        stream = oai.chat.completions.create(model="echo_llm", messages=[{"role": "user", "content": "one two"}],
                                             stream=True, stream_options={"include_usage": True})
    else:
        stream = oai.completions.create(model="echo_llm", prompt="one two", stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    *pieces, last = chunks
    assert last.choices == [] and last.usage is not None
    prompt_words = 4 if chat else 2  # chat: the prompt "user: one two\nassistant:"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (prompt_words, 3, prompt_words + 3)
    assert all(c.usage is None and len(c.choices) == 1 for c in pieces)
    text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text for c in pieces)
    assert text == "one two [end]"


def test_stream_options_without_stream_is_refused(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="echo_llm", prompt="x", stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_base64_embeddings_decode_to_the_float_ones(oai):
    texts = ["shared memory", "gpu"]
    floats = oai.embeddings.create(model="text_embedding", input=texts, encoding_format="float")
    encoded = oai.embeddings.create(model="text_embedding", input=texts, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in encoded.data)
    for f, b in zip(floats.data, encoded.data):
        decoded = np.frombuffer(base64.b64decode(b.embedding), dtype="<f4")
        assert decoded.tolist() == np.array(f.embedding, dtype="<f4").tolist()
    by_default = oai.embeddings.create(model="text_embedding", input=texts)  # the SDK asks for base64, decodes
    assert [d.embedding for d in by_default.data] == [d.embedding for d in floats.data]


def test_embedding_fields_are_checked(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="text_embedding", input="x", encoding_format="hex")
    assert e.value.body["param"] == "encoding_format"
    assert len(oai.embeddings.create(model="text_embedding", input="x", dimensions=64).data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="text_embedding", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions" and "64" in e.value.body["message"]


@pytest.mark.parametrize("call, needle", [
    (lambda c: c.chat.completions.create(model="text_embedding", messages=CHAT), "not a generative model"),
    (lambda c: c.completions.create(model="text_embedding", prompt="x"), "not a generative model"),
    (lambda c: c.completions.create(model="add_sub", prompt="x"), "not a generative model"),
    (lambda c: c.embeddings.create(model="echo_llm", input="x"), "not an embedding model"),
])
def test_a_model_of_the_wrong_kind_is_a_400_that_says_why(oai, call, needle):
    with pytest.raises(openai.BadRequestError) as e:
        call(oai)
    error = e.value.body
    assert error["param"] == "model" and needle in error["message"], error
    model = "echo_llm" if "embedding model" in needle else ("add_sub" if "add_sub" in error["message"]
                                                               else "text_embedding")
    assert f"'{model}'" in error["message"], error
