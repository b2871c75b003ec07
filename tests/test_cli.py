"""`radixlm generate`'s sampling flags: one per SamplingParams field, from its declaration
(tests/runtime/test_sampling_declared_once.py checks every field)."""

from __future__ import annotations

import pytest

from radixlm.cli import build_parser, generate_params, main
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.settings import API_KEY_ENV


def _params(*args: str) -> SamplingParams:
    return generate_params(build_parser().parse_args(["generate", "hi", *args]))


def test_generate_is_greedy_by_default_and_otherwise_takes_the_runtime_defaults():
    assert _params() == SamplingParams(temperature=0.0)


def test_flags_override_the_json_and_repeat_for_lists():
    p = _params("--sampling-params", '{"top_k": 7, "min_p": 0.1, "temperature": 0.9}', "--top-k", "5",
                "--stop", "a", "--stop", "b", "--ignore-eos", "--sampling-seed", "3", "--stop-token-ids", "4")
    assert (p.top_k, p.min_p, p.temperature, p.stop, p.ignore_eos, p.seed, p.stop_token_ids) == \
        (5, 0.1, 0.9, ("a", "b"), True, 3, (4,))


def test_names_that_engine_flags_have_get_a_sampling_prefix():
    ns = build_parser().parse_args(["generate", "hi", "--seed", "1", "--sampling-seed", "2",
                                    "--sampling-jump-forward", "false"])
    assert ns.seed == 1 and generate_params(ns).seed == 2 and generate_params(ns).jump_forward is False


def test_bad_values_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="top_p must be in"):
        _params("--top-p", "0")
    with pytest.raises(ValueError, match="--sampling-params must be a JSON object"):
        _params("--sampling-params", "[1]")


@pytest.mark.parametrize("args", [[], ["--api-key", ""]])
def test_serve_refuses_an_empty_api_key_before_it_starts(monkeypatch, capsys, args):
    """An empty $RADIXLM_API_KEY (or --api-key '') would serve without auth and say nothing. (A bad
    engine flag behind it, read after the server's settings: were the key taken, serve stops there.)"""
    monkeypatch.setenv(API_KEY_ENV, "")
    if args:
        monkeypatch.delenv(API_KEY_ENV)
    assert main(["serve", *args, "--max-total-tokens", "-5"]) == 2
    err = capsys.readouterr().err
    assert ("RADIXLM_API_KEY is set but empty" if not args else "api_key must not be empty") in err, err
