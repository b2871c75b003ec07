"""How programs run on the Engine: errors and tracebacks, run_batch isolation, cache hints,
sampling defaults, async entry points."""

from __future__ import annotations

import asyncio
import traceback

import pytest

import radixlm.lang as sgl
from radixlm.lang.context import DslContext

pytestmark = pytest.mark.slow

SHARED = ("You are a careful assistant. Read the question and answer it with a single word, "
          "without any explanation.\n")


@sgl.function
def ask(s, question):
    s += SHARED + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=3, stop="\n")


@sgl.function
def fails_in_program(s, when):
    s += "Say something:" + sgl.gen("x", max_tokens=2)
    if when == "after_read" and s["x"] is not None:
        raise ZeroDivisionError("failed after reading x")
    if when == "before_read":
        raise ZeroDivisionError("failed while building")


@sgl.function
def bad_regex(s):
    s += "Number:"
    s += sgl.gen("n", regex="[0-9", max_tokens=3)


@sgl.function
def forked(s):
    s += SHARED + "Give two different answers to: what is blue?\n"
    branches = s.fork(2)
    for i, b in enumerate(branches):
        b += f"Answer {i + 1}:" + sgl.gen("a", max_tokens=3, stop="\n")
    branches.join()


def _frames(exc: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


@pytest.mark.parametrize("when", ["before_read", "after_read"])
def test_program_exception_surfaces_with_its_traceback(engine_backend, when):
    with pytest.raises(ZeroDivisionError) as err:
        fails_in_program.run(when, backend=engine_backend, temperature=0)
    assert "fails_in_program" in _frames(err.value)


def test_runtime_error_names_the_program_line(engine_backend):
    with pytest.raises(ValueError) as err:
        bad_regex.run(backend=engine_backend)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "program 'bad_regex'" in notes and "gen('n')" in notes and "test_execution.py:" in notes


def test_one_failing_program_does_not_sink_the_batch(engine_backend):
    states = fails_in_program.run_batch([("fine",), ("after_read",), ("fine",), ("before_read",)],
                                        backend=engine_backend, temperature=0)
    assert [type(s.error()).__name__ if s.error() else None for s in states] == \
        [None, "ZeroDivisionError", None, "ZeroDivisionError"]
    assert states[0]["x"] == states[2]["x"]
    with pytest.raises(ZeroDivisionError):
        states[1].text()


def test_run_batch_prefills_the_shared_prefix_once_before_the_batch(engine, engine_backend):
    engine.flush_cache()
    shared_tokens = len(engine.encode(SHARED.rstrip()))
    states = ask.run_batch([{"question": q} for q in ["Sky color?", "Grass color?", "Snow color?"]],
                           backend=engine_backend, temperature=0)
    cached = [s.get_meta_info("answer")["cached_tokens"] for s in states]
    # every program, the first one included, found the shared prefix already in the cache
    assert min(cached) >= shared_tokens - 1, cached


def test_fork_prefills_the_parent_once_before_its_branches(engine, engine_backend):
    engine.flush_cache()
    st = forked.run(backend=engine_backend, temperature=0)
    parent_tokens = len(engine.encode(SHARED + "Give two different answers to: what is blue?\n"))
    metas = st.get_meta_info("a")
    assert len(st["a"]) == 2 and len(metas) == 2
    assert all(m["cached_tokens"] >= parent_tokens - 1 for m in metas), [m["cached_tokens"] for m in metas]


@sgl.function
def live_fork(s, join: bool, read_back: bool):
    s += "Name a color:" + sgl.gen("color", max_tokens=2, ignore_eos=True)
    if s["color"] is None:  # a read of a generated value: the program runs step by step
        return
    f = s.fork(2)
    f += " and a fruit:" + sgl.gen("fruit", max_tokens=2, ignore_eos=True)
    if join:
        f.join()
    if read_back:  # SGLang's way to use branches without joining them
        s += " Fruits:" + f[0]["fruit"] + f[1]["fruit"]


def test_a_live_fork_never_joined_nor_read_is_a_value_error(engine_backend):
    with pytest.raises(ValueError, match=r"fork 0 \(forked at .*test_execution.py:\d+\) is never joined, so the "
                                         r"variables its branches set \(fruit\) would be dropped"):
        live_fork.run(False, False, backend=engine_backend, temperature=0)
    joined = live_fork.run(True, False, backend=engine_backend, temperature=0)
    read = live_fork.run(False, True, backend=engine_backend, temperature=0)
    assert len(joined["fruit"]) == 2 and read.text().endswith(" Fruits:" + "".join(joined["fruit"]))


def test_gen_arguments_override_run_defaults(engine_backend):
    @sgl.function
    def two(s):
        s += "Count: 1, 2, 3," + sgl.gen("a", max_tokens=2, ignore_eos=True)
        s += sgl.gen("b", ignore_eos=True)

    st = two.run(backend=engine_backend, temperature=0, max_new_tokens=5)
    assert st.get_meta_info("a")["completion_tokens"] == 2
    assert st.get_meta_info("b")["completion_tokens"] == 5


def test_n_samples_give_a_list(engine_backend):
    @sgl.function
    def many(s):
        s += "A random animal:" + sgl.gen("animal", max_tokens=3, n=3, temperature=1.0, seed=7)

    st = many.run(backend=engine_backend)
    assert isinstance(st["animal"], list) and len(st["animal"]) == 3
    assert st.text() == "A random animal:" + st["animal"][0]


def test_async_run_and_run_batch(engine_backend):
    async def main():
        one = await ask.arun("Sky color?", backend=engine_backend, temperature=0)
        batch = await ask.arun_batch([("Sky color?",), ("Fire color?",)], backend=engine_backend, temperature=0)
        return one["answer"], [b["answer"] for b in batch]

    one, batch = asyncio.run(main())
    assert batch[0] == one


def test_sync_run_inside_an_event_loop_is_refused(engine_backend):
    async def main():
        ask.run("x", backend=engine_backend)

    with pytest.raises(RuntimeError, match="arun"):
        asyncio.run(main())


def test_default_backend_lives_in_a_context_object(engine):
    ctx = DslContext()
    with pytest.raises(RuntimeError, match="set_default_backend"):
        ctx.backend()
    ctx.set_backend(engine)
    assert ctx.backend().engine is engine
    with pytest.raises(TypeError, match="backend must be"):
        ctx.set_backend("http://localhost")
