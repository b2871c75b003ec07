"""Each sampling parameter is declared once, in SamplingParams' field metadata: a new field reaches
the DSL (when declared ``dsl``), the OpenAPI schema, the OpenAI routes (when it has an OpenAI
name) and the CLI without being written anywhere else. These tests walk the declaration, so a
field that one of them does not pick up fails here."""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

import jsonschema
import pytest

import radixlm as rl
from radixlm.cli import build_parser, generate_params
from radixlm.runtime.programs.sampling import SamplingArgs
from radixlm.runtime.sampling_params import (
    ALIASES,
    CONSTRAINT_FIELDS,
    DEFAULTS,
    EMPTY_ONLY,
    PARAMS,
    Param,
    SamplingParams,
    check_fields,
)
from radixlm.runtime.server import openai_api
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.openapi import openapi_spec
from radixlm.runtime.server.settings import ServerSettings
from radixlm.runtime.server.tokenizer import ServerTokenizer

NAMES = SamplingParams.field_names()
DSL = [n for n in NAMES if PARAMS[n].dsl]
OPENAI = {theirs: name for theirs, name in openai_api.SAMPLING_FIELDS.items()}


def other_value(name: str, openai: bool = False) -> Any:
    """A valid value of parameter ``name`` that is not its default, from its declaration alone
    (``openai``: also within the OpenAI API's own range)."""
    p = PARAMS[name]
    if p.kind == "int":
        return int(p.lo or 0) + 2
    if p.kind == "float":
        lo = p.lo if p.lo is not None else 0.0
        hi = p.openai_hi if openai and p.openai_hi is not None else p.hi
        return (lo + 3 * hi) / 4 if hi is not None else lo + 0.5
    return {"bool": not DEFAULTS[name], "seed": 7, "text": "a+", "stop": ["zz"], "token_ids": [5],
            "schema": '{"type":"object"}', "choices": ["yes", "no"], "stop_regex": ["z+"],
            "logit_bias": {"5": 2.5}}[p.kind]


def bad_value(name: str) -> Any:
    """A value of the wrong type for parameter ``name``."""
    return {"int": "x", "float": "x", "bool": "x", "seed": 1.5, "text": 5, "stop": 3, "token_ids": "x",
            "schema": 5, "choices": 5, "stop_regex": 3, "logit_bias": [1]}[PARAMS[name].kind]


def stored(name: str, value: Any) -> Any:
    return getattr(SamplingParams(**{name: value}), name)


def test_every_field_is_declared_with_help_and_a_kind():
    assert tuple(PARAMS) == NAMES and tuple(DEFAULTS) == NAMES
    for f in dataclasses.fields(SamplingParams):
        p = f.metadata["param"]
        assert isinstance(p, Param) and p.help, f.name
        assert DEFAULTS[f.name] == getattr(SamplingParams(), f.name)
        assert stored(f.name, other_value(f.name)) != DEFAULTS[f.name], f.name
        with pytest.raises(ValueError, match=f.name):
            SamplingParams(**{f.name: bad_value(f.name)})


@pytest.mark.parametrize("name", DSL)
def test_the_dsl_takes_every_dsl_field_and_checks_it_by_the_declaration(name):
    assert {f.name for f in dataclasses.fields(SamplingArgs)} == set(DSL) == SamplingArgs.names()
    args = SamplingArgs.from_kwargs({name: other_value(name)})
    assert SamplingParams.from_dict(args.to_native()) == SamplingParams(**{name: other_value(name)})
    with pytest.raises(ValueError, match=name):
        SamplingArgs.from_kwargs({name: bad_value(name)})
    # gen() takes it as a keyword, listed in its signature and docstring (SGLang's max_tokens / min_tokens
    # for the two token counts)
    keyword = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(name, name)
    assert keyword in inspect.signature(rl.gen).parameters
    assert keyword != name or f"``{name}``: {PARAMS[name].help}" in (rl.gen.__doc__ or "")
    node = rl.gen("x", **{keyword: other_value(name)}).nodes[0]
    assert SamplingParams.from_dict(node.sampling.to_native()) == SamplingParams(**{name: other_value(name)})
    with pytest.raises(ValueError, match=name):
        rl.gen("x", **{keyword: bad_value(name)})


