"""The grammar backends by name; ``--grammar-backend``'s choices come from here.

Each backend module imports its grammar engine lazily (xgrammar pulls in torch, outlines-core is
only loaded when picked), so importing this registry stays cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from radixlm.runtime.constrained.grammar import GrammarBackend, GrammarConfig, XGrammarBackend
from radixlm.runtime.constrained.outlines_backend import OutlinesBackend
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = ["GRAMMAR_BACKENDS", "GrammarBackendFactory", "make_grammar_backend"]


class GrammarBackendFactory(Protocol):
    """Builds a backend for one tokenizer vocabulary (a backend class)."""

    def __call__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> GrammarBackend: ...


GRAMMAR_BACKENDS: dict[str, GrammarBackendFactory] = {
    XGrammarBackend.name: XGrammarBackend,
    OutlinesBackend.name: OutlinesBackend,
}


def make_grammar_backend(name: str, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> GrammarBackend:
    """The backend called ``name``; ValueError naming the choices when there is none."""
    factory = GRAMMAR_BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {sorted(GRAMMAR_BACKENDS)}")
    return factory(vocab, config)


if TYPE_CHECKING:  # both backends' matchers and grammars satisfy the protocols the engine drives
    from radixlm.runtime.constrained.grammar import Grammar, GrammarMatcher, XGrammarGrammar, XGrammarMatcher
    from radixlm.runtime.constrained.outlines_backend import OutlinesGrammar, OutlinesMatcher

    _MATCHERS: tuple[type[GrammarMatcher], ...] = (XGrammarMatcher, OutlinesMatcher)
    _GRAMMARS: tuple[type[Grammar], ...] = (XGrammarGrammar, OutlinesGrammar)
