"""The router's pure logic: the character tree against a naive twin, the policies as tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.router.config import RouterConfig
from radixlm.router.keys import SessionTable, ids_key, json_object, routing_key, session_of
from radixlm.router.policies import POLICIES, CacheAware, make_policy
from radixlm.router.tree import CharTree
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.payload import parse_body

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")
texts = st.lists(st.text(alphabet="abc", max_size=12), max_size=30)


def naive_match(stored: list[str], text: str) -> int:
    best = 0
    for s in stored:
        n = 0
        while n < min(len(s), len(text)) and s[n] == text[n]:
            n += 1
        best = max(best, n)
    return best


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.text(alphabet="abc", max_size=12), max_size=10))
def test_tree_matches_naive_twin(inserted: list[str], queries: list[str]) -> None:
    tree = CharTree(max_chars=10**6)
    for t in inserted:
        tree.insert(t)
    for q in queries + inserted:
        assert tree.match(q) == naive_match(inserted, q)
    # the size is the number of distinct non-empty prefixes' last characters: one per trie edge character
    assert tree.size == len({t[:k] for t in inserted for k in range(1, len(t) + 1)})


@settings(max_examples=300, deadline=None)
@given(texts, st.integers(1, 20))
def test_tree_eviction_bounds_size_and_keeps_recent(inserted: list[str], limit: int) -> None:
    tree = CharTree(max_chars=limit)
    for t in inserted:
        tree.insert(t)
        assert tree.size <= limit
        assert tree.match(t) <= len(t)
        if len(t) <= tree.low_water:
            assert tree.match(t) == len(t)  # the newest insert is the most recently used: never evicted
    for q in inserted:
        assert tree.match(q) <= naive_match(inserted, q)


def test_tree_evicts_least_recently_used_first() -> None:
    tree = CharTree(max_chars=12)
    tree.insert("aaaa")
    tree.insert("bbbb")
    tree.insert("aaaa")  # a used again: b is now the oldest
    tree.insert("cccc")
    tree.insert("dddd")  # past 12 characters: b goes
    assert (tree.match("aaaa"), tree.match("bbbb"), tree.match("cccc"), tree.match("dddd")) == (4, 0, 4, 4)
    tree.clear()
    assert tree.size == 0 and tree.match("aaaa") == 0


def config(**kw: object) -> RouterConfig:
    return RouterConfig(worker_urls=URLS, **kw)  # type: ignore[arg-type]


SYS_A = "You are a pirate. " * 10
SYS_B = "You are a lawyer. " * 10


def test_cache_aware_spreads_new_prefixes_then_sticks() -> None:
    p = CacheAware(3, config())
    loads = [0, 0, 0]
    first = p.choose(SYS_A + "q1", loads, [0, 1, 2])
    assert first.reason == "least_loaded"
    second = p.choose(SYS_B + "q1", loads, [0, 1, 2])
    assert second.reason == "least_loaded" and second.worker != first.worker  # the emptier tree
    for q in ("q2", "q3", "another question"):
        assert p.choose(SYS_A + q, loads, [0, 1, 2]) == type(first)(first.worker, "affinity")
        assert p.choose(SYS_B + q, loads, [0, 1, 2]).worker == second.worker


@pytest.mark.parametrize(("loads", "threshold", "abs_t", "rel_t", "want"), [
    # affinity holds while the load difference stays within the thresholds
    ([5, 0, 0], 0.5, 32, 1.5, (0, "affinity")),
    ([40, 0, 0], 0.5, 32, 1.5, (1, "balance")),      # 40 - 0 > 32 and 40 > 1.5 * 0
    ([40, 20, 30], 0.5, 10, 1.5, (1, "balance")),    # 40 - 20 > 10 and 40 > 30
    ([40, 30, 35], 0.5, 5, 1.5, (0, "affinity")),    # 40 - 30 > 5 but 40 < 1.5 * 30
    # the match is below the threshold: least loaded
    ([0, 3, 2], 0.99, 32, 1.5, (0, "least_loaded")),
    ([4, 3, 2], 0.99, 32, 1.5, (2, "least_loaded")),
])
def test_cache_aware_table(loads: list[int], threshold: float, abs_t: int, rel_t: float,
                           want: tuple[int, str]) -> None:
    p = CacheAware(3, config(cache_threshold=threshold, balance_abs_threshold=abs_t, balance_rel_threshold=rel_t))
    p.trees[0].insert(SYS_A + "old question")
    got = p.choose(SYS_A + "new question", loads, [0, 1, 2])
    assert (got.worker, got.reason) == want
    assert p.trees[got.worker].match(SYS_A + "new question") == len(SYS_A + "new question")  # remembered


def test_cache_aware_only_picks_candidates_and_forgets() -> None:
    p = CacheAware(3, config())
    p.trees[0].insert(SYS_A)
    assert p.choose(SYS_A + "x", [0, 0, 0], [1, 2]).worker in (1, 2)  # worker 0 is out
    p.forget(1)
    p.forget(2)
    assert p.choose(SYS_A + "y", [0, 0, 0], [0, 1, 2]) .worker == 0
    with pytest.raises(ValueError, match="no candidate"):
        p.choose("z", [0, 0, 0], [])


def test_round_robin_and_shortest_queue() -> None:
    rr = make_policy("round_robin", 3, config())
    assert [rr.choose("", [0, 0, 0], [0, 1, 2]).worker for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.choose("", [0, 0, 0], [0, 2]).worker for _ in range(3)] == [2, 0, 2]
    sq = make_policy("shortest_queue", 3, config())
    assert sq.choose("", [3, 1, 2], [0, 1, 2]).worker == 1
    assert sq.choose("", [3, 1, 2], [0, 2]).worker == 2
    assert {sq.choose("", [1, 1, 1], [0, 1, 2]).worker for _ in range(3)} == {0, 1, 2}  # ties in turn
    assert set(POLICIES) == {"cache_aware", "round_robin", "shortest_queue"}
    with pytest.raises(ValueError, match="unknown --policy 'nope'"):
        make_policy("nope", 3, config())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.lists(st.tuples(st.text(max_size=20), st.lists(
    st.integers(0, 100), min_size=3, max_size=3), st.sets(st.integers(0, 2), min_size=1)), max_size=40))
def test_every_policy_picks_a_candidate(name: str, steps: list[tuple[str, list[int], set[int]]]) -> None:
    p = make_policy(name, 3, config())
    for key, loads, candidates in steps:
        assert p.choose(key, loads, candidates).worker in candidates


def test_routing_keys_and_sessions() -> None:
    assert routing_key("/generate", {"text": "hello"}) == "hello"
    assert routing_key("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_key("/generate", {"input_ids": [1, 2, 0xD800]}) == ids_key([1, 2, 0xD800])
    assert ids_key([1, 2]) + ids_key([3]) == ids_key([1, 2, 3]) and len(ids_key([0xD800])) == 1
    assert routing_key("/v1/completions", {"prompt": ["p", "q"]}) == "p"
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "S"},
                                                              {"role": "user", "content": [{"type": "text",
                                                                                            "text": "U"}]}]})
    assert chat.startswith("<|system|>S") and chat.endswith("U")
    assert routing_key("/generate", None) == "" and routing_key("/tokenize", {"prompt": "x"}) == ""
    assert session_of("/generate", {"session_params": {"id": "s1"}}) == "s1"
    assert session_of("/v1/chat/completions", {"session_id": "s2"}) == "s2"
    assert session_of("/generate", {"text": "x"}) is None and session_of("/generate", [1]) is None
    table = SessionTable(2)
    table.bind("a", 0)
    table.bind("b", 1)
    assert table.get("a") == 0  # a used: b is the oldest
    table.bind("c", 2)
    assert (table.get("a"), table.get("b"), table.get("c"), len(table)) == (0, None, 2, 2)
    table.drop("a")
    assert table.get("a") is None


@pytest.mark.parametrize(("kw", "msg"), [
    ({"worker_urls": ()}, "at least one worker"),
    ({"worker_urls": ("localhost:1",)}, "not http"),
    ({"worker_urls": ("http://a:1", "http://a:1")}, "twice"),
    ({"cache_threshold": 1.5}, "--cache-threshold"),
    ({"balance_rel_threshold": 0.5}, "--balance-rel-threshold"),
    ({"health_interval": 0}, "--health-interval"),
    ({"max_tree_chars": 0}, "--max-tree-chars"),
    ({"api_key": ""}, "--api-key must be non-empty"),
    ({"api_key": "k "}, "no leading or trailing whitespace"),
    ({"api_key": "clé"}, "printable ASCII"),
])
def test_config_errors_name_the_flag(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        RouterConfig(**{"worker_urls": URLS, **kw})  # type: ignore[arg-type]


def test_the_api_key_stays_out_of_the_config_repr() -> None:
    assert "s3cret" not in repr(RouterConfig(worker_urls=URLS, api_key="s3cret"))


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("raw", "msg"), [
    (b"", "the request body is empty; send a JSON object"),
    (b" \n", "the request body is empty; send a JSON object"),
    (b'{"text": "\xff"}', "the request body is not valid UTF-8 (byte 10 is not); send JSON in UTF-8"),
    (b"{'text': 1}", "the request body is not valid JSON: Expecting property name enclosed in double quotes at line 1 "
                     "column 2"),
    (b"[" * 5000 + b"]" * 5000, "the request body is nested too deeply; send fewer levels of nested arrays and "
                                "objects"),
    (b'{"n": -' + b"1" * 4301 + b"}", "the request body holds an integer of more than 4300 digits; integers must "
                                     "fit in 64 bits"),
    (b"null", "the request body must be a JSON object, got null"),
    (b'"text"', "the request body must be a JSON object, got a string"),
])
def test_json_object_refuses_what_the_server_refuses(raw: bytes, msg: str) -> None:
    """With the server's own 400 message, word for word (the router cannot import the server's parser)."""
    with pytest.raises(ValueError) as e:
        json_object(raw)
    assert str(e.value) == msg
    with pytest.raises(ApiError) as server:
        parse_body(raw)
    assert (server.value.status, server.value.message) == (400, msg)


def test_json_object_reads_what_the_server_reads() -> None:
    assert json_object(b'\xef\xbb\xbf{"text": "caf\xc3\xa9", "n": ' + b"9" * 4300 + b"}")["text"] == "café"
    assert routing_key("/run_program", {"graph": _nested(5000)}) == ""  # read, too deep to key: by load
