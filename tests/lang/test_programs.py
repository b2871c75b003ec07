"""The suite of DSL programs, run on the in-process Engine and on a real server through
RuntimeEndpoint: greedy results must be identical on both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

import radixlm.lang as sgl

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
FEW_SHOT = (
    "Answer each question with one word.\n"
    "Q: What color is the sky?\nA: blue\n"
    "Q: What do cows drink?\nA: water\n"
    "Q: What is frozen water?\nA: ice\n"
)


class City(BaseModel):
    name: str
    country: str


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=6, stop="\n")


@sgl.function
def multi_turn(s, first, second):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("reply1", max_tokens=6))
    with s.user():
        s += second
    with s.assistant():
        s += sgl.gen("reply2", max_tokens=6)


@sgl.function
def select_and_regex(s):
    s += "The capital of France is"
    s += sgl.select("city", [" Paris", " London", " Madrid"])
    s += ". Its phone prefix is +" + sgl.gen("prefix", regex="[0-9]{2}", max_tokens=4)
    s += ". Year founded: " + sgl.gen_int("year", max_tokens=5)
    s += ". Population in millions: " + sgl.gen("pop", dtype=float, max_tokens=6)


@sgl.function
def extract(s, text):
    s += sgl.user("Extract the city and country as JSON: " + text)
    s += sgl.assistant(sgl.gen("city", json_schema=City, max_tokens=40))


@sgl.function
def fork_join(s):
    s += "Three short tips for better sleep:\n"
    tips = s.fork(3)
    for i, tip in enumerate(tips):
        tip += f"{i + 1}." + sgl.gen("tip", max_tokens=8, stop="\n")
    tips.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=8, stop="\n")


@sgl.function
def nested_forks(s):
    s += "Plan a trip."
    days = s.fork(2)
    for d, day in enumerate(days):
        day += f"\nDay {d + 1}:" + sgl.gen("plan", max_tokens=3, stop="\n")
        meals = day.fork(2)
        for m, meal in enumerate(meals):
            meal += f" Meal {m + 1}:" + sgl.gen("meal", max_tokens=3, stop="\n")
        meals.join()
    days.join()


@sgl.function
def reads_values(s):
    s += "Is water wet? Answer yes or no:"
    s += sgl.select("yn", [" yes", " no"])
    if s["yn"] == " yes":  # control flow on a generated value: runs step by step
        s += " Why?" + sgl.gen("why", max_tokens=6, stop="\n")
    else:
        s += " Why not?" + sgl.gen("why", max_tokens=6, stop="\n")
    branches = s.fork(2)
    for b in branches:
        b += " Also:" + sgl.gen("also", max_tokens=4)
    s += " [" + "|".join(b["also"] for b in branches) + "]"


@sgl.function
def with_logprobs(s):
    s += "The days of the week are Monday, Tuesday,"
    s += sgl.gen("days", max_tokens=4, ignore_eos=True, return_logprob=True, top_logprobs_num=2)


def on_both(engine_backend, endpoint, run: Callable[[Any], Any]) -> Any:
    """run(backend) on the Engine and on the server; the results must be identical."""
    local = run(engine_backend)
    remote = run(endpoint)
    assert local == remote
    return local


def test_few_shot_qa(engine_backend, endpoint):
    def run(be):
        st = few_shot_qa.run(question="What is the opposite of hot?", backend=be, **GREEDY)
        return st.text(), st["answer"]

    text, answer = on_both(engine_backend, endpoint, run)
    assert text == FEW_SHOT + "Q: What is the opposite of hot?\nA:" + answer
    assert answer.strip() and "\n" not in answer


def test_multi_turn_roles_value_and_block_forms(engine_backend, endpoint, smol_tokenizer):
    def run(be):
        st = multi_turn.run("What is 2+2?", "And 3+3?", backend=be, **GREEDY)
        return st.text(), st.messages(), st["reply1"], st["reply2"]

    text, messages, r1, r2 = on_both(engine_backend, endpoint, run)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == r1 and messages[4]["content"] == r2
    # the state's text is exactly the model's own chat template applied to the messages
    assert text == smol_tokenizer.apply_chat_template(messages, tokenize=False)


def test_select_regex_and_dtypes(engine_backend, endpoint):
    states = {}

    def run(be):
        states[be] = st = select_and_regex.run(backend=be, **GREEDY)
        return st.variables()

    values = on_both(engine_backend, endpoint, run)
    # choice scores are fp32 sums of bf16 logits, which differ in the last bits with the step's
    # batch shape (what the server batched them with, what its cache held): equal to ~1e-4
    scores, remote_scores = (states[be].get_meta_info("city")["scores"] for be in (engine_backend, endpoint))
    assert remote_scores == pytest.approx(scores, rel=1e-3, abs=1e-3)
    assert values["city"] == " Paris" and scores.index(max(scores)) == 0
    assert len(values["prefix"]) == 2 and values["prefix"].isdigit()
    assert isinstance(values["year"], int) and isinstance(values["pop"], float)


def test_json_schema_with_pydantic(engine_backend, endpoint):
    def run(be):
        return extract.run("I flew into Lyon, which is in France, last May.", backend=be, **GREEDY)["city"]

    raw = on_both(engine_backend, endpoint, run)
    City.model_validate_json(raw)  # always valid under the constraint
    assert set(json.loads(raw)) == {"name", "country"}


def test_fork_and_join_gather_lists(engine_backend, endpoint):
    def run(be):
        st = fork_join.run(backend=be, **GREEDY)
        return st["tip"], st["summary"], st.text()

    tips, summary, text = on_both(engine_backend, endpoint, run)
    assert isinstance(tips, list) and len(tips) == 3
    assert text.endswith("Summary:" + summary)
    assert "1." not in text  # branch text stays in the branches (gather_variable)


def test_nested_forks(engine_backend, endpoint):
    def run(be):
        st = nested_forks.run(backend=be, **GREEDY)
        return st["plan"], st["meal"]

    plans, meals = on_both(engine_backend, endpoint, run)
    assert len(plans) == 2 and len(meals) == 2 and all(len(m) == 2 for m in meals)


def test_value_dependent_program_runs_step_by_step(engine_backend, endpoint):
    def run(be):
        st = reads_values.run(backend=be, **GREEDY)
        return st.text(), st["yn"], st["why"]

    text, yn, why = on_both(engine_backend, endpoint, run)
    assert yn in (" yes", " no") and why in text
    assert text.endswith("]") and text.count("|") >= 1


def test_streaming_sync_and_async(engine_backend, endpoint):
    def run(be):
        st = multi_turn.run("Name a color.", "Another one?", backend=be, stream=True, **GREEDY)
        chunks = list(st.text_iter())
        reply_chunks = [c for c in st.text_iter("reply1")]
        return "".join(chunks), "".join(reply_chunks), len(reply_chunks), st.text(), st["reply1"]

    joined, reply, n_chunks, text, reply1 = on_both(engine_backend, endpoint, run)
    assert joined == text and reply == reply1 and n_chunks > 1

    async def arun(be):
        st = await multi_turn.arun("Name a color.", "Another one?", backend=be, stream=True, **GREEDY)
        chunks = [c async for c in st]
        await st.wait()
        return "".join(chunks), st.text()

    joined_async, text_async = on_both(engine_backend, endpoint, lambda be: asyncio.run(arun(be)))
    assert joined_async == text_async == text


def test_run_batch_with_progress_bar(engine_backend, endpoint, capsys):
    questions = ["What is the opposite of up?", "What do bees make?", "What color is grass?", "What is 1+1?"]

    def run(be):
        states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=be, progress_bar=True,
                                       concurrency=3, **GREEDY)
        return [st["answer"] for st in states]

    answers = on_both(engine_backend, endpoint, run)
    alone = [few_shot_qa.run(question=q, backend=engine_backend, **GREEDY)["answer"] for q in questions[:2]]
    assert answers[:2] == alone
    assert "4/4" in capsys.readouterr().err  # tqdm's final count


def test_graph_from_json_runs_like_the_program(engine_backend, endpoint):
    st = sgl.run_graph(fork_join.trace().to_json(), backend=endpoint, **GREEDY)
    direct = fork_join.run(backend=engine_backend, **GREEDY)
    assert (st.text(), st["tip"]) == (direct.text(), direct["tip"])


def test_gen_logprobs_read_the_same_on_both_backends(engine_backend, endpoint):
    local, remote = (with_logprobs.run(backend=be, **GREEDY).get_meta_info("days") for be in (engine_backend, endpoint))
    assert local["finish_reason"] == remote["finish_reason"] == {"type": "length", "length": 4}
    out, remote_out = local["output_token_logprobs"], remote["output_token_logprobs"]
    # SGLang's shape on both: [logprob, token_id, text or None]
    assert len(out) == 4 and all(len(e) == 3 and e[2] is None for e in out)
    assert [e[1] for e in out] == [e[1] for e in remote_out]
    assert [e[0] for e in out] == pytest.approx([e[0] for e in remote_out], abs=1e-4)
    tops = [[e[1] for e in step] for step in local["output_top_logprobs"]]
    assert tops == [[e[1] for e in step] for step in remote["output_top_logprobs"]]
    assert all(len(step) == 2 for step in tops) and [t[0] for t in tops] == [e[1] for e in out]  # greedy
