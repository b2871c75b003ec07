"""Incremental detokenization: output token ids in, final text out, chunk by chunk.

Pure Python over a Hugging Face tokenizer (no torch). Each push decodes only a small window of
recent tokens (the prefix/read offset technique used by vLLM and SGLang), so the cost per token
does not grow with the output length.

Guarantees, for tokenizers whose decode of a window starting at a character boundary agrees with
the decode of the whole sequence (byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM2; sentencepiece
with a Metaspace decoder, given a ``prompt_tail``):

- emitted text never changes later: a chunk is emitted only once it is final;
- a character whose UTF-8 bytes span several tokens is held back (it decodes to trailing
  U+FFFD) until its last byte arrives, or until ``flush()`` at the end of the stream; a long run
  of invalid bytes is released once it is final (a bounded number of tokens later);
- with no ``prompt_tail`` (or a byte-level tokenizer), the concatenation of all pushes plus
  ``flush()`` equals ``tokenizer.decode(output_ids, skip_special_tokens=...,
  clean_up_tokenization_spaces=False)`` exactly.

``clean_up_tokenization_spaces`` is always off: it rewrites text that was already emitted
(" ." -> "."), and HF skips it for BPE tokenizers anyway.

Known limit (shared with vLLM and SGLang): a byte-fallback decoder (Llama 2, Mistral) turns a whole
run of byte tokens into U+FFFD when any byte of the run is invalid, so if a model emits a valid
character and then an invalid byte in the same run, the character already emitted differs from
what ``decode`` of the whole output gives. Valid UTF-8 is always exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Tokens past the last clean character boundary before the window is cut inside a run of
# invalid bytes (which keeps decoding to a trailing U+FFFD and would otherwise grow the window).
_MAX_PENDING_TOKENS = 8
# How many cut points to try then, nearest the end first.
_CUT_TRIES = 6


def _trailing_replacements(text: str) -> int:
    """How many U+FFFD end ``text``: they may be a character whose bytes are still coming."""
    return len(text) - len(text.rstrip(_REPLACEMENT))


def _is_stock_fast(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` is transformers' own fast-tokenizer decode (not overridden)."""
    if not getattr(tokenizer, "is_fast", False):
        return False
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    cls = type(tokenizer)
    return all(
        getattr(getattr(cls, name, None), "__module__", "").startswith(
            "transformers.tokenization_utils"
        )
        for name in ("decode", "_decode")
    )


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of final text chunks.

    ``push(ids)`` appends output tokens and returns the text that became final; ``flush()`` at
    the end of the stream returns what was held back (an incomplete trailing character, which
    then decodes to U+FFFD exactly as ``tokenizer.decode`` would). ``text`` is everything
    emitted so far and ``output_ids`` every output token pushed (do not mutate it).

    ``prompt_tail`` is the last few prompt tokens (5 is plenty). They are context only: their
    text is never emitted, but they let a sentencepiece tokenizer keep the leading space of the
    first output token (decoding the output alone would strip it). For byte-level BPE they
    change nothing. A tail whose text ends in an incomplete character is ignored.

    With ``skip_special_tokens`` special tokens produce no text. ``spaces_between_special_tokens``
    is passed through to ``tokenizer.decode`` (HF fast tokenizers ignore it).
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_tail: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        # A stock HF fast tokenizer's decode (cleanup off) is its Rust backend's decode; calling
        # the backend directly is ~6x cheaper per call, and this runs for every token.
        self._backend = tokenizer.backend_tokenizer if _is_stock_fast(tokenizer) else None
        self._output_ids: list[int] = []
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

        # The decode window: token ids from the prefix offset on. Its first ``_read`` tokens
        # end on a character boundary and their text is all emitted (or is prompt context);
        # ``_emitted`` counts the characters of decode(window) emitted or treated as context.
        window = [int(t) for t in prompt_tail]
        context = self._decode(window) if window else ""
        if context.endswith(_REPLACEMENT):
            # The prompt ends inside a character; decode the output on its own instead.
            window, context = [], ""
        self._window: list[int] = window
        self._read = len(window)
        self._emitted = len(context)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            text: str = self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        else:
            text = self.tokenizer.decode(ids, **self._decode_kwargs)
        return text

    @property
    def output_ids(self) -> list[int]:
        """All output token ids pushed so far (the detokenizer's own list: do not mutate)."""
        return self._output_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache] if self._text_cache else []
        return self._text_cache

    def _emit(self, out: str) -> str:
        if out:
            self._chunks.append(out)
            self._text_cache = None
        return out

    def push(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text that is now final (possibly "")."""
        if not token_ids:
            return ""
        ids = [int(t) for t in token_ids]
        self._output_ids.extend(ids)
        window = self._window
        window.extend(ids)

        full = self._decode(window)
        held = _trailing_replacements(full)
        end = len(full) - held
        out = full[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)

        if held == 0:
            # The text ends on a character boundary: everything is emitted. The tokens up to the
            # old read offset leave the window; the rest stay as context for the next push
            # (sentencepiece needs a preceding token to decode a leading space).
            if self._read:
                window = self._window = window[self._read :]
                self._emitted = len(self._decode(window))
            self._read = len(window)
        elif len(window) - self._read > _MAX_PENDING_TOKENS:
            out += self._cut_invalid_run(full)
        return self._emit(out)

    def _cut_invalid_run(self, full: str) -> str:
        """Shrink a window that keeps ending in U+FFFD (a run of invalid bytes).

        A cut is safe where decoding both sides separately gives the same text as decoding
        them together: then no byte on the left is still waiting for a continuation byte on
        the right (that would change the count of U+FFFD or make a character), so the left
        text is final. Returns the newly final text left of the cut.
        """
        window = self._window
        for cut in range(len(window) - 1, max(self._read, len(window) - 1 - _CUT_TRIES), -1):
            left = self._decode(window[:cut])
            right = self._decode(window[cut:])
            consistent = len(left) + len(right) == len(full)
            if consistent and full.startswith(left) and full.endswith(right):
                out = left[self._emitted :]
                self._window = window[cut:]
                self._read = 0
                self._emitted = max(self._emitted, len(left)) - len(left)
                return out
        return ""

    def flush(self) -> str:
        """End of stream: return the held-back text (an incomplete character decodes to U+FFFD)."""
        if not self._window:
            return ""
        full = self._decode(self._window)
        out = full[self._emitted :]
        self._emitted = len(full)
        return self._emit(out)