def test_dsl_values_are_checked_one_by_one_not_by_building_params():
    assert check_fields({"min_new_tokens": 500}) == {"min_new_tokens": 500}  # a run may raise max_new_tokens
    with pytest.raises(ValueError, match="unknown sampling parameter 'temprature'"):
        check_fields({"temprature": 0})
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        rl.gen("x", temprature=0)


def test_the_openapi_schema_describes_every_field_from_the_declaration():
    spec = openapi_spec(ServerSettings())
    schemas = spec["components"]["schemas"]
    native = schemas["SamplingParams"]["properties"]
    assert list(native)[: len(NAMES)] == list(NAMES)  # then SGLang's aliases and empty-only keys
    assert set(native) - set(NAMES) == set(ALIASES) | set(EMPTY_ONLY)
    for name in NAMES:
        one = native[name]["anyOf"][0]
        assert one["description"] == PARAMS[name].help
        jsonschema.validate(other_value(name), one)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad_value(name), one)
        if DEFAULTS[name] not in (None, ()):
            assert one["default"] == DEFAULTS[name]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[request]["properties"]
        for theirs, name in OPENAI.items():
            jsonschema.validate(other_value(name, openai=True), props[theirs]["anyOf"][0])
    assert schemas["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]["maximum"] == 2  # OpenAI's


class _Vocab:
    """What _params reads of the server's tokenizer: its vocabulary size and the check of token ids against it."""

    vocab_size = 1 << 20
    check_token_params = ServerTokenizer.check_token_params


VOCAB = _Vocab()


def test_the_openai_routes_take_every_openai_field_by_its_openai_name():
    assert {name for name, p in PARAMS.items() if p.openai is not None} == set(OPENAI.values())
    assert OPENAI["max_tokens"] == "max_new_tokens" and OPENAI["min_tokens"] == "min_new_tokens"
    for fields in (openai_api.COMPLETION_FIELDS, openai_api.CHAT_FIELDS):
        assert set(OPENAI) <= set(fields)
    free = {theirs: other_value(name, openai=True) for theirs, name in OPENAI.items()
            if name not in CONSTRAINT_FIELDS and theirs not in ("n", "max_tokens")}
    params = openai_api._params(openai_api._sampling(free, 3, 9, 16), VOCAB)
    assert params.n == 3 and params.max_new_tokens == 9
    for theirs, value in free.items():
        assert getattr(params, OPENAI[theirs]) == stored(OPENAI[theirs], value), theirs
    for theirs, name in OPENAI.items():
        if name in CONSTRAINT_FIELDS:
            got = openai_api._params(openai_api._sampling({theirs: other_value(name, openai=True)}, 1, None, 16), VOCAB)
            assert getattr(got, name) == stored(name, other_value(name, openai=True))
    # left out: the runtime's defaults, not restated by the route
    assert openai_api._params(openai_api._sampling({}, 1, None, 16), VOCAB) == SamplingParams(max_new_tokens=16)


def test_openai_errors_name_the_openai_field():
    with pytest.raises(ApiError) as err:
        openai_api._params(openai_api._sampling({"min_tokens": 9}, 1, 4, 16), VOCAB)
    assert err.value.message.startswith("min_tokens must be <= max_tokens") and err.value.param == "min_tokens"
    with pytest.raises(ApiError) as err:
        openai_api._sampling({"temperature": 2.5}, 1, None, 16)
    assert "temperature must be <= 2" in err.value.message and err.value.param == "temperature"


def test_the_cli_has_a_flag_for_every_field():
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    dests = {a.dest: a for a in gen._actions}
    for name in NAMES:
        assert f"sampling.{name}" in dests, name
        assert PARAMS[name].help in dests[f"sampling.{name}"].help
    argv = ["generate", "hi"]
    for name in NAMES:
        if name in CONSTRAINT_FIELDS and name != "regex":
            continue  # at most one constraint
        flag = dests[f"sampling.{name}"].option_strings[0]
        value = other_value(name)
        for v in value if isinstance(value, list) else [value]:
            argv += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    params = generate_params(build_parser().parse_args(argv))
    for name in NAMES:
        if name not in CONSTRAINT_FIELDS or name == "regex":
            assert getattr(params, name) == stored(name, other_value(name)), name
