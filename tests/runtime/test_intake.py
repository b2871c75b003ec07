"""Request intake, shared by the Engine and the server: prompts x n x a session turn."""

from __future__ import annotations

import dataclasses

import pytest

from radixlm.runtime.intake import PromptRequest, Submission, submissions
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.sessions import SessionParams


def _prompt(rid: str, **params) -> PromptRequest:
    return PromptRequest(rid, [1, 2, 3], SamplingParams(**params), return_logprob=True, top_logprobs_num=2)


def test_n_copies_each_take_n_1_and_seed_plus_i():
    [copies] = submissions([_prompt("r", n=3, seed=10, temperature=0.7, stop="x")])
    assert [s.rid for s in copies] == ["r-0", "r-1", "r-2"]
    assert [s.params.seed for s in copies] == [10, 11, 12]
    assert all(s.params.n == 1 and s.params.temperature == 0.7 and s.params.stop == ("x",) for s in copies)
    assert all(s.return_logprob and s.top_logprobs_num == 2 and s.prompt_ids == [1, 2, 3] for s in copies)
    [unseeded] = submissions([_prompt("u", n=2)])
    assert [s.params.seed for s in unseeded] == [None, None]


def test_one_completion_keeps_its_rid_and_params():
    p = _prompt("only", temperature=0)
    [[sub]] = submissions([p])
    assert sub == Submission("only", [1, 2, 3], p.params, True, -1, 2, None) and sub.params is p.params


def test_prompts_stay_in_order():
    out = submissions([_prompt("a", n=2), _prompt("b")])
    assert [[s.rid for s in copies] for copies in out] == [["a-0", "a-1"], ["b"]]


def test_a_session_turn_is_one_prompt_with_n_1():
    session = SessionParams("s1")
    [[sub]] = submissions([_prompt("t")], session)
    assert sub.session == session
    for prompts in ([_prompt("t", n=2)], [_prompt("a"), _prompt("b")]):
        with pytest.raises(ValueError, match="a session turn is one prompt with n=1"):
            submissions(prompts, session)


def test_the_engine_process_adds_the_submission_it_receives_as_it_is():
    """Across the process boundary the params travel typed: no dict, no second parse; a
    submission nobody streams has its outputs held until it finishes."""
    from radixlm.runtime.output_processor import RequestOutput
    from radixlm.runtime.server.engine_process import _handle
    from radixlm.runtime.server.held_outputs import HeldOutputs

    class Core:
        def __init__(self) -> None:
            self.added: list[Submission] = []

        def add_request(self, sub: Submission) -> None:
            self.added.append(sub)

    core = Core()
    [[sub]] = submissions([_prompt("r", temperature=0)])
    held = HeldOutputs()
    _handle(core, sub, None, held)  # type: ignore[arg-type]
    assert core.added == [sub] and core.added[0].params is sub.params
    assert held.pass_on([RequestOutput("r", "a", [1])]) == [RequestOutput("r", "a", [1])]
    whole = dataclasses.replace(sub, rid="w", stream=False)
    _handle(core, whole, None, held)  # type: ignore[arg-type]
    assert core.added[1] is whole and held.pass_on([RequestOutput("w", "a", [1])]) == []
