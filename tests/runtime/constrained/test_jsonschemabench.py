"""The JSONSchemaBench pipeline of benchmarks/jsonschemabench.py on a fixed sample: the first 5
schemas of each file through xgrammar, and through outlines where its compile is quick."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from radixlm.runtime.constrained import GRAMMAR_BACKENDS, build_tokenizer_vocab

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "jsonschemabench.py"
SAMPLE = 5

# (file, backend) -> (compiled, valid accepted, valid, invalid rejected, invalid), measured with
# xgrammar 0.2.8 / outlines-core 0.2.14. Why the gaps:
# - xgrammar: schemas using what it only approximates are refused by name
#   (radixlm/runtime/constrained/schema_check.py): Github_trivial o10020 is a oneOf whose
#   branches both take {}; the Handwritten ones use "not", or "allOf" next to keywords whose
#   merge is unsupported. Synthesized's schemas are enums under "not"s: each compiles as the enum
#   of its values that pass the whole schema (finite_schema), on every backend. What compiles accepts every valid
#   instance and refuses every invalid one (lengths beside a pattern now go into the pattern,
#   oneOf next to "properties" is merged into the branches).
# - Glaiveai2K, outlines: 2 invalid timestamps are accepted (format date-time not enforced).
# - Handwritten, outlines: not/patternProperties/type-less schemas: no compile.
EXPECTED = {
    ("Github_trivial", "xgrammar"): (4, 5, 5, 9, 9),
    ("Github_easy", "xgrammar"): (5, 5, 5, 10, 10),
    ("Glaiveai2K", "xgrammar"): (5, 5, 5, 6, 6),
    ("Handwritten", "xgrammar"): (0, 0, 0, 0, 0),
    ("Synthesized", "xgrammar"): (5, 3, 3, 8, 8),
    ("Glaiveai2K", "outlines"): (5, 5, 5, 4, 6),
    ("Handwritten", "outlines"): (0, 0, 0, 0, 0),
    ("Synthesized", "outlines"): (5, 3, 3, 8, 8),
}
# Valid instances refused for a reason other than a property the schema never names.
KNOWN_VALID_GAPS: set[str] = set()


@pytest.fixture(scope="module")
def jsb():
    spec = importlib.util.spec_from_file_location("jsonschemabench_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    if not module.DATA_DIR.exists():
        pytest.skip(f"{module.DATA_DIR} is missing")
    return module


@pytest.fixture(scope="module")
def results(jsb, smol_tokenizer, default_source) -> dict:
    vocab = build_tokenizer_vocab(smol_tokenizer, default_source.arch.vocab_size)
    backends = {name: GRAMMAR_BACKENDS[name](vocab, jsb.BACKEND_CONFIGS[name]) for name in ("xgrammar", "outlines")}

    def encode(text: str) -> list[int]:
        return smol_tokenizer.encode(text, add_special_tokens=False)

    out = {}
    for file, backend in EXPECTED:
        rows = jsb.load_rows(jsb.DATA_DIR, file, SAMPLE)
        out[file, backend] = [jsb.check_schema(backends[backend], file, row, encode, vocab.stop_ids[0])
                              for row in rows]
    return out


@pytest.mark.parametrize("key", list(EXPECTED))
def test_sample_counts(results, key):
    rs = results[key]
    got = (
        sum(r.compiled for r in rs),
        sum(r.valid_accepted for r in rs),
        sum(r.valid for r in rs),
        sum(r.invalid_rejected for r in rs),
        sum(r.invalid for r in rs),
    )
    assert got == EXPECTED[key], [(r.name, r.error, r.failures) for r in rs]


def test_masks_agree_with_accept(results):
    assert all(r.mask_mismatches == 0 for rs in results.values() for r in rs)
    assert sum(r.tokens for rs in results.values() for r in rs) > 1000


def test_refused_valid_instances_are_explained(results):
    for rs in results.values():
        for r in rs:
            unexplained = r.valid - r.valid_accepted - r.valid_unnamed_key
            assert unexplained == 0 or r.name in KNOWN_VALID_GAPS, (r.backend, r.name, r.failures)


def test_compile_errors_are_value_errors_with_a_reason(results):
    errors = [r.error for rs in results.values() for r in rs if not r.compiled]
    assert errors and all(e.startswith("cannot compile json_schema: ") and len(e) > 30 for e in errors)


def test_serialize_puts_keys_in_schema_order(jsb):
    schema = {"properties": {"b": {"properties": {"y": {}, "x": {}}}, "a": {}}}
    order = jsb.property_order(schema)
    assert jsb.serialize({"zz": 1, "a": 1, "b": {"x": 1, "y": 2}}, schema) == '{"b":{"y":2,"x":1},"a":1,"zz":1}'
    assert jsb.has_unnamed_key([{"a": {"q": 1}}], order) and not jsb.has_unnamed_key({"a": 1}, order)
    # each object in the order of its own subschema, through $ref, items and allOf
    per_object = {"properties": {"p": {"properties": {"x": {}, "y": {}}},
                                 "q": {"type": "array", "items": {"$ref": "#/$defs/q"}}},
                  "$defs": {"q": {"allOf": [{"properties": {"y": {}}}, {"properties": {"x": {}}}]}}}
    data = {"q": [{"x": 1, "y": 2}], "p": {"y": 1, "x": 2}}
    assert jsb.serialize(data, per_object) == '{"p":{"x":2,"y":1},"q":[{"y":2,"x":1}]}'
