import math

import pytest
import torch

from radixlm.runtime.sampling.sampler import (
    SamplingBatch,
    apply_penalties_and_blocks,
    filtered_probs,
    make_generator,
    row_argmax,
    sample,
)
from radixlm.runtime.sampling_params import SamplingParams as SP

CPU = torch.device("cpu")


def build(params, logits=None, outputs=None, gens=None, blocks=None, vocab=None):
    b = len(params)
    v = vocab if vocab is not None else logits.shape[1]
    return SamplingBatch.build(
        params,
        outputs if outputs is not None else [[] for _ in range(b)],
        gens,
        v,
        CPU,
        eos_ids_to_block=blocks,
    )


def rand_logits(b, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def test_greedy_is_argmax_and_costs_nothing_else():
    logits = rand_logits(6, 50)
    batch = build([SP(temperature=0)] * 6, logits)
    assert batch.all_greedy and batch.temperatures is None and not batch.need_penalties
    out = sample(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    bf = logits.to(torch.bfloat16)
    assert sample(bf, batch).token_ids == bf.float().argmax(-1).tolist()


def test_row_argmax_is_torchs_argmax_on_ties_nan_views_and_dtypes():
    """The CPU's numpy argmax gives torch's answer: the first maximum, the first NaN, any strides."""
    x = rand_logits(5, 49152)
    x[1, 7] = x[1, 9] = x[1, 40000] = 100.0  # ties: the first
    x[2, 3], x[2, 5] = float("nan"), 1e9  # a NaN wins, as in torch
    x[3] = float("-inf")  # all blocked: index 0
    for t in (x, x[:, ::3], x[1:4], x.T.contiguous().T, x.bfloat16(), x.double()):
        got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1)), t.dtype
    assert row_argmax(x[:0]).shape == (0,)


def test_top_k_1_is_argmax():
    torch.manual_seed(0)
    logits = rand_logits(4, 40, seed=1)
    batch = build([SP(top_k=1, temperature=1.5)] * 4, logits)
    assert batch.all_greedy
    for _ in range(5):
        assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax():
    torch.manual_seed(0)
    logits = rand_logits(8, 64, seed=2)
    gens = [None] * 4 + [make_generator(i) for i in range(4)]
    batch = build([SP(top_p=1e-6)] * 8, logits, gens=gens)
    assert not batch.all_greedy and batch.need_top_p
    for _ in range(5):
        assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_low_temperature_concentrates():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 2.0, 1.9, 0.5]]).repeat(64, 1)
    batch = build([SP(temperature=1e-3)] * 64, logits)
    assert not batch.all_greedy
    assert set(sample(logits, batch).token_ids) == {1}
    hot = build([SP(temperature=1.0)] * 64, logits)
    assert len(set(sample(logits, hot).token_ids)) > 1


def test_top_k_and_top_p_filters_exact():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = filtered_probs(logits, build([SP(top_k=2)], logits))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    # top_p=0.7: 0.4 + 0.3 reaches 0.7 -> keep two tokens.
    p = filtered_probs(logits, build([SP(top_p=0.7)], logits))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    p = filtered_probs(logits, build([SP(top_p=0.71)], logits))
    torch.testing.assert_close(p, torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0.0]]))
    # top-p applies to the top-k-renormalized distribution (HF/vLLM order): after top_k=3
    # the probs are 4/9, 3/9, 2/9; top_p=0.5 keeps 4/9 + 3/9.
    p = filtered_probs(logits, build([SP(top_k=3, top_p=0.5)], logits))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_min_p_filters():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]])).repeat(200, 1)
    batch = build([SP(min_p=0.2)] * 200, logits)  # threshold 0.1: drops token 3 only
    p = filtered_probs(logits, batch)
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)
    toks = sample(logits, batch).token_ids
    assert 3 not in toks and {0, 1, 2} <= set(toks)
    # Combined with top-k (sorted path) too.
    batch = build([SP(min_p=0.5, top_k=3)] * 200, logits)
    assert set(sample(logits, batch).token_ids) == {0, 1}


