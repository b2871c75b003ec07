"""Speculative decoding's plain parts: prompt-lookup drafts, the per-request draft length, the
config's validation and its CLI flags (the engine's use of them: tests/runtime/test_speculation.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.cli import main
from radixlm.runtime.config import MAX_DRAFT_TOKENS, EngineConfig, SpeculativeConfig
from radixlm.runtime.radix_cache import RadixCache, SlotAllocator
from radixlm.runtime.speculation.drafts import MAX_PAUSE, DraftLength, DraftProposer, PromptLookup


def lookup(tokens: list[int]) -> PromptLookup:
    p = PromptLookup()
    p.sync(tokens)
    return p


# -- PromptLookup --------------------------------------------------------------------------

def test_drafts_what_followed_the_last_trigram_before():
    p = lookup([10, 11, 12, 13, 14, 20, 10, 11, 12])
    assert p.draft(4) == [13, 14, 20, 10]
    assert p.draft(1) == [13]
    assert p.draft(100) == [13, 14, 20, 10, 11, 12]  # up to the end of the tokens held


def test_the_newest_earlier_occurrence_wins():
    assert lookup([1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]).draft(2) == [8, 1]


def test_falls_back_to_the_last_bigram():
    # (9, 11, 12) never occurred before; (11, 12) did, followed by 13
    assert lookup([5, 11, 12, 13, 9, 11, 12]).draft(3) == [13, 9, 11]
    # a trigram match is preferred to a newer bigram match
    assert lookup([4, 1, 2, 6, 7, 8, 1, 2, 9, 4, 1, 2]).draft(1) == [6]


@pytest.mark.parametrize("tokens", [[], [1], [1, 2], [1, 2, 3, 4], [1, 2, 3, 1, 4], [7, 7, 8, 9]])
def test_nothing_without_an_earlier_match(tokens):
    """A single repeated token is no match (too common to pay), nor is a sequence too short."""
    assert lookup(tokens).draft(4) == []


def test_a_repeated_token_run_drafts_itself():
    assert lookup([3, 5, 5, 5, 5]).draft(3) == [5]  # (5, 5, 5) ended at 4 before: then came the last 5


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), cuts=st.lists(st.integers(1, 6), max_size=20))
def test_incremental_sync_equals_a_fresh_build(tokens, cuts):
    p = PromptLookup()
    at = 0
    for step in [*cuts, len(tokens)]:
        at = min(len(tokens), at + step)
        p.sync(tokens[:at])
        fresh = lookup(tokens[:at])
        assert p.tokens == fresh.tokens == tokens[:at]
        for limit in (1, 2, 5, 40):
            assert p.draft(limit) == fresh.draft(limit)


@pytest.mark.parametrize("then", [
    [1, 2, 3, 4, 1, 2],  # shorter (tokens dropped)
    [1, 2, 3, 4, 1, 2, 9],  # same length, another last token
    [9, 9, 9, 9, 9, 9, 8, 9, 9, 9],  # longer, another token where the old last one was
])
def test_a_rewritten_sequence_rebuilds(then):
    p = lookup([1, 2, 3, 4, 1, 2, 3])
    assert p.draft(2) == [4, 1]
    p.sync(then)
    fresh = lookup(then)
    assert p.tokens == then
    for limit in (1, 3, 10):
        assert p.draft(limit) == fresh.draft(limit)


# -- DraftLength ---------------------------------------------------------------------------

def test_draft_length_starts_at_the_most_and_counts_checks():
    d = DraftLength(6)
    assert d.allowed() == 6
    d.record(6, 2)
    d.record(3, 3)
    assert (d.verified, d.accepted, d.history) == (2, 5, [2, 3])


def test_grows_by_two_after_a_draft_accepted_whole_up_to_the_most():
    d = DraftLength(8)
    d.record(8, 1)
    assert d.allowed() == 2
    d.record(2, 2)
    assert d.allowed() == 4
    d.record(4, 4)
    assert d.allowed() == 6
    d.record(6, 6)
    d.record(8, 8)
    assert d.allowed() == 8
    d.record(3, 3)  # (a draft cut short, e.g. by max_new_tokens, accepted whole)
    assert d.allowed() == 5


@pytest.mark.parametrize("drafted, accepted, want", [(8, 0, 1), (8, 1, 2), (8, 5, 6), (4, 3, 4)])
def test_shrinks_to_one_more_than_accepted_otherwise(drafted, accepted, want):
    d = DraftLength(8)
    d.record(drafted, accepted)
    assert d.allowed() == want


def test_pauses_after_two_checks_accepted_not_at_all_and_the_pause_doubles():
    d = DraftLength(4)
    d.record(4, 0)
    assert d.allowed() == 1  # one miss: still drafts
    d.record(1, 0)
    assert d.allowed() == 0  # paused one step
    assert d.allowed() == 1
    want = 1
    for _ in range(8):
        want = min(MAX_PAUSE, want * 2)
        d.record(1, 0)
        assert d.allowed() == 1  # a miss alone does not pause
        d.record(1, 0)
        assert [d.allowed() for _ in range(want)] == [0] * want
        assert d.allowed() == 1
    assert want == MAX_PAUSE


def test_a_partly_accepted_draft_breaks_a_run_of_misses_and_a_whole_one_ends_the_pausing():
    d = DraftLength(4)
    d.record(4, 0)
    d.record(4, 2)  # accepted in part: the run of misses is broken
    d.record(3, 0)
    assert d.allowed() == 1  # one miss since
    d.record(1, 0)
    assert d.allowed() == 0 and d.allowed() == 1  # pause 1
    d.record(1, 0)
    d.record(1, 0)
    assert [d.allowed() for _ in range(3)] == [0, 0, 1]  # pause 2
    d.record(1, 1)  # whole: the next pause starts at 1 again
    d.record(3, 0)
    d.record(1, 0)
    assert [d.allowed() for _ in range(2)] == [0, 1]


# -- DraftProposer -------------------------------------------------------------------------

def test_radix_proposer_asks_the_cache_first_and_falls_back_to_the_prompt():
    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    seq = [1, 2, 3, 4, 5, 6, 7, 8]
    slots = alloc.alloc(len(seq))
    assert slots is not None
    cache.insert(seq, slots)
    config = SpeculativeConfig(speculative_algorithm="radix", speculative_num_draft_tokens=5)
    radix = DraftProposer.build(config, cache, context_length=100)
    ngram = DraftProposer.build(SpeculativeConfig(speculative_algorithm="ngram"), cache, context_length=100)
    assert DraftProposer.build(SpeculativeConfig(), cache, context_length=100) is None
    assert radix is not None and ngram is not None and radix.most == 5
    assert radix.propose([1, 2, 3], PromptLookup(), 3) == [4, 5, 6]
    tokens = [9, 1, 2, 3, 9, 1, 2]  # not cached: prompt lookup
    assert radix.propose(tokens, PromptLookup(), 3) == [3, 9, 1]
    assert ngram.propose([1, 2, 3, 0, 1, 2, 3], PromptLookup(), 2) == [0, 1]  # the cache is not asked
    assert ngram.propose([1, 2, 3], PromptLookup(), 3) == []
    assert radix.propose([1, 2, 3], PromptLookup(), 0) == []


# -- config and CLI ------------------------------------------------------------------------

def test_config_defaults_and_bounds():
    assert SpeculativeConfig().speculative_algorithm == "none"
    for algorithm in ("none", "ngram", "radix"):
        for n in (1, MAX_DRAFT_TOKENS):
            SpeculativeConfig(speculative_algorithm=algorithm, speculative_num_draft_tokens=n)


@pytest.mark.parametrize("kwargs, says", [
    ({"speculative_algorithm": "bogus"}, "speculative_algorithm must be one of none, ngram, radix, got 'bogus'"),
    ({"speculative_algorithm": "NGRAM"}, "speculative_algorithm must be one of"),
    ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens must be in [1, 16], got 0"),
    ({"speculative_num_draft_tokens": 17}, "speculative_num_draft_tokens must be in [1, 16], got 17"),
])
def test_bad_config_is_a_value_error_naming_the_field(kwargs, says):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(**kwargs)
    assert says in str(e.value)
    with pytest.raises(ValueError) as e:  # the in-process Engine's options too
        EngineConfig.from_kwargs(**kwargs)
    assert says in str(e.value)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    try:
        code: object = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_cli_rejects_an_unknown_algorithm_in_one_line(command, capsys):
    code, err = _cli([*command, "--speculative-algorithm", "bogus"], capsys)
    assert code == 2, err
    assert "--speculative-algorithm: invalid choice: 'bogus'" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("n", ["0", "17"])
def test_cli_rejects_a_draft_length_out_of_bounds_in_one_line(n, capsys):
    code, err = _cli(["serve", "--speculative-num-draft-tokens", n], capsys)
    assert code == 2, err
    assert f"speculative_num_draft_tokens must be in [1, 16], got {n}" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_metrics_count_each_checked_draft_by_its_accepted_tokens():
    """/metrics' acceptance histogram: one observation per checked draft of a finished request."""
    from radixlm.runtime.server.metrics import Metrics

    m = Metrics()
    m.observe_finished({"prompt_tokens": 4, "completion_tokens": 9, "finish_reason": {"type": "length"},
                        "spec_verify_ct": 3, "spec_accept_lengths": [0, 2, 4]}, 0.5)
    m.observe_finished({"prompt_tokens": 4, "completion_tokens": 3, "finish_reason": {"type": "length"}}, 0.5)
    text = m.render().decode()
    assert "radixlm_spec_accepted_tokens_count 3.0" in text
    assert "radixlm_spec_accepted_tokens_sum 6.0" in text
    assert 'radixlm_spec_accepted_tokens_bucket{le="1.0"} 1.0' in text
    assert 'radixlm_spec_accepted_tokens_bucket{le="2.0"} 2.0' in text
