"""Batched next-token sampling over a (B, V) logits tensor.

Pipeline per row, in this order (all in fp32):

1. penalties over the tokens the row has *generated so far* (prompt tokens are not counted,
   unlike HF/vLLM whose repetition penalty also covers the prompt):
   - repetition (HF/vLLM/CTRL): a seen token's logit is divided by ``repetition_penalty`` when
     positive and multiplied by it when negative;
   - frequency / presence (OpenAI): ``logit -= count * frequency_penalty
     + (count > 0) * presence_penalty``;
2. logit_bias (SGLang's / OpenAI's): each ``{token: bias}`` is added to that token's logit (a
   grammar's ``-inf`` stays ``-inf``);
3. min_new_tokens: the caller's ``eos_ids_to_block`` tokens are set to ``-inf``;
4. greedy rows (``SamplingParams.is_greedy``) take the argmax here, deterministically;
5. sampled rows: divide by temperature, softmax, then top-k, top-p (on the top-k-renormalized
   distribution, as HF/vLLM), min-p (relative to the top probability), and draw one token.
   The top-1 token always survives the filters, so a row never becomes empty or NaN.

Every draw is an inverse-CDF draw over the row's weights in vocabulary order: one uniform number
``u`` per row, and the token whose cumulative weight first passes ``u * sum(w)``. Each request
keeps its own generator (``make_generator``), a host-side ``random.Random`` that gives one ``u``
per sampled token, so a fixed seed gives the same tokens whatever else is in the batch and
whichever loop (plain or overlap) queues the step; rows without one draw ``u`` from torch's
default CPU generator. ``sample_tokens`` never waits for the device (the overlap schedule queues
it ahead of the host); ``sample`` adds the copy to the host and the logprobs.

Temperatures are capped at ``MAX_TEMPERATURE`` (past it the distribution is uniform in fp32
anyway; an infinite one would turn blocked ``-inf`` logits into NaN).

Logprobs are ``log_softmax`` of the RAW logits (before penalties, biases, temperature and filters),
in fp32. This is vLLM's default (``raw_logprobs``) and SGLang's greedy path; note that recent
SGLang reports temperature-scaled logprobs for sampled rows unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.sampling_params import SamplingParams

_NEG_INF = float("-inf")
MAX_TEMPERATURE = 1e6

RowGenerator = random.Random


def _tensor(data: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host data on ``device``; on CUDA copied without waiting for queued work."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def make_generator(seed: int) -> RowGenerator:
    """The generator of one request's draws; any Python int is accepted."""
    return random.Random(int(seed))


