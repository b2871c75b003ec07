"""StopMatcher: stop strings across chunk boundaries, against a whole-text oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.stop import StopMatcher


def run(stop, chunks, keep_stop=False):
    """Feed chunks until a match; return (emitted text incl. flush, matched, pieces)."""
    m = StopMatcher(stop, keep_stop=keep_stop)
    pieces = []
    matched = None
    for c in chunks:
        out, matched = m.feed(c)
        pieces.append(out)
        if matched is not None:
            break
    else:
        pieces.append(m.flush())
        matched = m.matched
    return "".join(pieces), matched, pieces


def oracle(stop, text, keep_stop=False):
    """First occurrence in the whole text: leftmost start, then the shortest stop string."""
    hits = [(text.find(s), len(s), s) for s in stop if s and text.find(s) != -1]
    if not hits:
        return text, None
    at, _, s = min(hits)
    return text[:at] + (s if keep_stop else ""), s


def splits(text):
    """Every way to cut text into two chunks, and into three."""
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i in range(n + 1):
        for j in range(i, n + 1):
            yield [text[:i], text[i:j], text[j:]]


def test_no_stop_is_pass_through_with_no_holdback():
    m = StopMatcher([])
    for delta in ["Hel", "lo", " wor", "ld", ""]:
        assert m.feed(delta) == (delta, None)
        assert m.held == ""
    assert m.flush() == ""


def test_text_that_cannot_start_a_stop_is_not_held():
    m = StopMatcher(["</answer>"])
    assert m.feed("hello world") == ("hello world", None)
    assert m.held == ""
    assert m.feed("x <") == ("x ", None)
    assert m.held == "<"
    assert m.feed("b>") == ("<b>", None)
    assert m.held == ""


@pytest.mark.parametrize("keep_stop", [False, True])
def test_stop_split_at_every_point(keep_stop):
    text = "The answer is 42.\n\nQuestion: next"
    stop = ["\n\nQuestion:"]
    want = "The answer is 42." + ("\n\nQuestion:" if keep_stop else "")
    for chunks in splits(text):
        got, matched, pieces = run(stop, chunks, keep_stop)
        assert (got, matched) == (want, "\n\nQuestion:"), chunks
        # Nothing past the stop string is ever emitted, even transiently.
        assert all("next" not in p for p in pieces)


def test_stop_split_one_char_per_feed_holds_exactly_the_prefix():
    m = StopMatcher(["abc"])
    assert m.feed("x") == ("x", None)
    assert m.feed("a") == ("", None) and m.held == "a"
    assert m.feed("b") == ("", None) and m.held == "ab"
    assert m.feed("x") == ("abx", None) and m.held == ""
    assert m.feed("ab") == ("", None)
    assert m.feed("cdef") == ("", "abc")
    with pytest.raises(AssertionError):
        m.feed("more")
    assert m.flush() == ""


def test_holdback_restarts_inside_a_failed_candidate():
    # After "aaaa" only the last "aaa" can still start "aaab"; the first "a" is released.
    m = StopMatcher(["aaab"])
    assert m.feed("aa") == ("", None)
    assert m.feed("a") == ("", None) and m.held == "aaa"
    assert m.feed("a") == ("a", None) and m.held == "aaa"
    assert m.feed("b!") == ("", "aaab")


def test_earliest_start_wins_over_earlier_end():
    # "b" ends first, but "abc" starts first: the first occurrence in the text is "abc".
    assert run(["b", "abc"], ["xabcx"]) == ("x", "abc", ["x"])
    for chunks in splits("xabcx"):
        got, matched, _ = run(["b", "abc"], chunks)
        assert (got, matched) == ("x", "abc"), chunks


def test_shorter_match_waits_for_longer_candidate_then_wins_when_it_fails():
    m = StopMatcher(["b", "abc"])
    assert m.feed("xab") == ("x", None)  # "b" matched, but "abc" starting earlier may complete
    assert m.held == "ab"
    assert m.feed("d") == ("a", "b")  # "abd": "abc" failed, so "b" is the first occurrence
    # And when the stream ends while waiting, flush reports the shorter one.
    m = StopMatcher(["b", "abc"], keep_stop=True)
    assert m.feed("xab") == ("x", None)
    assert m.flush() == "ab"
    assert m.matched == "b"


def test_same_start_shortest_wins():
    assert run(["abcd", "ab"], ["zabcd"]) == ("z", "ab", ["z"])
    assert run(["abcd", "ab"], ["zabcd"], keep_stop=True)[:2] == ("zab", "ab")
    # Split: the shorter one is complete as soon as "ab" arrives.
    m = StopMatcher(["abcd", "ab"])
    assert m.feed("za") == ("z", None)
    assert m.feed("b") == ("", "ab")


def test_earliest_among_several_stops_regardless_of_list_order():
    text = "one END two STOP three"
    for stop in (["STOP", "END"], ["END", "STOP"]):
        for chunks in splits(text):
            assert run(stop, chunks)[:2] == ("one ", "END")


def test_stop_at_the_very_start():
    assert run(["<|end|>"], ["<|end|>tail"]) == ("", "<|end|>", [""])
    assert run(["<|end|>"], ["<|e", "nd|>tail"])[:2] == ("", "<|end|>")
    assert run(["<|end|>"], ["<|end|>"], keep_stop=True)[:2] == ("<|end|>", "<|end|>")


def test_keep_stop():
    assert run(["\n"], ["a\nb"], keep_stop=True)[:2] == ("a\n", "\n")
    assert run(["\n"], ["a\nb"], keep_stop=False)[:2] == ("a", "\n")


def test_flush_releases_held_text_without_match():
    m = StopMatcher(["</s>"])
    assert m.feed("end </") == ("end ", None)
    assert m.flush() == "</"
    assert m.matched is None
    assert m.flush() == ""


def test_unicode_stops():
    text = "说完了。🇫🇷 就这样👩‍👩‍👧结束"
    for stop in (["👩‍👩‍👧"], ["。🇫🇷"], ["结束", "👩"]):
        for chunks in splits(text):
            assert run(stop, chunks)[:2] == oracle(stop, text), (stop, chunks)


def test_duplicate_stops_and_validation():
    assert StopMatcher(["x", "x"]).stop == ("x",)
    assert StopMatcher("x").stop == ("x",)
    with pytest.raises(ValueError):
        StopMatcher([""])


def test_long_delta_is_linear():
    # A long delta (e.g. jump-forward text) with a stop near the end.
    text = "ab" * 50_000 + "STOP" + "tail"
    assert run(["STOP", "abababx"], [text]) == ("ab" * 50_000, "STOP", ["ab" * 50_000])


_alphabet = st.sampled_from(list("ab \nxé你😀\u200d"))
_stop_strategy = st.lists(st.text(_alphabet, min_size=1, max_size=4), min_size=0, max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(_alphabet, max_size=30),
    stop=_stop_strategy,
    cuts=st.lists(st.integers(0, 30), max_size=6),
    keep_stop=st.booleans(),
)
def test_matches_oracle_for_any_chunking(text, stop, cuts, keep_stop):
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[i:j] for i, j in zip([0] + bounds, bounds + [len(text)])]
    got, matched, pieces = run(stop, chunks, keep_stop)
    want, want_matched = oracle(stop, text, keep_stop)
    assert (got, matched) == (want, want_matched)
    if want_matched is None:
        assert got == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(_alphabet, max_size=30), stop=_stop_strategy)
def test_holdback_is_the_longest_stop_prefix_tail(text, stop):
    m = StopMatcher(stop)
    emitted = ""
    for ch in text:
        out, matched = m.feed(ch)
        emitted += out
        if matched is not None:
            return
        seen = emitted + m.held
        assert seen == text[: len(seen)]
        # The held text is the longest tail that is a proper prefix of some stop string.
        def starts_stop(tail: str) -> bool:
            return any(s.startswith(tail) and s != tail for s in stop)

        if m.held:
            assert starts_stop(m.held)
        k = len(seen) - len(m.held)
        assert not any(starts_stop(seen[i:]) for i in range(k))


# Any unicode (lone surrogates, combining marks, astral planes) for texts and stops; stops are
# often slices of the text, so matches, overlaps and shared prefixes are common.
_any_char = st.characters(codec=None, categories=None)


@st.composite
def _text_and_stops(draw):
    text = draw(st.text(_any_char, max_size=40))
    slices = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(lambda t: text[t[0]:t[0] + t[1]])
    stops = draw(st.lists(slices.filter(bool) | st.text(_any_char, min_size=1, max_size=5), max_size=4))
    return text, stops


@settings(max_examples=400, deadline=None)
@given(text_stops=_text_and_stops(), cuts=st.lists(st.integers(0, 40), max_size=8), keep_stop=st.booleans())
def test_arbitrary_unicode_matches_the_naive_reference(text_stops, cuts, keep_stop):
    text, stop = text_stops
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[i:j] for i, j in zip([0] + bounds, bounds + [len(text)])]
    got, matched, pieces = run(stop, chunks, keep_stop)
    assert (got, matched) == oracle(stop, text, keep_stop)
    # nothing after the first stop string is ever emitted
    assert text.startswith("".join(pieces))
