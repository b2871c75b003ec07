"""Speculative decoding gives exactly the outputs of plain greedy decoding, in fewer forward
passes where the drafts hold, and leaves no KV of a rejected guess behind.

The engines run fp32 with dense weights: each row's logits are then independent of the batch
it is in, so a draft's check (its rows fed together) and plain decoding (one row a step) pick the
same greedy tokens. (In the default format batching itself moves near-tie argmaxes.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from radixlm.runtime.engine import Engine

pytestmark = pytest.mark.slow

ALGORITHMS = ("none", "ngram", "radix")
MOST = 4  # speculative_num_draft_tokens (the default)

DOC = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "city": "London",
       "known_for": "the first published algorithm"}
COPY = [{"role": "user", "content": "Copy this JSON document exactly, with nothing else:\n" + json.dumps(DOC)}]
FREE = "The history of the printing press"
LIST = "Repeat after me: red, green, blue, red, green, blue, red,"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    made = {a: Engine(dtype="float32", quantization="none", max_total_tokens=8192, speculative_algorithm=a)
            for a in ALGORITHMS}
    yield made
    for e in made.values():
        e.shutdown()


@pytest.fixture(autouse=True)
def idle_and_intact(engines: dict[str, Engine]) -> Iterator[None]:
    """After each test every engine is idle with its KV intact: the slots of rejected guesses were
    freed, nothing stays locked."""
    yield
    for e in engines.values():
        e.core.check_idle_integrity()


def _strip(out: dict[str, Any]) -> tuple[Any, ...]:
    m = out["meta_info"]
    return out["text"], out["output_ids"], m["completion_tokens"], m["finish_reason"]


def _all(engines: dict[str, Engine], prompt: Any, params: Any) -> dict[str, Any]:
    return {a: e.generate(prompt, params) for a, e in engines.items()}


def _assert_equal(outs: dict[str, Any]) -> None:
    ref = outs["none"]
    for a in ("ngram", "radix"):
        if isinstance(ref, list):
            assert [_strip(o) for o in outs[a]] == [_strip(o) for o in ref], a
        else:
            assert _strip(outs[a]) == _strip(ref), a


def _drafted_positions(meta: dict[str, Any]) -> set[int]:
    """Output positions of accepted guesses (those past the output's end were accepted, then cut by
    its stop), for a request whose every step after its prompt checked a draft: the prompt's step
    gives token 0, each check its accepted guesses and then the model's own token."""
    assert meta["forward_passes"] == 1 + meta["spec_verify_ct"], meta
    out: set[int] = set()
    at = 1
    for n in meta["spec_accept_lengths"]:
        out.update(range(at, at + n))
        at += n + 1
    return out


def test_copy_task_equal_and_in_fewer_passes(engines):
    outs = _all(engines, COPY, {"temperature": 0, "max_new_tokens": 64})
    _assert_equal(outs)
    assert json.loads(outs["none"]["text"]) == DOC  # the model does copy it (else the test shows little)
    none = outs["none"]["meta_info"]
    assert "spec_verify_ct" not in none and none["forward_passes"] == none["completion_tokens"]
    for a in ("ngram", "radix"):
        m = outs[a]["meta_info"]
        accepts = m["spec_accept_lengths"]
        assert m["spec_verify_ct"] > 0 and sum(accepts) > 0, m
        assert len(accepts) == m["spec_verify_ct"] and all(0 <= n <= MOST for n in accepts), m
        assert m["forward_passes"] < m["completion_tokens"], m
        # each check adds its accepted guesses and one token of the model's (none past the end)
        assert m["completion_tokens"] <= m["forward_passes"] + sum(accepts), m


@pytest.mark.parametrize("prompt", [FREE, LIST])
def test_free_text_equal(engines, prompt):
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    outs = _all(engines, prompt, params)
    _assert_equal(outs)
    for a in ("ngram", "radix"):
        m = outs[a]["meta_info"]
        # ends by length: every check's accepted guesses and model token are output
        assert m["completion_tokens"] == m["forward_passes"] + sum(m["spec_accept_lengths"]), m