@dataclass
class SampleOutput:
    """Result of one sampling step, as plain Python lists (one entry per row)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class SamplingBatch:
    """Per-step sampling state for a batch; build it with ``SamplingBatch.build``.

    Tensors for temperature / top-k / top-p / min-p cover only the rows that sample
    (``sample_rows``); an all-greedy batch holds none of them. Penalties are kept sparse, one
    entry per distinct (row, token) pair among the rows' generated tokens.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    is_greedy: list[bool]
    all_greedy: bool
    # -- sampled rows (None / empty when all_greedy) --
    sample_rows: torch.Tensor | None  # (S,) int64, row index in the batch
    temperatures: torch.Tensor | None  # (S, 1) fp32
    top_ks: torch.Tensor | None  # (S,) int64, vocab_size when off
    top_ps: torch.Tensor | None  # (S,) fp32
    min_ps: torch.Tensor | None  # (S,) fp32
    need_temperature: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    sort_width: int  # columns kept by the sort/top-k stage
    seeded: list[tuple[int, RowGenerator]]  # (position among sampled rows, its generator)
    # -- penalties (None when no row uses one) --
    need_penalties: bool
    penalty_rows: torch.Tensor | None  # (P,) int64
    penalty_tokens: torch.Tensor | None  # (P,) int64
    penalty_counts: torch.Tensor | None  # (P,) fp32, occurrences of the token in the row
    repetition_penalties: torch.Tensor | None  # (P,) fp32, the pair's row value
    frequency_penalties: torch.Tensor | None  # (P,) fp32
    presence_penalties: torch.Tensor | None  # (P,) fp32
    # -- min_new_tokens masking (None when nothing is blocked) --
    block_rows: torch.Tensor | None
    block_tokens: torch.Tensor | None
    # -- logit_bias, one entry per (row, token) (None when no row has one) --
    bias_rows: torch.Tensor | None = None  # (L,) int64
    bias_tokens: torch.Tensor | None = None  # (L,) int64
    bias_values: torch.Tensor | None = None  # (L,) fp32

    @property
    def raw_argmax(self) -> bool:
        """Whether every row's token is the argmax of its logits as they are: all rows greedy,
        nothing added, blocked or penalized."""
        return self.all_greedy and not self.need_penalties and self.block_rows is None and self.bias_rows is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[RowGenerator | None] | None,
        vocab_size: int,
        device: torch.device | str,
        eos_ids_to_block: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Gather one step's per-row parameters into tensors on ``device``.

        ``output_ids[i]``: tokens row i has generated so far (for penalties).
        ``generators[i]``: the row's generator (``make_generator``), or None to draw from torch's
        default CPU generator.
        ``eos_ids_to_block[i]``: tokens to forbid this step (row below min_new_tokens).
        """
        device = torch.device(device)
        b = len(params)
        if len(output_ids) != b:
            raise ValueError(f"output_ids has {len(output_ids)} rows, params has {b}")
        if generators is None:
            generators = [None] * b
        elif len(generators) != b:
            raise ValueError(f"generators has {len(generators)} rows, params has {b}")
        if eos_ids_to_block is not None and len(eos_ids_to_block) != b:
            raise ValueError(
                f"eos_ids_to_block has {len(eos_ids_to_block)} rows, params has {b}"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        is_greedy = [p.is_greedy for p in params]
        rows = [i for i in range(b) if not is_greedy[i]]
        all_greedy = not rows

        sample_rows = temperatures = top_ks = top_ps = min_ps = None
        need_temperature = need_top_k = need_top_p = need_min_p = False
        sort_width = vocab_size
        seeded: list[tuple[int, RowGenerator]] = []
        if rows:
            sp = [params[i] for i in rows]
            ks = [vocab_size if (p.top_k == -1 or p.top_k >= vocab_size) else p.top_k for p in sp]
            need_temperature = any(p.temperature != 1.0 for p in sp)
            need_top_k = any(k < vocab_size for k in ks)
            need_top_p = any(p.top_p < 1.0 for p in sp)
            need_min_p = any(p.min_p > 0.0 for p in sp)
            if need_top_k or need_top_p:
                # Every sampled row keeps at most max(k) tokens, so a partial top-k suffices.
                sort_width = max(ks)
            sample_rows = _tensor(rows, torch.int64, device)
            temperatures = _tensor([min(p.temperature, MAX_TEMPERATURE) for p in sp], torch.float32, device).unsqueeze(1)
            top_ks = _tensor(ks, torch.int64, device)
            top_ps = _tensor([p.top_p for p in sp], torch.float32, device)
            min_ps = _tensor([p.min_p for p in sp], torch.float32, device)
            seeded = [(pos, g) for pos, g in enumerate(generators[i] for i in rows) if g is not None]

        # Penalties: one entry per distinct (row, token) among generated tokens.
        pen_rows = [
            i
            for i, p in enumerate(params)
            if (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0)
            and len(output_ids[i]) > 0
        ]
        need_penalties = bool(pen_rows)
        penalty_rows = penalty_tokens = penalty_counts = None
        rep = freq = pres = None
        if need_penalties:
            keys: list[int] = []
            for i in pen_rows:
                base = i * vocab_size
                for t in output_ids[i]:
                    if not 0 <= t < vocab_size:
                        raise ValueError(
                            f"output token id {t} of row {i} is outside the vocab [0, {vocab_size})"
                        )
                    keys.append(base + t)
            # Built on the host (no device sync), then copied once.
            uniq, counts = torch.unique(torch.tensor(keys, dtype=torch.int64), return_counts=True)
            prow = uniq // vocab_size
            rp = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            fp = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
            pp = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
            penalty_rows = prow.to(device)
            penalty_tokens = (uniq % vocab_size).to(device)
            penalty_counts = counts.to(torch.float32).to(device)
            rep = rp[prow].to(device)
            freq = fp[prow].to(device)
            pres = pp[prow].to(device)

        block_rows = block_tokens = None
        if eos_ids_to_block is not None:
            br: list[int] = []
            bt: list[int] = []
            for i, toks in enumerate(eos_ids_to_block):
                for t in toks:
                    if not 0 <= t < vocab_size:
                        raise ValueError(
                            f"eos id {t} to block in row {i} is outside the vocab [0, {vocab_size})"
                        )
                    br.append(i)
                    bt.append(t)
            if br:
                block_rows = _tensor(br, torch.int64, device)
                block_tokens = _tensor(bt, torch.int64, device)

        bias_rows = bias_tokens = bias_values = None
        if any(p.logit_bias for p in params):
            lr: list[int] = []
            lt: list[int] = []
            lv: list[float] = []
            for i, p in enumerate(params):
                for t, bias in p.logit_bias:
                    if not 0 <= t < vocab_size:
                        raise ValueError(f"logit_bias token id {t} of row {i} is outside the vocab [0, {vocab_size})")
                    lr.append(i)
                    lt.append(t)
                    lv.append(bias)
            bias_rows = _tensor(lr, torch.int64, device)
            bias_tokens = _tensor(lt, torch.int64, device)
            bias_values = _tensor(lv, torch.float32, device)

        return cls(
            batch_size=b,
            vocab_size=vocab_size,
            device=device,
            is_greedy=is_greedy,
            all_greedy=all_greedy,
            sample_rows=sample_rows,
            temperatures=temperatures,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            need_temperature=need_temperature,
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
            sort_width=sort_width,
            seeded=seeded,
            need_penalties=need_penalties,
            penalty_rows=penalty_rows,
            penalty_tokens=penalty_tokens,
            penalty_counts=penalty_counts,
            repetition_penalties=rep,
            frequency_penalties=freq,
            presence_penalties=pres,
            block_rows=block_rows,
            block_tokens=block_tokens,
            bias_rows=bias_rows,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
        )


def apply_penalties_and_blocks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-3: fp32 logits after penalties, logit biases and min_new_tokens blocking.

    Never modifies ``logits``; returns it cast to fp32 (a new tensor if anything changed).
    """
    if not batch.need_penalties and batch.block_rows is None and batch.bias_rows is None:
        return logits.float()
    x = logits.to(torch.float32, copy=True)
    if batch.need_penalties:
        r, t, rp, counts, freq, pres = (batch.penalty_rows, batch.penalty_tokens, batch.repetition_penalties,
                                        batch.penalty_counts, batch.frequency_penalties, batch.presence_penalties)
        assert r is not None and t is not None and rp is not None and counts is not None
        assert freq is not None and pres is not None
        v = x[r, t]
        v = torch.where(v > 0, v / rp, v * rp)
        v = v - counts * freq - pres
        x[r, t] = v
    if batch.bias_rows is not None:
        assert batch.bias_tokens is not None and batch.bias_values is not None
        x[batch.bias_rows, batch.bias_tokens] += batch.bias_values  # (row, token) pairs are distinct
    if batch.block_rows is not None:
        x[batch.block_rows, batch.block_tokens] = _NEG_INF
    return x


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Make every row softmax-able without a host sync.

    A row whose max is +inf keeps only its +inf tokens; a row that is all -inf (everything
    masked) or has NaN becomes uniform. Finite rows are unchanged.
    """
    row_max = x.max(dim=-1, keepdim=True).values
    ok = torch.isfinite(row_max)
    fallback = torch.where(
        (x == row_max) | torch.isnan(row_max),
        torch.zeros((), dtype=x.dtype, device=x.device),
        torch.full((), _NEG_INF, dtype=x.dtype, device=x.device),
    )
    return torch.where(ok, x, fallback)


def _filtered_weights(
    x: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 4 before the draw, for the sampled rows ``x`` (S, V) of the penalized logits.

    Returns (weights, index): unnormalized probabilities with filtered tokens at 0, and, when
    they are in sorted order, the (S, W) vocab ids of each column (``index`` is None when the
    weights are already in vocab order).
    """
    temperatures, top_ks, top_ps, min_ps = batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps
    assert temperatures is not None and top_ks is not None and top_ps is not None and min_ps is not None
    x = _finite_rows(x)
    if batch.need_temperature:
        x = x / temperatures
    probs = torch.softmax(x, dim=-1)
    if not (batch.need_top_k or batch.need_top_p):
        if batch.need_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_ps.unsqueeze(1) * top, 0.0)
        return probs, None

    w = batch.sort_width
    if w < batch.vocab_size:
        vals, idx = probs.topk(w, dim=-1, largest=True, sorted=True)
    else:
        vals, idx = probs.sort(dim=-1, descending=True, stable=True)
    if batch.need_top_k:
        cols = torch.arange(vals.shape[1], device=vals.device)
        vals = vals.masked_fill(cols.unsqueeze(0) >= top_ks.unsqueeze(1), 0.0)
    if batch.need_top_p:
        cum = vals.cumsum(dim=-1)
        total = cum[:, -1:]
        before = torch.cat([torch.zeros_like(total), cum[:, :-1]], dim=1)
        # Rows with top_p == 1 skip the test: float saturation of the cumsum would otherwise
        # drop far-tail tokens.
        limit = torch.where(
            top_ps.unsqueeze(1) < 1.0,
            top_ps.unsqueeze(1) * total,
            torch.full_like(total, float("inf")),
        )
        vals = vals.masked_fill(before >= limit, 0.0)
    if batch.need_min_p:
        vals = vals.masked_fill(vals < min_ps.unsqueeze(1) * vals[:, :1], 0.0)
    return vals, idx


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The normalized (B, V) distribution each row samples from; one-hot for greedy rows.

    For tests and debugging; ``sample`` does not materialize this.
    """
    x = apply_penalties_and_blocks(logits, batch)
    out = torch.zeros_like(x)
    out.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    if batch.sample_rows is None:  # all greedy
        return out
    w, idx = _filtered_weights(x.index_select(0, batch.sample_rows), batch)
    if idx is not None:
        w = torch.zeros_like(x[: w.shape[0]]).scatter_(1, idx, w)
    out[batch.sample_rows] = w / w.sum(dim=-1, keepdim=True)
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a (B, V) tensor. On the CPU in fp32 through numpy, whose argmax is
    vectorized and many times faster than torch's over a vocabulary's logits (docs/machines.md).
    Both give the first index of the maximum (of a NaN, if any)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Draw one token per row of ``logits`` (B, V), fp32 or bf16: a (B,) int64 tensor on the
    logits' device. Queues device work only, no host sync."""
    if logits.dim() != 2 or logits.shape[0] != batch.batch_size:
        raise ValueError(
            f"logits must have shape ({batch.batch_size}, V), got {tuple(logits.shape)}"
        )
    if logits.shape[1] != batch.vocab_size:
        raise ValueError(
            f"logits have {logits.shape[1]} columns, the batch was built for {batch.vocab_size}"
        )
    if batch.raw_argmax:
        # Fast path: argmax is exact in the input dtype, no cast needed.
        return row_argmax(logits)
    x = apply_penalties_and_blocks(logits, batch)
    tokens = row_argmax(x)
    if not batch.all_greedy:
        _sample_rows(x, batch, tokens)
    return tokens


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    top_logprobs_num: int | Sequence[int] = 0,
    return_logprob: bool = False,
) -> SampleOutput:
    """``sample_tokens``, then the tokens (and logprobs) on the host.

    ``top_logprobs_num`` may be one int for all rows or one per row; ``top_logprobs[i]`` is
    sorted by descending logprob. Logprobs come from the raw logits (see module docstring).
    """
    tokens = sample_tokens(logits, batch)
    return with_logprobs(logits, tokens.tolist(), tokens, top_logprobs_num, return_logprob)