def test_mixed_parameters_in_one_batch():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(4, 1)
    params = [SP(top_k=2), SP(), SP(temperature=0), SP(min_p=0.6)]
    p = filtered_probs(logits, build(params, logits))
    expected = torch.tensor(
        [[4 / 7, 3 / 7, 0, 0], [0.4, 0.3, 0.2, 0.1], [1.0, 0, 0, 0], [4 / 7, 3 / 7, 0, 0]]
    )
    torch.testing.assert_close(p, expected)


def test_mixed_greedy_and_sampled_batch():
    torch.manual_seed(0)
    logits = rand_logits(6, 30, seed=3) / 3  # flat enough to vary
    params = [SP(temperature=0), SP(), SP(top_k=1), SP(top_p=0.9), SP(temperature=0), SP()]
    batch = build(params, logits)
    greedy = logits.argmax(-1)
    seen = {1: set(), 3: set(), 5: set()}
    for _ in range(10):
        toks = sample(logits, batch).token_ids
        for r in (0, 2, 4):
            assert toks[r] == greedy[r].item()
        for r in seen:
            seen[r].add(toks[r])
    assert all(len(s) > 1 for s in seen.values())


def run_seeded(logits_rows, params, seed_row, steps):
    """Sample `steps` times; returns the token sequence of `seed_row`."""
    out = []
    gens = [make_generator(1234) if i == seed_row else
            (make_generator(99 + i) if i % 2 else None) for i in range(len(params))]
    batch = build(params, logits_rows, gens=gens)
    for _ in range(steps):
        out.append(sample(logits_rows, batch).token_ids[seed_row])
    return out


def test_seed_reproducible_regardless_of_batch():
    torch.manual_seed(0)
    target = rand_logits(1, 100, seed=5) / 3
    p = SP(top_p=0.95, temperature=0.9)
    alone = run_seeded(target, [p], 0, 20)
    assert len(set(alone)) > 3  # really sampling
    # Different position and companions (one with a small top_k changes the sort width,
    # one greedy, one seeded with another seed, one unseeded).
    others = rand_logits(4, 100, seed=6)
    mixed = torch.cat([others[:2], target, others[2:]])
    companions = [SP(top_k=5), SP(temperature=0), p, SP(), SP(min_p=0.1)]
    torch.manual_seed(777)  # the global RNG state must not matter either
    assert run_seeded(mixed, companions, 2, 20) == alone
    assert run_seeded(target, [p], 0, 20) == alone
    g1, g2 = make_generator(1), make_generator(2)
    b = build([p, p], torch.cat([target, target]), gens=[g1, g2])
    draws = [sample(torch.cat([target, target]), b).token_ids for _ in range(20)]
    assert any(x != y for x, y in draws)  # different seeds differ


def test_repetition_frequency_presence_numbers():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SP(repetition_penalty=2.0),
        SP(frequency_penalty=0.5, presence_penalty=0.25),
    ]
    outputs = [[0, 1, 1], [0, 1, 1, 1]]
    batch = build(params, logits, outputs=outputs)
    out = apply_penalties_and_blocks(logits, batch)
    torch.testing.assert_close(
        out,
        torch.tensor(
            [
                [1.0, -2.0, 0.5, 3.0, -2.0],  # 2/2, -1*2; unseen tokens unchanged
                [2.0 - 0.5 - 0.25, -1.0 - 1.5 - 0.25, 0.5, 3.0, -2.0],
            ]
        ),
    )
    assert logits[0, 0] == 2.0  # input untouched


def test_all_penalties_together_and_greedy_uses_them():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    p = SP(temperature=0, repetition_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2)
    batch = build([p], logits, outputs=[[0, 0, 3]])
    out = apply_penalties_and_blocks(logits, batch)
    # Token 0: 3/1.5 - 2*0.1 - 0.2 = 1.6; token 3: -1*1.5 - 0.1 - 0.2 = -1.8.
    torch.testing.assert_close(out, torch.tensor([[1.6, 2.9, 0.0, -1.8]]))
    assert sample(logits, batch).token_ids == [1]
    # Without output tokens nothing is penalized (prompt tokens are not counted).
    assert not build([p], logits, outputs=[[]]).need_penalties


