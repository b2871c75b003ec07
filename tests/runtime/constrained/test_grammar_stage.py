"""The grammar stage (radixlm/runtime/constrained/stage.py). A greedy row whose drawn token its grammar
refuses tries its next-best tokens before a mask (GrammarStage.rejected): the token it takes is the
masked row's argmax, ties included; a stop token among them, or none allowed, leaves the row to its
mask; the logits stay as they were. The grammar service is built off the step loop."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch
from matcher_helpers import _feed, _ids, _mask

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask_
from radixlm.runtime.constrained.service import GrammarService
from radixlm.runtime.constrained.stage import NEXT_BEST_TRIES, GrammarStage

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stage(smol_tokenizer, width):
    config = ConstraintConfig()
    service = GrammarService(smol_tokenizer, width, [smol_tokenizer.eos_token_id], config)
    yield GrammarStage(lambda: service, width, config)
    service.shutdown()


def _matcher(stage, smol_tokenizer, prefix: str):
    m = stage.service.backend.compile("json_schema", PERSON).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, prefix)) is None
    return m


def _masked_argmax(stage, matcher, row: torch.Tensor) -> int:
    mask = allocate_bitmask(1, stage.vocab_size)
    matcher.fill_mask(mask[0])
    x = row.clone().unsqueeze(0)
    apply_bitmask_(x, mask, [0])
    return int(x[0].argmax())


def _token(smol_tokenizer, text: str) -> int:
    ids = _ids(smol_tokenizer, text)
    assert len(ids) == 1, text
    return ids[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_refused_draw_takes_the_best_allowed_token(stage, smol_tokenizer, width, dtype):
    m = _matcher(stage, smol_tokenizer, '{"name":"Bo","age":')  # an integer next
    logits = torch.zeros(1, width, dtype=dtype)
    letters, seven, three = _token(smol_tokenizer, "abc"), _token(smol_tokenizer, "7"), _token(smol_tokenizer, "3")
    logits[0, letters], logits[0, seven], logits[0, three] = 9.0, 5.0, 5.0  # a tie: the lower id wins, as argmax
    before = logits.clone()
    tokens = [letters]
    redo, picked = stage.rejected([SimpleNamespace(matcher=m)], tokens, [0], logits)
    assert (redo, picked) == ([], [0]) and tokens == [min(seven, three)]
    assert tokens[0] == _masked_argmax(stage, m, before[0].float())
    assert torch.equal(logits, before)
    assert m.accept(tokens[0])  # the token the test took is the one accepted next


def test_a_stop_token_or_nothing_allowed_leaves_the_row_to_its_mask(stage, smol_tokenizer, width):
    m = _matcher(stage, smol_tokenizer, '{"name":"Bo","age":')
    letters = _token(smol_tokenizer, "abc")
    logits = torch.full((1, width), -1.0)
    logits[0, letters], logits[0, smol_tokenizer.eos_token_id] = 9.0, 8.0
    assert stage.rejected([SimpleNamespace(matcher=m)], [letters], [0], logits) == ([0], [])
    # more refused tokens ahead of the first allowed one than the tries
    refused = [_token(smol_tokenizer, w) for w in ("abc", "xyz", "hello", "world", "foo", "bar", "the", "and", "cat")]
    assert len(refused) > NEXT_BEST_TRIES
    logits = torch.zeros(1, width)
    for rank, t in enumerate(refused):
        logits[0, t] = 20.0 - rank
    before = logits.clone()
    assert stage.rejected([SimpleNamespace(matcher=m)], [refused[0]], [0], logits) == ([0], [])
    assert torch.equal(logits, before)
    # without the logits (penalties, blocks or sampling drew the token) the row is masked at once
    assert stage.rejected([SimpleNamespace(matcher=m)], [letters], [0]) == ([0], [])


class _BrokenTest:
    """A matcher whose grammar engine fails when asked about a token."""

    def allows(self, token: int) -> bool:
        raise RuntimeError("llguidance: broken")


@pytest.mark.parametrize("rows", [1, 2])
def test_a_failing_test_leaves_its_row_to_its_mask(stage, smol_tokenizer, width, rows):
    """The row's mask fill reports the failure for its request alone; a row beside it is tested as ever."""
    good = _matcher(stage, smol_tokenizer, '{"name":"Bo","age":')
    reqs = [SimpleNamespace(matcher=_BrokenTest()), SimpleNamespace(matcher=good)][:rows]
    tokens = [_token(smol_tokenizer, "7")] * rows
    logits = torch.zeros(rows, width)
    assert stage.rejected(reqs, list(tokens), list(range(rows)), logits) == ([0], [])
    if rows == 2:
        assert good.accept(tokens[1])  # the token its test took