def _uniforms(batch: SamplingBatch, n: int) -> torch.Tensor:
    """One uniform draw in [0, 1) per sampled row, on the batch's device, without a device sync:
    from the row's own generator, or torch's default CPU generator for rows without one."""
    u = torch.rand(n, dtype=torch.float64)
    for pos, gen in batch.seeded:
        u[pos] = gen.random()
    if batch.device.type == "cuda":
        return u.pin_memory().to(batch.device, non_blocking=True)
    return u.to(batch.device)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index whose cumulative weight first exceeds ``u * sum(w)``: index i with
    probability ``w_i / sum(w)``. A draw that rounding puts past the last positive weight takes
    the row's top token, so a zero-weight (filtered) token is never picked."""
    cum = w.cumsum(dim=-1)
    target = (u.to(cum.dtype).unsqueeze(1) * cum[:, -1:]).contiguous()
    pick = torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=w.shape[1] - 1)
    ok = w.gather(1, pick.unsqueeze(1)).squeeze(1) > 0
    return torch.where(ok, pick, w.argmax(dim=-1))


def _sample_rows(x: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor) -> None:
    """Overwrite ``tokens`` at the sampled rows with their draws."""
    rows = batch.sample_rows
    assert rows is not None
    weights, idx = _filtered_weights(x.index_select(0, rows), batch)
    if idx is not None:
        # back to vocabulary order, so a row's draw does not depend on its batch's sort width
        weights = torch.zeros(weights.shape[0], batch.vocab_size, dtype=weights.dtype,
                              device=weights.device).scatter_(1, idx, weights)
    picked = _inverse_cdf(weights, _uniforms(batch, weights.shape[0]))
    tokens.index_copy_(0, rows, picked)


