"""GrammarService: what the engine needs for constrained decoding, built once per tokenizer.

It owns the tokenizer description, the grammar backend (with its compiled-grammar cache), a
small thread pool that compiles new constraints off the step loop (the engine keeps stepping
other requests meanwhile) within a time limit, and the jump-forward planner. Pure Python: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.compile_pool import CompilePool
from radixlm.runtime.constrained.grammar import Grammar, GrammarConfig, normalize_spec
from radixlm.runtime.constrained.jump_forward import JumpForward
from radixlm.runtime.constrained.limits import SpecLimits, check_spec
from radixlm.runtime.constrained.pre_tokens import split_rule
from radixlm.runtime.constrained.registry import check_grammar_backend, make_grammar_backend
from radixlm.runtime.constrained.tokenizer_info import build_tokenizer_vocab
from radixlm.runtime.tokenizer_lock import encoding_lock

__all__ = ["ERROR_PREFIX", "GrammarService", "check_constraint", "grammar_config", "text_encoder"]

ERROR_PREFIX = "constrained decoding:"

log = logging.getLogger(__name__)

_SEPARATORS = {"compact": (",", ":"), "spaced": (", ", ": "), "any": (",", ":")}


def grammar_config(config: ConstraintConfig) -> GrammarConfig:
    """The backend-level grammar config that an engine's ConstraintConfig asks for."""
    return GrammarConfig(
        json_separators=_SEPARATORS[config.json_whitespace],
        json_any_whitespace=config.json_whitespace == "any",
        cache_size=config.grammar_cache_size,
        fill_threads=config.grammar_fill_threads,
        fallback=config.grammar_fallback,
        limits=SpecLimits(max_bytes=config.grammar_max_bytes, max_schema_bytes=config.grammar_max_schema_bytes,
                          max_nesting=config.grammar_max_nesting, max_ref_nesting=config.grammar_max_ref_nesting,
                          max_enum=config.grammar_max_enum, max_repeat=config.grammar_max_repeat),
    )


def check_constraint(kind: str, spec: Any, config: ConstraintConfig) -> None:
    """What is checked of a constraint before any compile, as ``GrammarService.submit`` checks it:
    ValueError unless the grammar backend is installed and the spec is well formed and within the
    limits (the message starts with ``constrained decoding:``)."""
    try:
        check_grammar_backend(config.grammar_backend)
    except ValueError as e:
        raise ValueError(f"{ERROR_PREFIX} {e}") from None
    _checked(kind, spec, grammar_config(config).limits)


def _checked(kind: str, spec: Any, limits: SpecLimits) -> None:
    try:
        _, norm = normalize_spec(kind, spec)
        check_spec(kind, norm, limits)
    except ValueError as e:
        raise ValueError(f"{ERROR_PREFIX} {e}") from None


# texts on which the Rust tokenizer must agree with the tokenizer's own encode before it stands in
_PROBES = ('{"name":"Alice Martin","age":34,"tags":["a b",true,null]}', " Hello  world\n\t", "naïve café — 東京 😀",
           "x = 1.5e-3; y=[0,10,200]", "  leading spaces", "<tag attr='v'>text</tag>")


def text_encoder(tokenizer: Any, hf_json: str) -> Callable[[str], list[int]]:
    """Text -> token ids without special tokens, as ``tokenizer.encode`` gives them: through the
    Rust tokenizer directly where it agrees with ``encode`` on a few probe texts (jump-forward
    re-tokenizes on the step's critical path, and the Python wrapper costs ~10x the encode). The
    Rust tokenizer is a copy of its own, which no wrapper call switches to split special tokens."""
    def slow(text: str) -> list[int]:
        with encoding_lock(tokenizer):
            return list(tokenizer.encode(text, add_special_tokens=False))

    if not hf_json:
        return slow
    from tokenizers import Tokenizer

    rust = Tokenizer.from_str(hf_json)

    def fast(text: str) -> list[int]:
        return list(rust.encode(text, add_special_tokens=False).ids)

    return fast if all(fast(t) == slow(t) for t in _PROBES) else slow


class GrammarService:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], config: ConstraintConfig) -> None:
        check_grammar_backend(config.grammar_backend)
        self.config = config
        self.vocab = build_tokenizer_vocab(tokenizer, vocab_size, stop_ids)
        self.backend = make_grammar_backend(config.grammar_backend, self.vocab, grammar_config(config))
        encode = text_encoder(tokenizer, self.vocab.hf_json)
        self.jump_forward = JumpForward(self.vocab, encode, split=split_rule(self.vocab.hf_json, encode))
        self._pool = CompilePool(config.grammar_compile_workers, config.grammar_compile_timeout, self._timed_out)

    def submit(self, kind: str, spec: Any) -> Future[Grammar]:
        """Start compiling; a malformed or too large spec raises ValueError here, a failing or
        overlong compile in the future.

        Both messages start with ``constrained decoding:`` so servers can name the field."""
        _checked(kind, spec, self.backend.config.limits)
        known: Future[Grammar] = Future()
        try:
            grammar = self.backend.cached(kind, spec)
        except ValueError as e:  # compiled before, and failed: fails again at once
            known.set_exception(ValueError(f"{ERROR_PREFIX} {e}"))
            return known
        if grammar is None:
            return self._pool.submit(self._compile, kind, spec)
        known.set_result(grammar)
        return known

    def _compile(self, kind: str, spec: Any) -> Grammar:
        try:
            return self.backend.compile(kind, spec)
        except ValueError as e:
            raise ValueError(f"{ERROR_PREFIX} {e}") from None
        except Exception as e:  # a grammar-engine bug must fail its request only, not the step loop
            log.exception("compiling a %s constraint raised %s", kind, type(e).__name__)
            raise ValueError(f"{ERROR_PREFIX} cannot compile {kind}: the grammar engine failed "
                             f"({type(e).__name__}: {e})") from None

    def _timed_out(self, kind: str, spec: Any) -> str:
        """The pool's deadline passed: remember the failure (the same spec sent again fails at
        once) and return the request's error message."""
        message = (f"cannot compile {kind}: grammar compile exceeded {self._pool.timeout_s:g} s "
                   "(server option --grammar-compile-timeout)")
        self.backend.remember_failure(kind, spec, message)
        return f"{ERROR_PREFIX} {message}"

    def shutdown(self) -> None:
        self._pool.shutdown()
