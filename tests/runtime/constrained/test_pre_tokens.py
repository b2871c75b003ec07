"""Where a tokenizer always splits text (radixlm/runtime/constrained/pre_tokens.py): every split the
rule claims holds for the tokenizer itself, and tokenizers it does not know get no rule."""

from __future__ import annotations

import json
import random

import pytest

from radixlm.runtime.constrained.pre_tokens import split_rule


@pytest.fixture(scope="module")
def hf_json(smol_tokenizer) -> str:
    return smol_tokenizer.backend_tokenizer.to_str()


@pytest.fixture(scope="module")
def encode(smol_tokenizer):
    rust = smol_tokenizer.backend_tokenizer
    return lambda text: list(rust.encode(text, add_special_tokens=False).ids)


def test_the_default_tokenizer_has_the_gpt2_rule(hf_json, encode):
    split = split_rule(hf_json, encode)
    assert split is not None
    assert split("e", ",") and split("e", " ") and split("1", "a") and split(",", "a") and split("}", "7")
    assert not split('"', ",")  # one run of symbols: '",' is one piece, and one token
    assert not split("a", "b") and not split("1", "2")
    assert not split(" ", "a")  # a space starts the word after it
    assert not split("'", "s")  # a contraction may start at the apostrophe
    assert not split("a", "\n") and not split("\n", "a")  # other whitespace: never claimed


def test_every_claimed_split_tokenizes_apart(hf_json, encode):
    split = split_rule(hf_json, encode)
    pool = list("ab Z09'\",:;{}[]-_.!?\t\né東😀") + ["'s", "'ll", " x", "12"]
    rng = random.Random(0)
    claimed = 0
    for _ in range(1500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(2, 12)))
        whole = encode(text)
        for i in range(1, len(text)):
            if split(text[i - 1], text[i]):
                claimed += 1
                assert encode(text[:i]) + encode(text[i:]) == whole, (text, i)
    assert claimed > 1000


def test_unknown_pre_tokenizers_get_no_rule(hf_json, encode):
    spec = json.loads(hf_json)
    prefix = {**spec, "pre_tokenizer": {**spec["pre_tokenizer"], "add_prefix_space": True}}
    metaspace = {**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}}
    normalized = {**spec, "normalizer": {"type": "Lowercase"}}
    for other in (prefix, metaspace, normalized):
        assert split_rule(json.dumps(other), encode) is None
    assert split_rule("", encode) is None and split_rule("not json", encode) is None


def test_a_rule_the_tokenizer_breaks_is_not_used(hf_json):
    """The rule is checked against the encoder it will stand beside: one that tokenizes letters
    and symbols together fails the probes."""
    def glued(text: str) -> list[int]:
        return [len(text)]  # one 'token' for any text: no split holds

    assert split_rule(hf_json, glued) is None