def test_min_new_tokens_blocks_eos():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0]]).repeat(32, 1)
    params = [SP(temperature=0), SP(), SP()] + [SP(top_k=3)] * 29
    blocks = [[1], [1, 2], []] + [[1, 2]] * 29
    batch = build(params, logits, blocks=blocks)
    out = apply_penalties_and_blocks(logits, batch)
    assert out[0, 1] == float("-inf") and out[1, 2] == float("-inf") and out[2, 1] == 5.0
    for _ in range(5):
        toks = sample(logits, batch).token_ids
        assert toks[0] == 2
        assert all(t in (0, 3) for i, t in enumerate(toks) if i != 0 and i != 2)


def test_no_nan_when_everything_is_masked():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 2.0, 3.0], [float("-inf")] * 3, [0.0, float("inf"), 1.0]])
    gens = [None, make_generator(0), None]
    batch = build([SP(top_p=0.5)] * 3, logits, gens=gens, blocks=[[0, 1, 2], [], []])
    for _ in range(10):
        toks = sample(logits, batch, return_logprob=True).token_ids
        assert all(0 <= t < 3 for t in toks) and toks[2] == 1
    p = filtered_probs(logits, batch)
    assert not torch.isnan(p).any()


def test_logprobs_are_raw_and_top_logprobs_sorted():
    torch.manual_seed(0)
    logits = rand_logits(3, 20, seed=7)
    params = [SP(temperature=0.5, repetition_penalty=1.3), SP(temperature=0), SP(top_k=3)]
    batch = build(params, logits, outputs=[[1, 2], [], [4]])
    out = sample(logits.to(torch.bfloat16), batch, top_logprobs_num=[5, 0, 20],
                 return_logprob=True)
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-6)
    assert [len(x) for x in out.top_logprobs] == [5, 0, 20]
    for row, lp in zip(out.top_logprobs, raw):
        vals = [v for _, v in row]
        assert vals == sorted(vals, reverse=True)
        for tok, v in row:
            assert v == pytest.approx(lp[tok].item(), abs=1e-6)
    full = out.top_logprobs[2]
    assert sorted(t for t, _ in full) == list(range(20))
    assert sum(math.exp(v) for _, v in full) == pytest.approx(1.0, abs=1e-5)
    only_top = sample(logits, batch, top_logprobs_num=2)
    assert only_top.logprobs is None and [len(x) for x in only_top.top_logprobs] == [2, 2, 2]


def chi_square(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


# Critical value of chi-square with 7 degrees of freedom at p = 0.001 is 24.32.
CHI2_7DF_P001 = 24.32


@pytest.mark.parametrize("params", [SP(), SP(top_k=8), SP(top_p=0.999999)])
def test_batched_sampling_follows_softmax(params):
    torch.manual_seed(1234)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
    probs = torch.softmax(logits, -1)[0].tolist()
    rows, steps = 4000, 5
    batch = build([params] * rows, logits.repeat(rows, 1))
    counts = [0] * 8
    for _ in range(steps):
        for t in sample(logits.repeat(rows, 1), batch).token_ids:
            counts[t] += 1
    assert chi_square(counts, probs, rows * steps) < CHI2_7DF_P001


def test_seeded_sampling_follows_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
    probs = torch.softmax(logits, -1)[0].tolist()
    rows, steps = 100, 40
    gens = [make_generator(s) for s in range(rows)]
    batch = build([SP(top_k=100)] * rows, logits.repeat(rows, 1), gens=gens)
    counts = [0] * 8
    for _ in range(steps):
        for t in sample(logits.repeat(rows, 1), batch).token_ids:
            counts[t] += 1
    assert chi_square(counts, probs, rows * steps) < CHI2_7DF_P001


def test_top_k_sampling_follows_renormalized_distribution():
    torch.manual_seed(99)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2]])
    rows = 6000
    batch = build([SP(top_k=3, temperature=2.0)] * rows, logits.repeat(rows, 1))
    counts = [0] * 8
    for t in sample(logits.repeat(rows, 1), batch).token_ids:
        counts[t] += 1
    p = torch.softmax(logits[0, [4, 5, 0]] / 2.0, -1).tolist()
    assert sum(counts[i] for i in (1, 2, 3, 6, 7)) == 0
    # 2 degrees of freedom, p = 0.001 -> 13.82.
    assert chi_square([counts[4], counts[5], counts[0]], p, rows) < 13.82


