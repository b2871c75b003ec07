"""The grammar-backend registry and the matcher protocol every backend implements."""

import inspect

import pytest

from radixlm.runtime.constrained import GRAMMAR_BACKENDS, GrammarMatcher, make_grammar_backend
from radixlm.runtime.constrained.grammar import XGrammarMatcher
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceMatcher
from radixlm.runtime.constrained.outlines_backend import OutlinesMatcher
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab


def _protocol_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_registry_names_every_backend_by_its_own_name():
    assert sorted(GRAMMAR_BACKENDS) == ["llguidance", "outlines", "xgrammar"]
    for name, factory in GRAMMAR_BACKENDS.items():
        assert factory.name == name


def test_matcher_protocol_declares_what_the_engine_calls():
    needed = {"fill_mask", "accept", "rollback", "forced_text", "is_completed", "is_terminated"}
    assert needed <= _protocol_methods(GrammarMatcher)


@pytest.mark.parametrize("matcher", [XGrammarMatcher, LLGuidanceMatcher, OutlinesMatcher])
def test_every_matcher_implements_every_protocol_method(matcher):
    for name in _protocol_methods(GrammarMatcher):
        ours = inspect.signature(getattr(GrammarMatcher, name))
        theirs = inspect.signature(getattr(matcher, name))
        assert list(theirs.parameters) == list(ours.parameters), name


def test_unknown_backend_names_the_choices():
    vocab = TokenizerVocab((b"a",), 1, frozenset(), (), "byte_level")
    with pytest.raises(ValueError, match="choose one of \\['llguidance', 'outlines', 'xgrammar'\\]"):
        make_grammar_backend("guidance", vocab)
