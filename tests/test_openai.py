"""The OpenAI-compatible endpoints with the openai package as the client, against a real server
serving the bundled echo_llm (decoupled, Triton's text conventions) and text_embedding models."""
from __future__ import annotations

import numpy as np
import openai
import pytest
import urllib.request

from conftest import PRODUCT_MODELS

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
