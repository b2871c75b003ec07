"""Stop regexes (SGLang's ``stop_regex``) in StopMatcher: where they cut, what streams hold back, and
the limits that keep a hostile pattern from hanging the engine."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime import stop
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.stop import StopMatcher, StopRegexTimeout, compile_stop_regex, regex_size


def run(chunks, regexes, stops=(), keep_stop=False):
    """(emitted text, matched label, held text after each feed) over a chunked stream."""
    m = StopMatcher(stops, keep_stop=keep_stop, regexes=regexes)
    out, held = "", []
    for c in chunks:
        safe, matched = m.feed(c)
        out += safe
        held.append(m.held)
        if matched is not None:
            return out, matched, held
    out += m.flush()
    return out, m.matched, held


def test_the_match_is_held_back_exactly_then_trimmed():
    m = StopMatcher([], regexes=[r"Answer: \d+"])
    assert m.feed("So. Ans") == ("So. ", None) and m.held == "Ans"  # may still become a match
    assert m.feed("wer: ") == ("", None) and m.held == "Answer: "
    assert m.feed("4") == ("", r"Answer: \d+")  # complete: it ends here, trimmed
    assert m.matched == r"Answer: \d+"  # reported by its pattern, as SGLang does


def test_text_that_cannot_begin_a_match_streams_at_once():
    m = StopMatcher([], regexes=[r"\n\n"])
    assert m.feed("hello world") == ("hello world", None) and m.held == ""
    assert m.feed("!\n") == ("!", None) and m.held == "\n"
    assert m.feed("x") == ("\nx", None) and m.held == ""


def test_keep_stop_keeps_the_matched_text_and_drops_what_follows():
    assert run(["a", "123b", "c"], [r"\d+"], keep_stop=True)[:2] == ("a123", r"\d+")
    assert run(["a123bc"], [r"\d+"])[:2] == ("a", r"\d+")


def test_a_greedy_match_ends_as_soon_as_it_exists():
    # one character at a time, \d+ is complete after the first digit (as SGLang checks per token)
    assert run(list("ab123c"), [r"\d+"], keep_stop=True)[:2] == ("ab1", r"\d+")


def test_earliest_start_wins_between_strings_and_regexes():
    assert run(["xx END yy 42"], [r"\d+"], stops=["END"])[:2] == ("xx ", "END")
    assert run(["xx 42 END"], [r"\d+"], stops=["END"])[:2] == ("xx ", r"\d+")
    # a longer candidate that starts earlier is waited for, then loses when it fails
    m = StopMatcher(["b"], regexes=[r"ab+c"])
    assert m.feed("xab") == ("x", None) and m.held == "ab"
    assert m.feed("d") == ("a", "b")


def test_lookbehind_sees_text_already_emitted():
    out, matched, _ = run(["foo", " bar", "x"], [r"(?<=foo )bar"])
    assert (out, matched) == ("foo ", r"(?<=foo )bar")


def test_flush_releases_a_partial_match_that_never_completed():
    assert run(["total: 1", "2 items"], [r"total: \d+ dollars"]) == ("total: 12 items", None,
                                                                       ["total: 1", ""])


def test_regex_budget_overrun_raises(monkeypatch):
    monkeypatch.setattr(stop, "REGEX_BUDGET_S", 0.0)
    m = StopMatcher([], regexes=[r"x+y"])
    with pytest.raises(StopRegexTimeout, match="stop_regex took longer"):
        m.feed("xxxx")


@pytest.mark.parametrize(("pattern", "size"), [
    (r"abc", 3), (r"\d{3}-\d{4}", 8), (r"(a{1000}){1000}", 1_000_000), (r"[a-z]{2,5}(x|yy){3}", 14),
    (r"\p{L}{10}", 10), (r"a{,3}", 3), (r"x{y}", 4),
])
def test_regex_size_bounds_counted_repeats(pattern, size):
    assert regex_size(pattern) == size


@pytest.mark.parametrize(("value", "message"), [
    ("(", "not a valid regular expression"),
    ("a" * 300, "at most 256"),
    ("((ab){1000}){1000}", "expand past"),
    (r"\d*", "matches the empty text"),
    ([""], "non-empty"),
    (["x"] * 33, "at most 32"),
    (5, "string or a list"),
])
def test_bad_patterns_are_value_errors_naming_the_field(value, message):
    with pytest.raises(ValueError, match="stop_regex") as e:
        SamplingParams(stop_regex=value)
    assert message in str(e.value)


def test_a_list_names_the_bad_entry():
    with pytest.raises(ValueError, match=r"stop_regex\[1\] is not a valid"):
        SamplingParams(stop_regex=["ok", "(bad"])
    assert compile_stop_regex("a|b").search("xb").group() == "b"


PATTERNS = [r"ab+", r"a.c", r"(ab|b)c", r"\d+", r"x{2}", r"[xy]z", r"b"]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcxyz1 ", max_size=24), st.sampled_from(PATTERNS),
       st.lists(st.integers(0, 24), max_size=6))
def test_any_chunking_emits_the_text_before_the_leftmost_match(text, pattern, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, matched, _ = run(chunks, [pattern])
    m = re.search(pattern, text)
    if m is None:
        assert (out, matched) == (text, None)
    else:
        assert (out, matched) == (text[: m.start()], pattern)
