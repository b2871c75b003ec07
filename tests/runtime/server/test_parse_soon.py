"""parse_generate_soon: a short /generate body is parsed on the event loop, a long one in a
thread; either way the same jobs, and the same 400s."""

import asyncio
import dataclasses

import pytest

from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.native_api import INLINE_PARSE_SIZE, _prompt_size, parse_generate, parse_generate_soon
from radixlm.runtime.server.tokenizer import ServerTokenizer

GREEDY = {"temperature": 0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def tok(smol_tokenizer) -> ServerTokenizer:
    return ServerTokenizer(smol_tokenizer, 2048, len(smol_tokenizer))


def _jobs(spec) -> list:
    return [dataclasses.replace(j, request=dataclasses.replace(j.request, rid="x"), user_rid="x") for j in spec.jobs]


@pytest.mark.parametrize("body, inline", [
    ({"text": "Hello there", "sampling_params": GREEDY}, True),
    ({"text": ["a b c", "d e"], "sampling_params": GREEDY}, True),
    ({"input_ids": [1, 2, 3], "sampling_params": GREEDY}, True),
    ({"input_ids": [[1, 2], [3]], "sampling_params": GREEDY}, True),
    ({"text": "word " * 400, "sampling_params": GREEDY}, False),
    ({"text": ["word " * 150, "word " * 150], "sampling_params": GREEDY}, False),
    ({"input_ids": list(range(1, 1500)), "sampling_params": GREEDY}, False),
])
def test_short_bodies_are_parsed_at_once_and_long_ones_alike(tok, body, inline):
    assert (_prompt_size(body) <= INLINE_PARSE_SIZE) is inline
    soon = asyncio.run(parse_generate_soon(body, tok, 5, 100))
    assert _jobs(soon) == _jobs(parse_generate(body, tok, 5, 100))


@pytest.mark.parametrize("body", [
    {"sampling_params": GREEDY},
    {"text": 7},
    {"text": [], "sampling_params": GREEDY},
    {"input_ids": [[1, "x"]]},
    {"text": "hi", "sampling_params": {"temperature": -1}},
])
def test_malformed_bodies_get_the_same_400_either_way(tok, body):
    with pytest.raises(ApiError) as soon:
        asyncio.run(parse_generate_soon(body, tok, 5, 100))
    with pytest.raises(ApiError) as now:
        parse_generate(body, tok, 5, 100)
    assert (soon.value.status, soon.value.message) == (now.value.status, now.value.message) and now.value.status == 400