def test_rejected_guesses_are_checked_and_dropped(engines):
    """A list that breaks its own pattern: the prompt lookup guesses the pattern goes on, the model
    disagrees at some point, and the output is still plain greedy decoding's."""
    prompt = "a b c d a b c d a b c d a b x y z a b"
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    outs = _all(engines, prompt, params)
    _assert_equal(outs)
    m = outs["ngram"]["meta_info"]
    assert m["spec_verify_ct"] > 0, m


@pytest.mark.parametrize("stop", [
    {"stop": ["computing"]},
    {"stop": ["1815"]},
    {"stop": ["London"], "no_stop_trim": True},
    {"stop_regex": [r"\bmath\w+"]},
])
def test_stop_strings_inside_an_accepted_draft(engines, stop):
    params = {"temperature": 0, "max_new_tokens": 64, **stop}
    outs = _all(engines, COPY, params)
    _assert_equal(outs)
    assert outs["none"]["meta_info"]["finish_reason"]["type"] == "stop"
    for a in ("ngram", "radix"):
        m = outs[a]["meta_info"]
        # the stop was completed by a guessed token, and the guesses accepted after it are dropped
        assert m["completion_tokens"] - 1 in _drafted_positions(m), (a, m)


def test_stop_token_inside_an_accepted_draft(engines):
    full = engines["ngram"].generate(COPY, {"temperature": 0, "max_new_tokens": 64})
    ids = full["output_ids"]
    # a guessed token whose first occurrence it is (so the output ends there), past the first few
    firsts = [k for k in sorted(_drafted_positions(full["meta_info"])) if 3 <= k < len(ids) and ids.index(ids[k]) == k]
    assert firsts, full
    k = firsts[len(firsts) // 2]
    stop_id = ids[k]
    params = {"temperature": 0, "max_new_tokens": 64, "stop_token_ids": [stop_id]}
    outs = _all(engines, COPY, params)
    _assert_equal(outs)
    assert outs["none"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert outs["none"]["meta_info"]["completion_tokens"] == k + 1
    for a in ("ngram", "radix"):
        assert k in _drafted_positions(outs[a]["meta_info"]), a


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_few_new_tokens(engines, max_new_tokens, ignore_eos):
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
    outs = _all(engines, COPY, params)
    _assert_equal(outs)
    for a in ("ngram", "radix"):
        m = outs[a]["meta_info"]
        assert m["completion_tokens"] == max_new_tokens, m  # never past max_new_tokens
        assert sum(m.get("spec_accept_lengths", [])) <= max(0, max_new_tokens - 2), m


def test_ignore_eos_past_the_copy(engines):
    """Drafting goes on past where the model would have ended (the prompt's text guessed again)."""
    outs = _all(engines, COPY, {"temperature": 0, "max_new_tokens": 80, "ignore_eos": True})
    _assert_equal(outs)
    m = outs["ngram"]["meta_info"]
    assert m["finish_reason"]["type"] == "length" and m["completion_tokens"] == 80
    assert m["completion_tokens"] == m["forward_passes"] + sum(m["spec_accept_lengths"]), m


def test_a_batch_with_a_sampled_request(engines):
    """Requests sent together (n=1 each) draft side by side; a sampled one never drafts."""
    prompts = [COPY, FREE, COPY, LIST, COPY]
    params = [
        {"temperature": 0, "max_new_tokens": 48},
        {"temperature": 0, "max_new_tokens": 24},
        {"temperature": 0, "max_new_tokens": 48, "stop": ["computing"]},
        {"temperature": 0.8, "max_new_tokens": 24, "seed": 7},
        {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
    ]
    outs = _all(engines, prompts, params)
    _assert_equal(outs)
    for a in ("ngram", "radix"):
        metas = [o["meta_info"] for o in outs[a]]
        assert "spec_verify_ct" not in metas[3] and metas[3]["forward_passes"] == metas[3]["completion_tokens"]
        assert metas[0]["spec_verify_ct"] > 0 and sum(metas[0]["spec_accept_lengths"]) > 0, metas[0]
        assert metas[0]["forward_passes"] < metas[0]["completion_tokens"], metas[0]


@pytest.mark.parametrize("algorithm", ["ngram", "radix"])
def test_stream_abort_mid_way(engines, algorithm):
    """A stream closed after a few chunks (drafts checked by then) aborts its request: the pool
    ends with nothing leaked and the next request matches plain decoding."""
    e = engines[algorithm]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    stream = e.stream(COPY, params)
    got = 0
    for i, chunk in enumerate(stream):
        got += len(chunk["output_ids"])
        if i == 2:
            break
    stream.close()
    assert got > 3  # (a chunk carried a draft's accepted tokens)
    while e.core.has_work:
        e.core.step()
    e.core.check_idle_integrity()
    short = {"temperature": 0, "max_new_tokens": 24}
    assert _strip(e.generate(COPY, short)) == _strip(engines["none"].generate(COPY, short))


def test_radix_drafts_from_the_cached_answer(engines):
    """The same prompt sent twice: the second time the radix engine follows the first answer in
    the tree (prompt lookup alone finds nothing to guess in this free text)."""
    prompt = "Write a short story about a lighthouse keeper who"
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    first = _all(engines, prompt, params)
    second = _all(engines, prompt, params)
    _assert_equal(first)
    _assert_equal(second)
    assert _strip(second["none"]) == _strip(first["none"])
    m = second["radix"]["meta_info"]
    accepts = m["spec_accept_lengths"]
    assert accepts and sum(accepts) / len(accepts) >= 2, m
    assert m["forward_passes"] < m["completion_tokens"] / 2, m
    ngram = second["ngram"]["meta_info"]
    assert sum(ngram["spec_accept_lengths"]) < sum(accepts), ngram


def test_drafts_under_the_overlap_schedule(engines):
    """With the overlap schedule forced on, each step is processed before the next is scheduled
    (a draft needs the newest tokens on the host): the answers are plain greedy decoding's and the
    drafts are checked."""
    spec = Engine(dtype="float32", quantization="none", max_total_tokens=8192, speculative_algorithm="ngram",
                  overlap_schedule=True)
    try:
        assert spec.core.overlap
        params = {"temperature": 0, "max_new_tokens": 48}
        got = spec.generate([COPY, FREE], params)
        ref = engines["none"].generate([COPY, FREE], params)
        assert [_strip(o) for o in got] == [_strip(o) for o in ref]
        assert got[0]["meta_info"]["spec_verify_ct"] > 0 and sum(got[0]["meta_info"]["spec_accept_lengths"]) > 0
        spec.core.check_idle_integrity()
    finally:
        spec.shutdown()


def test_logprobs_of_accepted_tokens(engines):
    """A request with logprobs drafts too: each accepted token's logprob and top logprobs come from
    its own row of the check, as plain decoding gives them."""
    params = {"temperature": 0, "max_new_tokens": 40}
    outs = {a: e.generate(COPY, params, return_logprob=True, top_logprobs_num=2) for a, e in engines.items()}
    _assert_equal(outs)
    ref = outs["none"]["meta_info"]
    for a in ("ngram", "radix"):
        m = outs[a]["meta_info"]
        assert m["spec_verify_ct"] > 0 and sum(m["spec_accept_lengths"]) > 0, m
        assert [t for _, t in m["output_token_logprobs"]] == outs[a]["output_ids"]
        for (lp, tok), (ref_lp, ref_tok) in zip(m["output_token_logprobs"], ref["output_token_logprobs"], strict=True):
            assert tok == ref_tok and abs(lp - ref_lp) < 1e-3, (a, tok, lp, ref_lp)
        for (lp, tok), top in zip(m["output_token_logprobs"], m["output_top_logprobs"], strict=True):
            assert len(top) == 2 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy = top-1
