"""GrammarService: what the engine needs for constrained decoding, built once per tokenizer.

It owns the tokenizer description, the grammar backend (with its compiled-grammar cache), a
small thread pool that compiles new constraints off the step loop (the engine keeps stepping
other requests meanwhile), and the jump-forward planner. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.grammar import GRAMMAR_BACKENDS, Grammar, GrammarConfig, normalize_spec
from radixlm.runtime.constrained.jump_forward import JumpForward
from radixlm.runtime.constrained.tokenizer_info import build_tokenizer_vocab

__all__ = ["ERROR_PREFIX", "GrammarService", "grammar_config"]

ERROR_PREFIX = "constrained decoding:"

_SEPARATORS = {"compact": (",", ":"), "spaced": (", ", ": "), "any": (",", ":")}


def grammar_config(config: ConstraintConfig) -> GrammarConfig:
    """The backend-level grammar config that an engine's ConstraintConfig asks for."""
    return GrammarConfig(
        json_separators=_SEPARATORS[config.json_whitespace],
        json_any_whitespace=config.json_whitespace == "any",
        cache_size=config.grammar_cache_size,
    )


class GrammarService:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], config: ConstraintConfig) -> None:
        if config.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"unknown grammar backend {config.grammar_backend!r}; choose one of {sorted(GRAMMAR_BACKENDS)}"
            )
        self.config = config
        self.vocab = build_tokenizer_vocab(tokenizer, vocab_size, stop_ids)
        self.backend = GRAMMAR_BACKENDS[config.grammar_backend](self.vocab, grammar_config(config))
        self.jump_forward = JumpForward(self.vocab, lambda text: tokenizer.encode(text, add_special_tokens=False))
        self._pool = ThreadPoolExecutor(config.grammar_compile_workers, thread_name_prefix="grammar-compile")

    def submit(self, kind: str, spec: Any) -> Future[Grammar]:
        """Start compiling; a malformed spec raises ValueError here, a failing compile in the future.

        Both messages start with ``constrained decoding:`` so servers can name the field."""
        try:
            normalize_spec(kind, spec)
        except ValueError as e:
            raise ValueError(f"{ERROR_PREFIX} {e}") from None
        return self._pool.submit(self._compile, kind, spec)

    def _compile(self, kind: str, spec: Any) -> Grammar:
        try:
            return self.backend.compile(kind, spec)
        except ValueError as e:
            raise ValueError(f"{ERROR_PREFIX} {e}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
