"""DSL sessions: program runs that continue one conversation (``func.run(..., session=sess)``),
on the in-process Engine and on a real server: greedy results equal one run with the whole
history, later runs read the history from the pinned KV, errors are clear."""

from __future__ import annotations

import asyncio

import pytest

import radixlm.lang as sgl
from radixlm.lang.backends.openai import OpenAI
from radixlm.lang.backends.runtime_endpoint import BackendError
from radixlm.runtime.sessions import SessionNotFoundError

GREEDY = {"temperature": 0}
MESSAGES = ["My name is Ada.", "What is my name?", "Name a colour."]


@sgl.function
def chat_turn(s, message):
    s += sgl.user(message)
    s += sgl.assistant(sgl.gen("reply", max_tokens=8))


@sgl.function
def whole_chat(s, messages):
    for i, m in enumerate(messages):
        s += sgl.user(m)
        s += sgl.assistant(sgl.gen(f"reply{i}", max_tokens=8))


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["engine_backend", "endpoint"])
def test_session_runs_equal_one_run_with_the_whole_history(backend_name, request, smol_tokenizer):
    be = request.getfixturevalue(backend_name)
    ref = whole_chat.run(MESSAGES, backend=be, **GREEDY)
    with sgl.session(be, capacity=1000) as sess:
        for i, message in enumerate(MESSAGES):
            history = len(smol_tokenizer.encode(sess.text, add_special_tokens=False)) if sess.text else 0
            st = chat_turn.run(message, session=sess, **GREEDY)
            assert st["reply"] == ref[f"reply{i}"]
            meta = st.get_meta_info("reply")
            assert meta["session_id"] == sess.id and meta["session_history_tokens"] == history
            if i:  # the earlier runs' KV stayed pinned: the history is read from the cache
                assert history > 0 and meta["cached_tokens"] >= history - 1
            assert sess.text == st.text() and sess.messages == st.messages()
            if backend_name == "engine_backend":  # the pin covers the whole conversation so far
                pinned = be.engine.core.sessions.describe(sess.id)["pinned_tokens"]
                assert pinned == len(smol_tokenizer.encode(sess.text, add_special_tokens=False))
        assert st.text() == ref.text() and st.messages() == ref.messages()
    assert sess.closed
    with pytest.raises(ValueError, match="is closed"):
        chat_turn.run("Hello?", session=sess, **GREEDY)
    if backend_name == "engine_backend":
        be.engine.core.check_idle_integrity()
        assert be.engine.core.cache.protected_size() == 0  # closing unpinned it


@pytest.mark.slow
def test_streamed_and_forked_runs_continue_a_session(engine_backend):
    @sgl.function
    def two_ideas(s):
        s += sgl.user("Give me an idea.")
        forks = s.fork(2)  # the branches are plain requests; the session's turns are the root's gens
        for f in forks:
            f += sgl.assistant(sgl.gen("idea", max_tokens=4))
        forks.join()
        s += sgl.assistant(sgl.gen("reply", max_tokens=4))

    with sgl.session(engine_backend) as sess:
        first = two_ideas.run(session=sess, **GREEDY)
        assert len(first["idea"]) == 2
        st = chat_turn.run("Thanks!", session=sess, stream=True, **GREEDY)
        streamed = "".join(st.text_iter())
        assert streamed == st.text()[len(first.text()):] and st["reply"] in streamed
        assert st.get_meta_info("reply")["cached_tokens"] >= len(engine_backend.engine.encode(first.text())) - 1
        assert sess.text == st.text()


@pytest.mark.slow
def test_a_session_closed_on_the_server_is_a_clear_error(endpoint, server):
    sess = sgl.session(endpoint)
    chat_turn.run("Hi.", session=sess, max_new_tokens=2)
    assert server.post("/close_session", {"session_id": sess.id})[0] == 200  # e.g. expired
    with pytest.raises(BackendError, match="not open") as err:
        chat_turn.run("Again.", session=sess, max_new_tokens=2)
    assert err.value.status == 404 and any("chat_turn" in note for note in err.value.__notes__)
    sess.close()  # already gone on the server: closing the handle is still fine
    with pytest.raises(ValueError, match="is closed"):
        chat_turn.run("Again.", session=sess)


@pytest.mark.slow
def test_session_backend_and_handle_checks(engine_backend, endpoint, engine):
    sess = sgl.session(engine)  # an Engine is wrapped like any backend
    try:
        with pytest.raises(ValueError, match="lives on the backend that opened it"):
            chat_turn.run("Hi.", session=sess, backend=endpoint)
        chat_turn.run("Hi.", session=sess, backend=engine, max_new_tokens=2)  # naming its own is fine
        with pytest.raises(TypeError, match="radixlm.session"):
            chat_turn.run("Hi.", session=sess.id)

        async def overlapping() -> None:
            first = await chat_turn.arun("Hi.", session=sess, stream=True, max_new_tokens=2)
            with pytest.raises(RuntimeError, match="in use by another run"):
                await chat_turn.arun("Again.", session=sess)
            await first.wait()

        asyncio.run(overlapping())
        assert chat_turn.run("Again.", session=sess, max_new_tokens=2).messages()[-1]["role"] == "assistant"
    finally:
        sess.close()
    with pytest.raises(SessionNotFoundError):
        engine.close_session(sess.id)


def test_openai_backend_has_no_sessions():
    with pytest.raises(NotImplementedError, match="OpenAI backend has no sessions.*Engine or a RuntimeEndpoint"):
        sgl.session(OpenAI("any-model", base_url="http://127.0.0.1:9/v1"))
