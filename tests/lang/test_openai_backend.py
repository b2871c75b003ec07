"""The OpenAI backend against the real server's OpenAI routes: chat and completion modes,
select through prompt logprobs, json_schema through response_format, streaming, errors."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

import radixlm.lang as sgl
from radixlm.lang.backends.openai import OpenAI

pytestmark = pytest.mark.slow

API_KEY = "dsl-test-key"


class Pet(BaseModel):
    kind: str
    name: str


@sgl.function
def chat(s, question):
    s += sgl.system("Answer in a few words.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))


@sgl.function
def pick(s):
    s += "Q: Which is a fruit?\nA:"
    s += sgl.select("fruit", [" apple", " hammer", " cloud"])


@sgl.function
def pet(s):
    s += sgl.user("Describe a pet as JSON with kind and name.")
    s += sgl.assistant(sgl.gen("pet", json_schema=Pet, max_tokens=30))


@sgl.function
def gen_outside_assistant(s):
    s += sgl.user("Hi") + sgl.gen("x", max_tokens=2)


@pytest.fixture(scope="module")
def openai_chat(server):
    return OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY)


@pytest.fixture(scope="module")
def openai_text(server):
    return OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY, chat=False)


def test_chat_mode_equals_the_engine(openai_chat, engine_backend):
    remote = chat.run("What is the capital of Italy?", backend=openai_chat, temperature=0)
    local = chat.run("What is the capital of Italy?", backend=engine_backend, temperature=0)
    assert remote["answer"] == local["answer"]
    assert remote.messages() == local.messages()

    streamed = chat.run("What is the capital of Italy?", backend=openai_chat, temperature=0, stream=True)
    assert "".join(streamed.text_iter("answer")) == local["answer"]


def test_select_through_prompt_logprobs(openai_text, engine_backend):
    remote = pick.run(backend=openai_text)
    local = pick.run(backend=engine_backend)
    assert remote["fruit"] == local["fruit"] == " apple"
    # bf16 logits differ in the last bits with the step's batch shape (what the server batched
    # the prompts with, what its cache held): equal to ~1e-4 relative
    assert remote.get_meta_info("fruit")["scores"] == \
        pytest.approx(local.get_meta_info("fruit")["scores"], rel=1e-3, abs=1e-3)


def test_json_schema_through_response_format(openai_chat):
    st = pet.run(backend=openai_chat, temperature=0)
    assert set(json.loads(st["pet"])) == {"kind", "name"}


def test_chat_mode_needs_gen_to_open_an_assistant_message(openai_chat):
    with pytest.raises(ValueError, match="assistant"):
        gen_outside_assistant.run(backend=openai_chat)


def test_select_without_prompt_logprobs_is_a_clear_error(openai_text, server):
    no_logprobs = OpenAI("smollm2", base_url=server.url + "/v1", api_key="wrong-key", chat=False)
    with pytest.raises(ValueError, match="prompt logprobs"):
        pick.run(backend=no_logprobs)
