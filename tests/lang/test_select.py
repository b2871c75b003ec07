"""select() on prefixes whose last token merges with a choice's first characters: the scores
must equal a reference computed by hand from full-sequence logprobs."""

from __future__ import annotations

import pytest

import radixlm.lang as sgl

pytestmark = pytest.mark.slow

CASES = [
    # every choice merges with the trailing space ("Ġ" + "yes" -> "Ġyes")
    ("The answer is ", ["yes", "no", "maybe"]),
    # "ana" merges with "Ġban" into "Ġbanana"; "anana split" keeps "Ġban"
    ("My favourite fruit is the ban", ["ana", "anana split"]),
    # "=1" merges "Ġ=" into "Ġ=="; " 1" does not merge
    ("x =", ["=1", " 1"]),
    # a clean boundary with leading spaces
    ("Is the sky blue? Answer:", [" yes", " no"]),
]


@sgl.function
def pick(s, prefix, choices, method):
    s += prefix
    s += sgl.select("choice", choices, choices_method=method)


def full_logprobs(engine, ids: list[int]) -> list[float | None]:
    """Logprob of every token of ``ids`` given the ones before it, computed from position 0."""
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    return [lp for lp, _ in out["meta_info"]["input_token_logprobs"]]


def reference(engine, prefix: str, choices: list[str]) -> tuple[int, list[list[float]], list[list[int]]]:
    """Shared scoring start (the earliest token where a choice's joint tokenization leaves the
    prefix's), each choice's logprobs and token ids from there."""
    prefix_ids = engine.encode(prefix)
    joints = [engine.encode(prefix + c) for c in choices]

    def first_difference(ids: list[int]) -> int:
        i = 0
        while i < min(len(ids), len(prefix_ids)) and ids[i] == prefix_ids[i]:
            i += 1
        return i

    start = min(first_difference(j) for j in joints)
    return start, [full_logprobs(engine, j)[start:] for j in joints], [j[start:] for j in joints]


@pytest.mark.parametrize("prefix,choices", CASES)
def test_scores_match_hand_computed_reference(engine, engine_backend, prefix, choices):
    start, logprobs, _ = reference(engine, prefix, choices)
    st = pick.run(prefix, choices, sgl.token_length_normalized, backend=engine_backend)
    meta = st.get_meta_info("choice")
    assert meta["score_start"] == start
    expected = [sum(lps) / len(lps) for lps in logprobs]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert [[lp for lp, _ in span] for span in meta["input_token_logprobs"]] == \
        [pytest.approx(lps, abs=1e-4) for lps in logprobs]
    assert st["choice"] == choices[expected.index(max(expected))]
    assert st.text() == prefix + st["choice"]


def test_merging_prefix_scores_from_the_merged_token(engine, engine_backend):
    prefix, choices = CASES[0]
    start, _, ids = reference(engine, prefix, choices)
    assert start == len(engine.encode(prefix)) - 1  # the trailing space token is re-scored
    meta = pick.run(prefix, choices, "token_length_normalized", backend=engine_backend).get_meta_info("choice")
    assert [[t for _, t in span] for span in meta["input_token_logprobs"]] == ids
    assert all(len(span) == 1 for span in ids)  # "Ġyes", "Ġno", "Ġmaybe": one token each


def test_greedy_and_unconditional_methods_match_reference(engine, engine_backend):
    prefix, choices = CASES[1]
    _, logprobs, ids = reference(engine, prefix, choices)
    greedy = pick.run(prefix, choices, sgl.greedy_token_selection, backend=engine_backend)
    first = [lps[0] for lps in logprobs]
    assert greedy["choice"] == choices[first.index(max(first))]

    st = pick.run(prefix, choices, sgl.unconditional_likelihood_normalized, backend=engine_backend)
    # a choice's tokens on their own; the first has no context (logprob 0, no correction)
    alone = [[0.0] + (full_logprobs(engine, span)[1:] if len(span) > 1 else []) for span in ids]
    expected = [sum(c - u for c, u in zip(cs, us)) / len(cs) for cs, us in zip(logprobs, alone)]
    assert st.get_meta_info("choice")["scores"] == pytest.approx(expected, abs=1e-4)
    assert st["choice"] == choices[expected.index(max(expected))]
