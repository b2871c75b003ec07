"""Real API schemas of 100+ KB compile; what a schema costs, not its bytes, is what is bounded
(radixlm/runtime/constrained/limits.py, compile_pool.py; docs/structured-output.md, "Limits")."""

from __future__ import annotations

import json

import jsonschema
import pytest
from big_schemas import instance, kubernetes_like_schema, ref_chain
from matcher_helpers import _feed, _ids

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.limits import SpecLimits, check_spec
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.constrained.service import GrammarService, check_constraint, grammar_config

OLD_BYTE_LIMIT = 131_072  # what --grammar-max-bytes bounded schemas to before


@pytest.fixture(scope="module")
def k8s() -> dict:
    return kubernetes_like_schema()


def _service(tokenizer, width: int, **options) -> GrammarService:
    return GrammarService(tokenizer, width, [tokenizer.eos_token_id], ConstraintConfig(**options))


def test_the_kubernetes_like_schema_is_real_sized(k8s):
    size = len(json.dumps(k8s, separators=(",", ":")))
    assert 140_000 <= size <= 160_000 and size > OLD_BYTE_LIMIT
    assert len(k8s["definitions"]) > 60
    with pytest.raises(ValueError, match="--grammar-max-schema-bytes"):  # what the old limit said of it
        check_spec("json_schema", json.dumps(k8s), SpecLimits(max_schema_bytes=OLD_BYTE_LIMIT))


def test_a_kubernetes_like_schema_compiles_and_accepts_a_valid_instance(k8s, vocab, smol_tokenizer):
    config = ConstraintConfig()  # the server's defaults
    check_constraint("json_schema", k8s, config)
    grammar = LLGuidanceBackend(vocab, grammar_config(config)).compile("json_schema", k8s)
    assert grammar.backend == "llguidance"
    good = instance(k8s)
    jsonschema.Draft7Validator(k8s).validate(good)
    text = json.dumps(good, separators=(",", ":"))
    assert len(text) > 2000 and '"containers":[' in text and '"annotations":{' in text
    m = grammar.new_matcher()
    assert _feed(m, _ids(smol_tokenizer, text)) is None and m.is_completed()
    # an enum the schema does not list, deep inside: refused there
    bad = text.replace('"type":"RollingUpdate"', '"type":"BlueGreen"')
    assert bad != text
    assert _feed(grammar.new_matcher(), _ids(smol_tokenizer, bad)) is not None


def test_a_hostile_ref_chain_within_the_byte_limit_is_refused_by_its_nesting(smol_tokenizer, width):
    """~150 KB, a tenth of the byte limit: 2,000 schemas that each refer to the next (~1,000
    crashed the engine process in llguidance's recursive compile)."""
    chain = ref_chain(2000)
    assert OLD_BYTE_LIMIT < len(json.dumps(chain, separators=(",", ":"))) < ConstraintConfig().grammar_max_schema_bytes
    service = _service(smol_tokenizer, width)
    try:
        with pytest.raises(ValueError) as err:
            service.submit("json_schema", chain)
        assert str(err.value) == (
            "constrained decoding: json_schema is too large: its nesting through $ref (objects and arrays inside one "
            "another, each $ref read as the schema it names) is 6,002, the limit is 1,024 (server option "
            "--grammar-max-ref-nesting)")
        assert service.submit("json_schema", ref_chain(300)).result().kind == "json_schema"  # 902: compiles
    finally:
        service.shutdown()


def test_a_hostile_schema_within_the_byte_limit_is_refused_by_its_compile_time(smol_tokenizer, width):
    """~460 KB: one object of 5,000 optional properties. llguidance's build grows with their
    square (~2 s here, ~23 s at 10,000, before its own row limit refuses such an object): the
    compile time limit refuses it first, whatever its bytes."""
    slow = {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "description": f"Field {i} of a generated record, free text."}
        for i in range(5000)}}
    size = len(json.dumps(slow, separators=(",", ":")))
    assert OLD_BYTE_LIMIT < size < ConstraintConfig().grammar_max_schema_bytes
    service = _service(smol_tokenizer, width, grammar_compile_timeout=0.25, grammar_compile_workers=1)
    try:
        with pytest.raises(ValueError) as err:
            service.submit("json_schema", slow).result()
        assert str(err.value) == ("constrained decoding: cannot compile json_schema: grammar compile exceeded 0.25 s "
                                  "(server option --grammar-compile-timeout)")
    finally:
        service.shutdown()


def test_a_schema_past_the_byte_limit_is_refused_before_anything_else(smol_tokenizer, width):
    huge = {"type": "string", "description": "x" * 1_100_000}
    with pytest.raises(ValueError, match=r"^constrained decoding: json_schema is too large: its size in bytes is "
                                         r"1,100,\d+, the limit is 1,048,576 \(server option "
                                         r"--grammar-max-schema-bytes\)$"):
        check_constraint("json_schema", huge, ConstraintConfig())