def with_logprobs(
    logits: torch.Tensor,
    token_ids: list[int],
    tokens: torch.Tensor,
    top_logprobs_num: int | Sequence[int],
    return_logprob: bool,
) -> SampleOutput:
    b, v = logits.shape
    if isinstance(top_logprobs_num, int):
        nums = [top_logprobs_num] * b
    else:
        nums = list(top_logprobs_num)
        if len(nums) != b:
            raise ValueError(f"top_logprobs_num has {len(nums)} entries for {b} rows")
    if any(n < 0 for n in nums):
        raise ValueError(f"top_logprobs_num must be >= 0, got {nums}")
    k = min(max(nums, default=0), v)
    if not return_logprob and k == 0:
        return SampleOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)

    lp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = None
    if return_logprob:
        logprobs = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top = None
    if k > 0:
        vals, ids = lp.topk(k, dim=-1, largest=True, sorted=True)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        top = [
            list(zip(ids_l[i][: nums[i]], vals_l[i][: nums[i]])) for i in range(b)
        ]
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)


def token_logprobs(logits: torch.Tensor, targets: Sequence[int]) -> list[float]:
    """Logprob of ``targets[i]`` under row i of ``logits`` (raw, fp32): prompt-token logprobs."""
    rows = logits[: len(targets)]
    lp = torch.log_softmax(rows.float(), dim=-1)
    picked: list[float] = lp[torch.arange(len(targets)), torch.tensor(list(targets))].tolist()
    return picked
