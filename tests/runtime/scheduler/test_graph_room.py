"""GraphRoom: where steps replay as CUDA graphs, short prompt pieces that would push a step past
what a graph holds wait for the next step; long prompts (eager anyway) do not hold anything
back; outputs are unchanged (driven without a model, see sched_sim.py)."""

from __future__ import annotations

import pytest
from sched_sim import Sim, reference_output

from radixlm.runtime.scheduler import GraphRoom


def _decoders_then_pieces(sim: Sim, pieces: int, piece_len: int) -> None:
    for i in range(4):  # four requests decoding
        sim.add(f"d{i}", [40 + i, 1, 2], 30)
    while len(sim.sched.running) < 4 or sim.sched.waiting:
        sim.step()
    for i in range(pieces):  # then short prompts arrive together (a program's next gens)
        sim.add(f"p{i}", [i, i + 1, i + 2, i + 3][:piece_len], 5)


def _tokens(step) -> int:
    return sum(len(s.seq.token_ids) for s in step)


def test_short_pieces_past_the_graph_wait_a_step():
    sim = Sim(600, graph_room=GraphRoom(rows=12, extend_tokens=4), policy="fcfs")
    _decoders_then_pieces(sim, 6, 4)
    admitted = []
    for _ in range(3):
        step = sim.step()
        admitted.append([s.req.rid for s in step if s.prefill])
        assert _tokens(step) <= 12
    # (the admitted pieces decode from the next step on, and leave less room)
    assert admitted == [["p0", "p1"], ["p2"], ["p3"]]
    sim.run()
    for req in sim.requests.values():
        assert req.output_ids == reference_output(req.prompt_ids, req.params.max_new_tokens), req.rid
    sim.check_idle()


def test_without_graphs_they_come_together():
    sim = Sim(600, policy="fcfs")
    _decoders_then_pieces(sim, 6, 4)
    step = sim.step()
    assert [s.req.rid for s in step if s.prefill] == [f"p{i}" for i in range(6)]


def test_a_long_prompt_runs_the_step_eager_and_the_pieces_join_it():
    sim = Sim(600, graph_room=GraphRoom(rows=12, extend_tokens=4), policy="fcfs")
    for i in range(4):
        sim.add(f"d{i}", [40 + i, 1, 2], 30)
    sim.step()
    sim.add("long", list(range(1, 11)), 5)  # 10 tokens: no graph holds it
    for i in range(4):
        sim.add(f"p{i}", [i, i + 1, i + 2, i + 3], 5)
    step = sim.step()
    assert [s.req.rid for s in step if s.prefill] == ["long", "p0", "p1", "p2", "p3"]


def test_a_step_without_room_for_a_whole_piece_holds_nothing_back():
    """Four decodes in a graph of six rows leave less than one piece of four: holding pieces back
    could keep them waiting as long as the decodes run, so they are not held."""
    sim = Sim(600, graph_room=GraphRoom(rows=6, extend_tokens=4), policy="fcfs")
    _decoders_then_pieces(sim, 3, 4)
    step = sim.step()
    assert [s.req.rid for s in step if s.prefill] == ["p0", "p1", "p2"]


@pytest.mark.parametrize("rows, extend", [(0, 4), (8, 0)])
def test_a_graph_room_needs_rows_and_tokens(rows, extend):
    with pytest.raises(ValueError, match="graph room"):
        GraphRoom(rows, extend)
