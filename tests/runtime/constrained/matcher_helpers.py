"""Helpers shared by the grammar backend tests: tokenize, feed a matcher, read its mask."""

from __future__ import annotations

from radixlm.runtime.constrained.bitmask import allocate_bitmask, allowed_tokens


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _feed(matcher, ids) -> int | None:
    """Accept ids in order; the index of the first rejected one, or None."""
    for i, t in enumerate(ids):
        if not matcher.accept(t):
            return i
    return None


def _mask(matcher, width: int) -> set[int]:
    row = allocate_bitmask(1, width)[0]
    matcher.fill_mask(row)
    return set(allowed_tokens(row, width))


def _added_ids(tok) -> set[int]:
    return set(tok.added_tokens_decoder) | set(tok.all_special_ids)
