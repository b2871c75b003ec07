"""RuntimeEndpoint formats roles exactly like the Engine backend, from the role markers the
server reports (no local tokenizer needed), and the markers' JSON form rejects malformed data."""

from __future__ import annotations

import pytest

import radixlm.lang as sgl
from radixlm.lang.frontend.chat_template import FALLBACK, ChatTemplate

GREEDY = {"temperature": 0}


@sgl.function
def chat_without_system(s, question):
    with s.user():  # no system message: the template's default one must be inserted
        s += question
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    s += sgl.user("Thanks. One word more?")
    s += sgl.assistant(sgl.gen("more", max_tokens=4))


@pytest.mark.slow
def test_endpoint_takes_role_markers_from_the_server(engine_backend, endpoint, server):
    assert endpoint.template_source == "server"
    assert endpoint.model_info["role_markers"] == engine_backend.chat_template.to_dict()
    local, remote = engine_backend.chat_template, endpoint.chat_template
    assert (remote.prefix, remote.suffix, remote.default_system) == (local.prefix, local.suffix, local.default_system)


@pytest.mark.slow
def test_roles_program_sends_the_same_prompt(engine_backend, endpoint, smol_tokenizer):
    runs = [chat_without_system.run("Name a fruit.", backend=be, **GREEDY) for be in (engine_backend, endpoint)]
    local, remote = runs
    assert remote.text() == local.text() and remote.messages() == local.messages()
    for name in ("answer", "more"):  # the same prompt tokens reached the model
        assert remote.get_meta_info(name)["prompt_tokens"] == local.get_meta_info(name)["prompt_tokens"]
    messages = remote.messages()
    assert remote.text() == smol_tokenizer.apply_chat_template(messages, tokenize=False)
    # the prompt of the first gen is the template's own generation prompt
    prompt = smol_tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert remote.text().startswith(prompt + remote["answer"])


def test_role_markers_json_round_trip_and_errors():
    assert ChatTemplate.from_dict(FALLBACK.to_dict()) == FALLBACK
    bad = FALLBACK.to_dict()
    del bad["prefix"]["user"]
    bad["default_system"] = 3
    with pytest.raises(ValueError, match="prefix must map each of system, user, assistant.*default_system"):
        ChatTemplate.from_dict(bad)
    with pytest.raises(ValueError, match="must be an object"):
        ChatTemplate.from_dict(["user"])
