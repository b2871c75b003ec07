"""GrammarService: a grammar compiled before starts a request at once, without the compile pool."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.service import GrammarService, text_encoder

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def service(smol_tokenizer, width):
    s = GrammarService(smol_tokenizer, width, [smol_tokenizer.eos_token_id], ConstraintConfig())
    yield s
    s.shutdown()


def test_a_cached_grammar_is_ready_when_submitted(service):
    first = service.submit("json_schema", SCHEMA).result(timeout=60)
    again = service.submit("json_schema", dict(SCHEMA))  # an equal spec: the same cache entry
    assert again.done() and again.result() is first


def test_a_cached_failure_fails_when_submitted(service):
    bad = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 3}
    with pytest.raises(ValueError, match="^constrained decoding: cannot compile json_schema"):
        service.submit("json_schema", bad).result(timeout=60)
    again = service.submit("json_schema", bad)
    assert again.done()
    with pytest.raises(ValueError, match="^constrained decoding: cannot compile json_schema: 'minProperties'"):
        again.result()


TEXTS = ['{"name":"Émile Zola","age":62}', "  two  spaces\tand a tab\n", "MiXeD CaSe 123", "東京 😀 naïve"]


def test_the_text_encoder_is_the_tokenizers_own(smol_tokenizer, vocab):
    """Jump-forward re-tokenizes through the Rust tokenizer only where it agrees with encode()."""
    def encode(text):
        return smol_tokenizer.encode(text, add_special_tokens=False)

    assert vocab.hf_json
    for hf_json in (vocab.hf_json, ""):
        enc = text_encoder(smol_tokenizer, hf_json)
        assert [enc(t) for t in TEXTS] == [encode(t) for t in TEXTS]
    lowered = json.loads(vocab.hf_json)
    lowered["normalizer"] = {"type": "Lowercase"}  # a Rust tokenizer that disagrees: not used
    enc = text_encoder(smol_tokenizer, json.dumps(lowered))
    assert enc("MiXeD CaSe") == encode("MiXeD CaSe")
