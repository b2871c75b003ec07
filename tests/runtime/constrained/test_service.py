"""GrammarService: a grammar compiled before starts a request at once, without the compile pool."""

from __future__ import annotations

import pytest

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.service import GrammarService

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
