"""The mask process (constrained/mask_process.py): its mirror matchers, brought to each request's
tokens (forward, and back after a jump's rewrite), fill the same masks as the step loop's own
matchers; a dead process answers nothing and never raises."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.bitmask import allocate_bitmask, allowed_tokens
from radixlm.runtime.constrained.mask_process import MaskProcesses, MirrorRow
from radixlm.runtime.constrained.service import GrammarService

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}}},
          "required": ["name", "tags"]}
SPECS = [("json_schema", json.dumps(SCHEMA)), ("regex", r"[a-c]{2,5}-[0-9]+")]


@pytest.fixture(scope="module")
def setup(default_source, smol_tokenizer):
    vocab_size = default_source.arch.vocab_size
    stops = [smol_tokenizer.eos_token_id]
    config = ConstraintConfig()
    service = GrammarService(smol_tokenizer, vocab_size, stops, config)
    proc = MaskProcesses(str(default_source.tokenizer_dir), vocab_size, stops, config, max_rows=4, count=2)
    yield service, proc, vocab_size
    proc.shutdown()
    service.shutdown()


def _ready(proc: MaskProcesses) -> None:
    proc.collect()
    for _ in range(600):  # the process imports and loads the tokenizer (seconds)
        if proc.usable:
            return
        time.sleep(0.1)
    raise AssertionError("the mask process did not start")


def _local_mask(matcher, vocab_size: int) -> np.ndarray:
    row = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_mask(row)
    return row.numpy().copy()


def _allowed_step(matcher, vocab_size: int, stops: list[int], rng: random.Random) -> int | None:
    row = allocate_bitmask(1, vocab_size)[0]
    matcher.fill_mask(row)
    ok = [t for t in allowed_tokens(row, vocab_size) if t not in stops]
    return rng.choice(ok) if ok else None


def test_mirrors_fill_the_step_loops_masks_forward_and_after_rewinds(setup):
    service, proc, vocab_size = setup
    _ready(proc)
    rng = random.Random(0)
    stops = list(service.vocab.stop_ids)
    grammars = [service.submit(kind, spec).result() for kind, spec in SPECS]
    reqs = {f"r{i}": (spec, g.new_matcher(), []) for i, (spec, g) in enumerate(zip(SPECS, grammars))}
    versions = dict.fromkeys(reqs, 0)  # bumped by each rewrite, as a jump bumps forced_tokens
    checked = 0
    for step in range(14):
        for rid, (_spec, m, toks) in reqs.items():
            if step in (6, 11) and len(toks) > 3:  # a jump's rewrite: the last tokens go, others come
                back = rng.randrange(1, 4)
                m.rollback(back)
                del toks[-back:]
                versions[rid] += 1
            t = _allowed_step(m, vocab_size, stops, rng)
            if t is not None:
                assert m.accept(t)
                toks.append(t)
        # the last token handed over as pending (accepted, not yet in the output list)
        rows = [MirrorRow(rid, spec, toks[:-1], toks[-1], versions[rid]) if toks
                else MirrorRow(rid, spec, toks, None, versions[rid]) for rid, (spec, _, toks) in reqs.items()]
        assert proc.ask(rows)
        assert not proc.ask(rows)  # one fill in flight at a time
        got = proc.collect()
        assert set(got) == set(reqs)
        for rid, (_spec, m, toks) in reqs.items():
            i, n, _masked = got[rid]
            assert n == len(toks)
            assert np.array_equal(proc.masks[i].numpy(), _local_mask(m, vocab_size)), (rid, step)
            checked += 1
    assert checked == 28
    assert {proc._mirrors[rid].worker for rid in reqs} == {0, 1}  # requests spread over the processes
    proc.forget("r0")
    assert proc.ask([MirrorRow("r1", SPECS[1], reqs["r1"][2], None, versions["r1"])])  # r0's mirror left
    assert set(proc.collect()) == {"r1"}


def test_a_row_its_mirror_cannot_take_is_left_to_the_step_loop(setup):
    service, proc, vocab_size = setup
    _ready(proc)
    stop = int(service.vocab.stop_ids[0])
    bad = MirrorRow("bad", SPECS[1], [stop] * 3)  # tokens the regex refuses: no mirror can take them
    ok = MirrorRow("ok", SPECS[1], [])
    assert proc.ask([bad, ok])
    got = proc.collect()
    assert "bad" not in got and "ok" in got
    fresh = service.submit(*SPECS[1]).result().new_matcher()
    assert np.array_equal(proc.masks[got["ok"][0]].numpy(), _local_mask(fresh, vocab_size))


def test_a_dead_process_answers_nothing_and_raises_nothing(default_source, smol_tokenizer):
    stops = [smol_tokenizer.eos_token_id]
    proc = MaskProcesses(str(default_source.tokenizer_dir), default_source.arch.vocab_size, stops,
                         ConstraintConfig(), max_rows=2)
    try:
        _ready(proc)
        assert proc.ask([MirrorRow("r", SPECS[1], [])])
        proc._workers[0].proc.kill()
        proc._workers[0].proc.wait(10)
        assert proc.collect() == {}
        assert proc.dead and not proc.usable
        assert not proc.ask([MirrorRow("r", SPECS[1], [])])
    finally:
        proc.shutdown()
