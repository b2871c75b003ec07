"""How select() picks a choice from the logprobs of each choice's tokens (SGLang's three methods).

Each method gets, per choice, the logprobs of the tokens that spell it after the state's text
(see radixlm.runtime.programs.select for where that span starts) and returns the index picked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Logprobs = Sequence[float]


def _mean(xs: Logprobs) -> float:
    return sum(xs) / len(xs) if xs else float("-inf")


def _argmax(scores: Sequence[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def _token_length_normalized(cond: Sequence[Logprobs], uncond: Sequence[Logprobs] | None) -> tuple[int, list[float]]:
    scores = [_mean(c) for c in cond]
    return _argmax(scores), scores


def _greedy_token_selection(cond: Sequence[Logprobs], uncond: Sequence[Logprobs] | None) -> tuple[int, list[float]]:
    """Highest first-token logprob; ties go to the next token, and so on. A shorter choice is
    padded with its own mean logprob so it can be compared with longer ones."""
    width = max(len(c) for c in cond)
    padded = [list(c) + [_mean(c)] * (width - len(c)) for c in cond]
    alive = list(range(len(cond)))
    for pos in range(width):
        best = max(padded[i][pos] for i in alive)
        alive = [i for i in alive if padded[i][pos] == best]
        if len(alive) == 1:
            break
    return alive[0], [p[0] for p in padded]


def _unconditional_likelihood_normalized(cond: Sequence[Logprobs], uncond: Sequence[Logprobs] | None) -> tuple[int, list[float]]:
    """Mean over tokens of (logprob after the state's text - logprob of the choice on its own)."""
    assert uncond is not None and len(uncond) == len(cond)
    scores = [_mean([c - u for c, u in zip(cs, us)]) for cs, us in zip(cond, uncond)]
    return _argmax(scores), scores


@dataclass(frozen=True)
class ChoicesMethod:
    """A named way to pick a choice; pass one as ``select(..., choices_method=...)``."""

    name: str
    needs_unconditional: bool
    decide: Callable[[Sequence[Logprobs], Sequence[Logprobs] | None], tuple[int, list[float]]]

    def __repr__(self) -> str:
        return f"<choices method {self.name}>"


token_length_normalized = ChoicesMethod("token_length_normalized", False, _token_length_normalized)
greedy_token_selection = ChoicesMethod("greedy_token_selection", False, _greedy_token_selection)
unconditional_likelihood_normalized = ChoicesMethod(
    "unconditional_likelihood_normalized", True, _unconditional_likelihood_normalized)

METHODS: dict[str, ChoicesMethod] = {
    m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)
}
