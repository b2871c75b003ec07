"""The grammar engine's view of a tokenizer: the bytes each token id stands for.

Built here rather than with ``xgrammar.TokenizerInfo.from_huggingface`` because that one leaves
the special and added tokens of SmolLM2's tokenizer (``<|im_start|>``, ``<repo_name>``, ...)
as ordinary text tokens: with it, ``<|im_start|>`` is allowed inside a JSON string (checked with
xgrammar 0.2.8, where its ``special_token_ids`` comes back empty for this tokenizer). Here every
special or added token, and every id past the tokenizer's vocab up to the logits width, decodes
to ``b""``, which grammar engines treat as "never part of the text"; the stop ids are allowed
only where the grammar may end. It also carries the Rust tokenizer's JSON, for an engine that
tokenizes forced text itself (llguidance), which must then agree with ``decoded``. This module
imports neither torch nor a grammar engine.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TokenizerVocab", "build_tokenizer_vocab", "byte_level_decoder"]


def byte_level_decoder() -> dict[str, int]:
    """Map each character of the GPT-2 byte-level alphabet back to the byte it encodes."""
    # Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to 256+.
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    kept_set = set(kept)
    decoder = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept_set:
            decoder[chr(256 + shifted)] = b
            shifted += 1
    return decoder


@dataclass(frozen=True)
class TokenizerVocab:
    """What a grammar engine needs to know about the tokenizer, as plain Python data.

    ``decoded[i]`` is the exact bytes token ``i`` adds to the text, ``b""`` for ids that must
    never appear inside constrained text; ``len(decoded) == vocab_size`` (the logits width).
    ``hf_json``: the Hugging Face Rust tokenizer serialized (``""`` when there is none).
    """

    decoded: tuple[bytes, ...]
    vocab_size: int
    special_ids: frozenset[int]
    stop_ids: tuple[int, ...]
    kind: str  # "byte_level" or "byte_fallback"
    hf_json: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.decoded) == self.vocab_size
        assert all(0 <= s < self.vocab_size for s in self.stop_ids)


def _token_table(tokenizer: Any) -> dict[int, str]:
    table: dict[int, str] = {}
    for token, idx in tokenizer.get_vocab().items():
        table[int(idx)] = token
    return table


def _added_ids(tokenizer: Any) -> set[int]:
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i in added)
    return ids


def _rust_tokenizer_json(tokenizer: Any) -> str:
    """A fast tokenizer's Rust tokenizer as JSON, without padding or truncation ('' if none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    backend = copy.copy(backend)  # a new Rust tokenizer: the tokenizer in use keeps its settings
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


def _detect_kind(tokens: Iterable[str], byte_chars: set[str]) -> str:
    for tok in tokens:
        if any(ch not in byte_chars for ch in tok):
            return "byte_fallback"
    return "byte_level"


def _decode_byte_fallback(token: str) -> bytes:
    # SentencePiece style: "<0x0A>" is a raw byte, "▁" a space.
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode("utf-8")


def build_tokenizer_vocab(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None
) -> TokenizerVocab:
    """Describe ``tokenizer`` (a Hugging Face tokenizer) for a model whose logits are
    ``vocab_size`` wide.

    ``stop_token_ids`` defaults to the tokenizer's EOS id; they are the only tokens the
    grammar allows once the constrained text is complete.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if stop_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
        stop_token_ids = [eos]
    stops = tuple(dict.fromkeys(int(s) for s in stop_token_ids))
    if not stops:
        raise ValueError("stop_token_ids must not be empty")
    for s in stops:
        if not 0 <= s < vocab_size:
            raise ValueError(f"stop token id {s} is outside the logits width {vocab_size}")

    table = _token_table(tokenizer)
    added = _added_ids(tokenizer)
    special = {i for i in added if i < vocab_size} | set(stops)
    normal = {i: t for i, t in table.items() if i < vocab_size and i not in special}

    byte_dec = byte_level_decoder()
    kind = _detect_kind(normal.values(), set(byte_dec))
    decoded: list[bytes] = [b""] * vocab_size
    for i, tok in normal.items():
        if kind == "byte_level":
            decoded[i] = bytes(byte_dec[ch] for ch in tok)
        else:
            decoded[i] = _decode_byte_fallback(tok)
    # Ids with no text (holes, padding up to the logits width) are never allowed either.
    special.update(i for i in range(vocab_size) if not decoded[i])
    return TokenizerVocab(
        decoded=tuple(decoded),
        vocab_size=vocab_size,
        special_ids=frozenset(special),
        stop_ids=stops,
        kind=kind,
        hf_json=_rust_tokenizer_json(tokenizer),
    )