def test_build_and_sample_errors():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="output token id 7 of row 1 is outside the vocab"):
        build([SP(presence_penalty=1.0)] * 2, logits, outputs=[[1], [7]])
    with pytest.raises(ValueError, match="eos id 9 to block in row 0"):
        build([SP()] * 2, logits, blocks=[[9], []])
    with pytest.raises(ValueError, match="output_ids has 1 rows, params has 2"):
        SamplingBatch.build([SP()] * 2, [[]], None, 5, CPU)
    batch = build([SP()] * 2, logits)
    with pytest.raises(ValueError, match=r"logits must have shape \(2, V\)"):
        sample(torch.zeros(3, 5), batch)
    with pytest.raises(ValueError, match="logits have 6 columns"):
        sample(torch.zeros(2, 6), batch)


def test_huge_temperature_never_samples_a_blocked_token():
    """temperature 1e300 is inf in fp32; blocked (-inf) logits divided by it were NaN, and a NaN
    row could draw the blocked EOS inside the min_new_tokens window."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]]).repeat(64, 1)
    hot = SP(temperature=2.0)
    object.__setattr__(hot, "temperature", 1e300)  # past the API's bound: the sampler holds on its own
    batch = build([hot] * 64, logits, blocks=[[1]] * 64)
    p = filtered_probs(logits, batch)
    assert not torch.isnan(p).any() and (p[:, 1] == 0).all()
    torch.testing.assert_close(p[0], torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3]))
    for _ in range(5):
        assert 1 not in sample(logits, batch).token_ids


def test_draws_do_not_depend_on_the_batch_or_the_loop():
    """A request's token depends only on its logits and its own draws: the same generator state
    gives the same token alone or in a batch, and a dropped row's draw changes nothing else."""
    logits = rand_logits(3, 200, seed=11) / 4
    p = [SP(top_p=0.9), SP(top_k=7), SP(min_p=0.05, temperature=1.3)]
    together = sample(logits, build(p, logits, gens=[make_generator(s) for s in range(3)])).token_ids
    alone = [sample(logits[i : i + 1], build([p[i]], logits[i : i + 1], gens=[make_generator(i)])).token_ids[0]
             for i in range(3)]
    assert together == alone


def test_logit_bias_is_added_per_row_after_penalties_and_before_blocks():
    logits = rand_logits(3, 10, seed=5)
    params = [SP(logit_bias={2: 1.5, "7": -2.0}), SP(), SP(logit_bias={0: 100.0}, temperature=0.7, seed=1)]
    batch = build(params, logits, blocks=[[7], [], [0]])
    out = apply_penalties_and_blocks(logits, batch)
    expected = logits.clone()
    expected[0, 2] += 1.5
    expected[0, 7] = float("-inf")  # min_new_tokens blocks win over a bias
    expected[2, 0] = float("-inf")
    assert torch.equal(out, expected)
    assert build([SP()], logits[:1]).bias_rows is None  # no bias: no tensors, the fast path stays


def test_a_big_logit_bias_forces_its_token_greedy_and_sampled():
    logits = rand_logits(2, 50, seed=9)
    params = [SP(temperature=0, logit_bias={13: 1e4}), SP(temperature=1.0, top_p=0.9, logit_bias={"21": 1e4})]
    for _ in range(5):
        tokens = sample(logits, build(params, logits, gens=[None, make_generator(4)])).token_ids
        assert tokens == [13, 21]
    masked = logits.clone()
    masked[0, 13] = float("-inf")  # a grammar's mask: the bias cannot bring a banned token back
    assert sample(masked[:1], build(params[:1], masked[:1])).token_ids[0] != 13


def test_logit_bias_outside_the_vocab_is_refused():
    with pytest.raises(ValueError, match="logit_bias token id 60"):
        build([SP(logit_bias={60: 1.0})], vocab=50)
