"""select(): score every choice by the logprobs of its tokens after the state's text.

Token boundary. A choice is scored as part of the joint text ``prefix + choice``, tokenized as
the model would see it. Where the prefix's last token merges with the choice's first characters
(``"Answer: "`` + ``"yes"`` is spelled ``"Answer:"``, ``" yes"``), the joint tokens diverge from
the prefix's tokens before the prefix ends. Every choice is scored from the same position: the
earliest token at which any choice's joint tokens differ from the prefix's tokens. Each score is
then the log-probability of the whole remaining text given the same context, so choices that
merge and choices that do not stay comparable, and no shared prefix token is counted for one
choice and not another (SGLang issues #523, #608, #1257).

Requests: the prefix is prefilled first (its KV cached, its token count returned); then one
batched request scores the prefix and every joint text from ``WINDOW`` tokens before the prefix
ends, so the divergence is found from token ids and the shared prefix is read from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.programs.choices import METHODS
from radixlm.runtime.programs.connection import Connection, TokenLogprob

# Tokens before the end of the prefix that are re-scored to find where choices diverge; a
# merge reaching further back is handled by scoring again from position 0.
WINDOW = 4


@dataclass(frozen=True)
class SelectResult:
    choice: str
    meta: dict[str, Any]


def divergence(prefix_ids: Sequence[int | str], joint_ids: Sequence[int | str]) -> int:
    """Index of the first token where ``joint_ids`` stops matching ``prefix_ids``."""
    for i, (a, b) in enumerate(zip(prefix_ids, joint_ids)):
        if a != b:
            return i
    return min(len(prefix_ids), len(joint_ids))


def score_spans(prefix_row: list[TokenLogprob], joint_rows: list[list[TokenLogprob]]) -> tuple[int, list[list[TokenLogprob]]]:
    """The shared scoring start (relative to the rows) and each choice's scored tokens."""
    prefix_ids = [t for _, t in prefix_row]
    start = min(divergence(prefix_ids, [t for _, t in row]) for row in joint_rows)
    return start, [row[start:] for row in joint_rows]


async def run_select(conn: Connection, prefix: str, choices: list[str], method_name: str) -> SelectResult:
    """Pick a choice; meta holds the scores and token logprobs SGLang's select reports."""
    method = METHODS[method_name]
    n_prefix = await conn.prefill(prefix) if prefix else 0
    window_start = max(n_prefix - WINDOW, 0)
    start, spans = await _spans(conn, prefix, choices, window_start)
    if start == 0 and window_start > 0:  # the merge reaches past the window: score everything
        window_start = 0
        start, spans = await _spans(conn, prefix, choices, 0)
    # With an empty prefix the first token has no context and no logprob; it is left out.
    cond = [[lp for lp, _ in span if lp is not None] for span in spans]
    if any(not c for c in cond):
        raise ValueError(f"select could not score every choice of {choices!r}: give it a non-empty prefix")
    uncond = await _unconditional(conn, spans, cond) if method.needs_unconditional else None
    index, scores = method.decide(cond, uncond)
    meta: dict[str, Any] = {
        "choices": list(choices),
        "scores": scores,
        "normalized_prompt_logprobs": [sum(c) / len(c) for c in cond],
        "input_token_logprobs": spans,
        "score_start": window_start + start,
    }
    if uncond is not None:
        meta["unconditional_token_logprobs"] = uncond
    return SelectResult(choices[index], meta)


async def _spans(conn: Connection, prefix: str, choices: list[str], window_start: int) -> tuple[int, list[list[TokenLogprob]]]:
    """One batched request: the prefix and each joint text, scored from ``window_start``."""
    joints = [prefix + c for c in choices]
    rows = await conn.input_logprobs(([prefix] if prefix else []) + joints, window_start)
    return score_spans(rows[0] if prefix else [], rows[-len(joints):])


async def _unconditional(conn: Connection, spans: list[list[TokenLogprob]], cond: list[list[float]]) -> list[list[float]]:
    """Each choice's scored tokens on their own; the first has no context and gets logprob 0
    (no correction), so single-token choices need no request."""
    longer = [i for i, span in enumerate(spans) if len(span) > 1]
    rows = await conn.input_logprobs([[t for _, t in spans[i]] for i in longer], 0) if longer else []
    alone = {i: [0.0 if lp is None else lp for lp, _ in row] for i, row in zip(longer, rows)}
    return [alone.get(i, [0.0] * len(spans[i]))[-len(c):] for i, c in enumerate(cond)]
