"""Batched grammar work equals row-by-row work: fill_masks (xgrammar's or llguidance's thread
pool) gives the rows each matcher's fill_mask gives, and accept_tokens the same verdicts and
states, over matchers of several grammars and backends at different points; a failing matcher
fails only its own row."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.bitmask import allocate_bitmask, allowed_tokens
from radixlm.runtime.constrained.grammar import GrammarConfig, accept_tokens, fill_masks
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.service import grammar_config

pytestmark = pytest.mark.slow

SPECS = [
    ("json_schema", '{"type":"object","properties":{"a":{"type":"string","maxLength":8},"b":{"type":"integer"}},'
                    '"required":["a","b"]}'),
    ("json_schema", '{"type":"array","items":{"type":"boolean"}}'),
    ("regex", r"[a-c]{2,5}-[0-9]+"),
    ("choices", ["red wine", "white"]),
]


@pytest.fixture(scope="module")
def backends(vocab) -> dict:
    return {name: GRAMMAR_BACKENDS[name](vocab, GrammarConfig(cache_size=16)) for name in ("xgrammar", "llguidance")}


@pytest.fixture(params=["xgrammar", "llguidance"])
def backend(request, backends):
    return backends[request.param]


def _walk(backend, rng: random.Random):
    """Two matchers per spec, each advanced by a few random allowed tokens, twice (one to batch,
    one to compare)."""
    pairs = []
    for kind, spec in SPECS:
        grammar = backend.compile(kind, spec)
        for steps in (0, rng.randrange(1, 6)):
            a, b = grammar.new_matcher(), grammar.new_matcher()
            row = allocate_bitmask(1, backend.vocab_size)[0]
            for _ in range(steps):
                row.fill_(-1)
                a.fill_mask(row)
                ok = [t for t in allowed_tokens(row, backend.vocab_size) if t not in backend.vocab.stop_ids]
                if not ok:
                    break
                t = rng.choice(ok)
                assert a.accept(t) and b.accept(t)
            pairs.append((a, b))
    return pairs


def _same_rows(pairs, batch, rows, got, vocab_size: int) -> None:
    for (_, b), r, g in zip(pairs, rows, got):
        one = allocate_bitmask(1, vocab_size)[0]
        need = b.fill_mask(one)  # `one` starts all-allowed, so it is right even when need is False
        assert g is True or g == need
        assert np.array_equal(batch[r].numpy(), one.numpy())


def test_fill_masks_equals_fill_mask_row_by_row(backend):
    pairs = _walk(backend, random.Random(0))
    batch = allocate_bitmask(len(pairs) + 3, backend.vocab_size)
    batch.fill_(7)  # stale content from an earlier step must not survive
    rows = [2 + i for i in range(len(pairs))]
    got = fill_masks([a for a, _ in pairs], batch, rows)
    _same_rows(pairs, batch, rows, got, backend.vocab_size)
    matchers = [a for a, _ in pairs]
    assert type(matchers[0]).fill_batch(matchers, batch, rows) is not None  # the batch path, no fallback


def test_the_fill_pool_size_is_the_engines_flag_and_positive():
    assert grammar_config(ConstraintConfig(grammar_fill_threads=3)).fill_threads == 3
    assert grammar_config(ConstraintConfig()).fill_threads == 1
    with pytest.raises(ValueError, match="grammar_fill_threads"):
        ConstraintConfig(grammar_fill_threads=0)
    with pytest.raises(ValueError, match="fill_threads"):
        GrammarConfig(fill_threads=0)


def test_fill_masks_mixes_backends_and_finished_matchers(backends, smol_tokenizer, vocab):
    """Rows of both backends interleaved in one call, with llguidance matchers that accepted a
    stop token (their rows allow the stop tokens; xgrammar refuses to mask after one)."""
    rng = random.Random(3)
    pairs = [p for name in ("xgrammar", "llguidance") for p in _walk(backends[name], rng)]
    white = smol_tokenizer.encode("white", add_special_tokens=False) + [vocab.stop_ids[0]]
    grammar = backends["llguidance"].compile("choices", ["red wine", "white"])
    for _ in range(2):
        done = grammar.new_matcher(), grammar.new_matcher()
        assert all(m.accept(t) for m in done for t in white) and all(m.is_terminated() for m in done)
        pairs.append(done)
    rng.shuffle(pairs)
    batch = allocate_bitmask(len(pairs) + 1, vocab.vocab_size)
    batch.fill_(7)
    rows = [1 + i for i in range(len(pairs))][::-1]
    got = fill_masks([a for a, _ in pairs], batch, rows)
    _same_rows(pairs, batch, rows, got, vocab.vocab_size)


def test_accept_tokens_equals_accept_row_by_row(backend):
    rng = random.Random(1)
    pairs = _walk(backend, rng)
    tokens = [rng.randrange(backend.vocab_size) for _ in pairs]
    row = allocate_bitmask(1, backend.vocab_size)[0]
    for i, (a, _) in enumerate(pairs[::2]):  # half the rows get a token their grammar allows
        row.fill_(-1)
        a.fill_mask(row)
        allowed = allowed_tokens(row, backend.vocab_size)
        tokens[2 * i] = allowed[len(allowed) // 2]
    got = accept_tokens([a for a, _ in pairs], tokens)
    assert got == [b.accept(t) for (_, b), t in zip(pairs, tokens)]
    assert any(got) and not all(got)
    masks = allocate_bitmask(2, backend.vocab_size)
    for a, b in pairs:  # the states stayed equal
        masks.fill_(-1)
        a.fill_mask(masks[0])
        b.fill_mask(masks[1])
        assert np.array_equal(masks[0].numpy(), masks[1].numpy())


def test_a_failing_matcher_fails_only_its_row(backend):
    pairs = _walk(backend, random.Random(2))

    class Broken:
        def fill_mask(self, row):
            raise RuntimeError("engine fault")

        def accept(self, token):
            raise RuntimeError("engine fault")

    matchers = [a for a, _ in pairs[:3]] + [Broken()] + [a for a, _ in pairs[3:5]]
    got = fill_masks(matchers, allocate_bitmask(len(matchers), backend.vocab_size), list(range(len(matchers))))
    assert isinstance(got[3], RuntimeError) and not any(isinstance(g, Exception) for i, g in enumerate(got) if i != 3)
    took = accept_tokens(matchers, [0] * len(matchers))
    assert isinstance(took[3], RuntimeError)


def test_an_llguidance_failure_in_a_batch_fails_only_its_row(backends, smol_tokenizer):
    """llguidance gives up on a lexer step (test_llguidance.TOO_COMPLEX): its row alone fails."""
    backend = backends["llguidance"]
    broken = backend.compile("json_schema", {"type": "string", "minLength": 1, "maxLength": 5000,
                                             "pattern": "^$|(^(?:\\S+\\s+){0,99}\\S+$)"}).new_matcher()
    assert broken.accept(smol_tokenizer.encode('"', add_special_tokens=False)[0])
    pairs = _walk(backend, random.Random(4))
    matchers = [a for a, _ in pairs[:2]] + [broken] + [a for a, _ in pairs[2:4]]
    batch = allocate_bitmask(len(matchers), backend.vocab_size)
    got = fill_masks(matchers, batch, list(range(len(matchers))))
    assert isinstance(got[2], RuntimeError) and "too many expressions" in str(got[2])
    rest = [(i, p) for i, p in zip([0, 1, 3, 4], pairs[:4])]
    _same_rows([p for _, p in rest], batch, [i for i, _ in rest], [got[i] for i, _ in rest], backend.vocab_size)


def test_apply_bitmask_matches_the_bit_layout():
    """Bit t % 32 of word t // 32 allows token t, on both paths (every row, or some rows)."""
    import torch

    from radixlm.runtime.constrained.bitmask import apply_bitmask_

    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    allowed = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(3)]
    logits = torch.zeros(3, vocab)
    apply_bitmask_(logits, bitmask)
    assert (logits == 0).tolist() == allowed
    logits = torch.zeros(5, vocab)
    apply_bitmask_(logits, bitmask, [4, 0, 2])
    assert [(logits[r] == 0).tolist() for r in (4, 0, 2)] == allowed
    assert bool((logits[[1, 3]] == 0).all())
