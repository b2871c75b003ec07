import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.sampling_params import DEFAULTS, PARAMS, SamplingParams, check_value, normalize_value


def test_defaults_match_sglang():
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert p.min_new_tokens == 0
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == -1
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.frequency_penalty == 0.0
    assert p.presence_penalty == 0.0
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is True
    assert p.no_stop_trim is False
    assert p.n == 1
    assert p.seed is None
    assert p.regex is None and p.json_schema is None and p.ebnf is None
    assert p.jump_forward is True
    assert not p.is_greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be in [0, 100] (0 means greedy), got -1"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"temperature": 100.0000001}, "temperature must be in [0, 100] (0 means greedy), got 100.0000001"),  # not 100
        ({"top_p": 1 + 2**-52}, "top_p must be in (0, 1], got 1.0000000000000002"),
        ({"temperature": 1e300}, "got 1e+300"),
        ({"top_k": 0}, "top_k must be -1 (off) or >= 1, got 0"),
        ({"top_k": -2}, "top_k must be -1 (off) or >= 1, got -2"),
        ({"top_k": 2.0}, "top_k must be an int, got 2.0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0 (1 means off), got 0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3"),
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int, got True"),
        ({"max_new_tokens": 5.0}, "max_new_tokens must be an int, got 5.0"),
        ({"min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
        (
            {"min_new_tokens": 10, "max_new_tokens": 5},
            "min_new_tokens must be <= max_new_tokens, got min_new_tokens=10 > max_new_tokens=5",
        ),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": False}, "n must be an int, got False"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop": ["a", 3]}, "stop must contain only strings, got 3"),
        ({"stop": 3}, "stop must be a string or a list of strings, got int"),
        ({"stop": ["x"] * 33}, "stop accepts at most 32 strings, got 33"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids must be ints >= 0, got -2"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be ints >= 0, got True"),
        ({"seed": 1.5}, "seed must be an int or null, got 1.5"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool (true/false), got 1"),
        ({"regex": "a+", "ebnf": "root ::= 'a'"}, "at most one of regex, json_schema, ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "got regex, json_schema"),
        ({"regex": 5}, "regex must be a string, got int"),
        # found by fuzzing: these raised OverflowError / TypeError, or passed a string as choices
        ({"temperature": 10**400}, "temperature must be a finite number, got an integer too large"),
        ({"choices": 1}, "choices must be a non-empty list of strings, got 1"),
        ({"choices": "abc"}, "choices must be a non-empty list of strings, got 'abc'"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert message in str(exc.value)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=1, min_p=1, frequency_penalty=-2,
                   presence_penalty=2, max_new_tokens=0, min_new_tokens=0)
    SamplingParams(stop=["x"] * 32, repetition_penalty=1e-3, seed=-5)


def test_normalizes_stop_and_ids_and_is_hashable():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3], temperature=1)
    assert p.stop == ("###",)
    assert p.stop_token_ids == (2, 3)
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert hash(p) == hash(SamplingParams(stop=("###",), stop_token_ids=(2, 3)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_defaults_are_stored_normalized_and_valid():
    """SamplingParams keeps a default value as it is, unchecked: each must already be its own
    normalized form and valid."""
    for name, p in PARAMS.items():
        assert normalize_value(name, p, DEFAULTS[name]) == DEFAULTS[name], name
        check_value(name, p, DEFAULTS[name])
    assert SamplingParams() == SamplingParams(**DEFAULTS)


def test_a_value_equal_to_its_default_is_normalized_like_any_other():
    p = SamplingParams.from_dict({"temperature": 1, "top_k": -1, "stop": [], "max_new_tokens": 128})
    assert p == SamplingParams() and isinstance(p.temperature, float) and p.stop == ()


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.7).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # below the fp32-safe cut-off
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams(top_k=2).is_greedy
    # a top_p that is 0 (or subnormal) in float32 keeps only the most likely token, not none
    assert SamplingParams(top_p=1e-46).is_greedy and SamplingParams(top_p=1e-300).is_greedy
    assert SamplingParams(top_p=1e-39).is_greedy and not SamplingParams(top_p=1e-37).is_greedy


def test_from_dict_and_round_trip():
    d = {
        "max_new_tokens": 16,
        "temperature": 0.5,
        "stop": "\n",
        "stop_token_ids": [7],
        "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "seed": None,  # JSON null -> default
    }
    p = SamplingParams.from_dict(d)
    assert p.max_new_tokens == 16 and p.temperature == 0.5
    assert p.stop == ("\n",) and p.stop_token_ids == (7,)
    assert p.json_schema == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    assert p.seed is None
    out = p.to_dict()
    assert out["stop"] == ["\n"] and out["stop_token_ids"] == [7]
    assert set(out) == set(SamplingParams.field_names())
    json.dumps(out)
    assert SamplingParams.from_dict(out) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_from_dict_unknown_key():
    with pytest.raises(ValueError) as exc:
        SamplingParams.from_dict({"max_tokens": 5})
    msg = str(exc.value)
    assert "unknown sampling parameter 'max_tokens'" in msg
    assert "valid keys:" in msg and "max_new_tokens" in msg and "jump_forward" in msg


def test_from_dict_rejects_non_mapping_and_validates():
    with pytest.raises(ValueError, match="sampling_params must be an object/dict, got list"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.from_dict({"top_p": 0.0})


# -- fuzzing: any JSON-ish dict is either valid or a ValueError that names a field -------------
_json_leaf = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**400), max_value=10**400)
              | st.floats() | st.text(max_size=8))
_json_values = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(SamplingParams.field_names()) | st.text(max_size=12)
# Values near the valid ones too, so that valid params (and their round trip) are drawn often.
_near_valid = st.one_of(st.integers(-3, 300), st.floats(-3, 3), st.booleans(), st.none(),
                        st.sampled_from(["a", "\n", "", "[a-z]+", '{"type": "object"}']),
                        st.lists(st.sampled_from(["x", "yz", "", "😀"]), max_size=3),
                        st.lists(st.integers(-2, 5), max_size=3))


@settings(max_examples=500, deadline=None)
@given(d=st.dictionaries(_keys, _json_values | _near_valid, max_size=6))
def test_any_dict_is_valid_params_or_a_value_error_naming_a_field(d):
    try:
        p = SamplingParams.from_dict(d)
    except ValueError as e:
        message = str(e)
        assert message and any((k and k in message) or repr(k) in message for k in d), message
        return
    assert SamplingParams.from_dict(p.to_dict()) == p
    json.dumps(p.to_dict(), allow_nan=False)
    hash(p)


@settings(max_examples=200, deadline=None)
@given(x=_json_values)
def test_any_json_value_as_sampling_params_is_params_or_a_value_error(x):
    try:
        SamplingParams.from_dict(x)
    except ValueError as e:
        assert str(e)