def test_next_best_equals_the_masked_argmax_on_random_rows(stage, smol_tokenizer, width):
    """Random logits where a few tokens, allowed or not, stand out: whenever the next-best search takes a token, it
    is the argmax of the masked row."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    prefixes = ['{"name":"Bo', '{"name":"Bo","age":', '{"name":"Bo","age":4', '{']
    took = 0
    for _ in range(60):
        m = _matcher(stage, smol_tokenizer, rng.choice(prefixes))
        logits = torch.randn(1, width, generator=gen)
        allowed = sorted(_mask(m, width))
        leaders = rng.sample(range(width), 4) + rng.sample(allowed, min(3, len(allowed)))
        for t in leaders:
            logits[0, t] = 10.0 + rng.choice([0.0, 0.5, 1.0])  # ties among the leaders too
        drawn = int(logits[0].argmax())
        tokens = [drawn]
        redo, picked = stage.rejected([SimpleNamespace(matcher=m)], tokens, [0], logits)
        expect = _masked_argmax(stage, m, logits[0])
        if picked:
            took += 1
            assert tokens[0] == expect
        elif not redo:
            assert drawn == expect  # allowed as drawn
    assert took >= 10


# --- the service is built off the step loop ----------------------------------------------------


def _pending(rid: str, spec) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, params=SimpleNamespace(constraint=("json_schema", spec)), matcher=None)


def _drain(stage, want: int) -> tuple[list, list]:
    done, failed = [], []
    for _ in range(400):  # (each idle call waits at most COMPILE_WAIT_S)
        got, bad = stage.ready(idle=True)
        done += got
        failed += bad
        if len(done) + len(failed) >= want:
            break
    return done, failed


def test_the_service_is_built_off_the_step_loop(smol_tokenizer, width):
    """The first constrained request starts the service's build in a thread and returns at once:
    while it builds, the step loop's calls answer without waiting; a malformed spec is still a
    ValueError at once; the waiting requests compile once it is built."""
    config = ConstraintConfig()
    release = threading.Event()

    def make() -> GrammarService:
        assert release.wait(60)
        return GrammarService(smol_tokenizer, width, [smol_tokenizer.eos_token_id], config)

    stage = GrammarStage(make, width, config)
    first, second = _pending("a", PERSON), _pending("b", PERSON)
    stage.submit(first)
    stage.submit(second)
    assert stage.compiling and stage.ready(idle=False) == ([], [])
    with pytest.raises(ValueError, match="constrained decoding"):
        stage.submit(_pending("c", "{not json"))
    assert stage.cancel("b") and not stage.cancel("b")
    release.set()
    done, failed = _drain(stage, 1)
    assert done == [first] and failed == [] and first.matcher is not None and not stage.compiling
    assert first.matcher.accept(_ids(smol_tokenizer, "{")[0])
    stage.shutdown()


def test_a_failed_build_fails_the_waiting_requests(width):
    def make() -> GrammarService:
        raise ValueError("the grammar engine cannot read this tokenizer")

    stage = GrammarStage(make, width, ConstraintConfig())
    waiting = [_pending("a", PERSON), _pending("b", PERSON)]
    for req in waiting:
        stage.submit(req)
    done, failed = _drain(stage, 2)
    assert done == [] and [r for r, _ in failed] == waiting
    assert all(m == "constrained decoding: the grammar engine cannot read this tokenizer" for _, m in failed)
    with pytest.raises(ValueError, match="cannot read"):
        stage.service  # noqa: B018
    stage.shutdown()
