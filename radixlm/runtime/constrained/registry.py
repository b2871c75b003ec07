"""The grammar backends by name; ``--grammar-backend``'s choices come from here.

Each backend module imports its grammar engine lazily (xgrammar pulls in torch; llguidance and
outlines-core are only loaded when picked), so importing this registry stays cheap."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Protocol

from radixlm.runtime.constrained.grammar import GrammarBackend, GrammarConfig, XGrammarBackend
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.constrained.outlines_backend import OutlinesBackend
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_PACKAGES", "GrammarBackendFactory", "check_grammar_backend",
           "make_grammar_backend"]


class GrammarBackendFactory(Protocol):
    """Builds a backend for one tokenizer vocabulary (a backend class)."""

    def __call__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> GrammarBackend: ...


GRAMMAR_BACKENDS: dict[str, GrammarBackendFactory] = {
    XGrammarBackend.name: XGrammarBackend,
    LLGuidanceBackend.name: LLGuidanceBackend,
    OutlinesBackend.name: OutlinesBackend,
}


# The package each backend's grammar engine comes from. llguidance (the default) is a dependency
# of radixlm; the others come with the ``grammars`` extra: pip install "radixlm[grammars]".
GRAMMAR_PACKAGES: dict[str, str] = {
    XGrammarBackend.name: "xgrammar",
    LLGuidanceBackend.name: "llguidance",
    OutlinesBackend.name: "outlines_core",
}


def check_grammar_backend(name: str) -> None:
    """ValueError unless ``name`` is a backend whose grammar engine is installed (the message
    says what to choose or install)."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {sorted(GRAMMAR_BACKENDS)}")
    if importlib.util.find_spec(GRAMMAR_PACKAGES[name]) is None:
        raise ValueError(f"grammar backend {name!r} needs the {GRAMMAR_PACKAGES[name]} package: "
                         "pip install \"radixlm[grammars]\" (or choose another grammar backend)")


def make_grammar_backend(name: str, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> GrammarBackend:
    """The backend called ``name``; ValueError naming the choices when there is none or what to
    install when its grammar engine is missing."""
    check_grammar_backend(name)
    return GRAMMAR_BACKENDS[name](vocab, config)


if TYPE_CHECKING:  # every backend's matchers and grammars satisfy the protocols the engine drives
    from radixlm.runtime.constrained.grammar import Grammar, GrammarMatcher, XGrammarGrammar, XGrammarMatcher
    from radixlm.runtime.constrained.llguidance_backend import LLGuidanceGrammar, LLGuidanceMatcher
    from radixlm.runtime.constrained.outlines_backend import OutlinesGrammar, OutlinesMatcher

    _MATCHERS: tuple[type[GrammarMatcher], ...] = (XGrammarMatcher, LLGuidanceMatcher, OutlinesMatcher)
    _GRAMMARS: tuple[type[Grammar], ...] = (XGrammarGrammar, LLGuidanceGrammar, OutlinesGrammar)
