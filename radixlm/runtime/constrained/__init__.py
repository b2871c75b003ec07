"""Constrained decoding: grammar backends, tokenizer description, token bitmasks."""

from radixlm.runtime.constrained.grammar import (
    GRAMMAR_KINDS,
    Grammar,
    GrammarBackend,
    GrammarConfig,
    GrammarMatcher,
    XGrammarBackend,
    bitmask_width,
)
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS, make_grammar_backend
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab, build_tokenizer_vocab

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "Grammar",
    "GrammarBackend",
    "GrammarConfig",
    "GrammarMatcher",
    "TokenizerVocab",
    "XGrammarBackend",
    "bitmask_width",
    "build_tokenizer_vocab",
    "make_grammar_backend",
]
