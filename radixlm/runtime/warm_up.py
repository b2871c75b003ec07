"""Start-up, the engine's first phase: requests that run every kind of step the engine's
requests will (so none of them pays for a kernel's first compile), and on CUDA the probe that
measures what a jump over forced text costs (JumpPolicy)."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Protocol

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.intake import Submission
from radixlm.runtime.model.source import ModelSource
from radixlm.runtime.output_processor import OutputProcessor, RequestOutput
from radixlm.runtime.sampling_params import SamplingParams


class WarmedEngine(Protocol):
    """What start-up reads and drives of an engine (EngineCore is one)."""

    config: EngineConfig
    source: ModelSource
    device: torch.device
    context_length: int
    output: OutputProcessor

    @property
    def has_work(self) -> bool: ...

    def add_request(self, sub: Submission) -> None: ...

    def step(self) -> list[RequestOutput]: ...

log = logging.getLogger("radixlm.engine")

# Prompt lengths of the start-up requests on CUDA, one wave (one batch) per list: each wave's
# prefill and decode steps hit other kernel shapes (1 row: GEMV; 2-32 rows: the few-row kernel,
# specialized on rows % 16; more: cuBLAS; the extend attention at several lengths).
_WARM_UP_GREEDY = SamplingParams(max_new_tokens=3, temperature=0)
_WARM_UP_SAMPLED = SamplingParams(max_new_tokens=3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
# The jump-cost probe: requests of a jump's size (a few tokens extended, then decoded), timed alone.
_JUMP_PROBES, _JUMP_PROBE_TOKENS = 3, 8
_JUMP_PROBE_PARAMS = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
_WARM_UP_WAVES = [[1], [5], [16], [17], [40], [512], [3, 9], [4] * 16, [4] * 17, [6] * 40]


def run_warm_up(core: WarmedEngine) -> None:
    """On CUDA (decode graphs were captured at load): prefills of 1, a few (the few-row kernel),
    16 and many tokens, alone and batched; eager and graph decode batches; greedy and sampled
    rows. On the CPU there is nothing to compile: one short request."""
    bos = core.source.arch.bos_token_id or 1
    waves = _WARM_UP_WAVES if core.device.type == "cuda" else [[4]]
    cap = max(8, min(core.context_length // 2, core.config.scheduler.chunked_prefill_size or 512))
    for w, lengths in enumerate(waves):
        for i, n in enumerate(lengths):
            params = _WARM_UP_SAMPLED if i % 2 else _WARM_UP_GREEDY
            core.add_request(Submission(f"warm-up-{w}-{i}", [bos] * min(n, cap), params))
        while core.has_work:
            core.step()


def measure_jump_cost(core: WarmedEngine, max_running: int | None) -> JumpPolicy:
    """What a jump costs here (JumpPolicy): one request alone, timed step by step with its
    host work, whose first step extends a few tokens (as a jump does) and whose later steps
    decode one; the cheapest of a few tries. CUDA only (it synchronizes the device)."""
    vocab = core.source.arch.vocab_size
    extend, decode = [], []
    for k in range(_JUMP_PROBES):
        prompt = [(1000 + 97 * (k * _JUMP_PROBE_TOKENS + j)) % vocab for j in range(_JUMP_PROBE_TOKENS)]
        core.add_request(Submission(f"warm-up-jump-{k}", prompt, _JUMP_PROBE_PARAMS))
        times = []
        while core.has_work:
            t0 = time.perf_counter()
            core.step()
            torch.cuda.synchronize(core.device)
            times.append(time.perf_counter() - t0)
        extend.append(times[0])
        decode.extend(times[1:-1])  # (the last step only processes the one before)
    if not decode:  # (a context too short for the probe's decode steps: keep the cautious default)
        return core.output.jump_policy
    decode_s = statistics.median(decode)
    policy = JumpPolicy(decode_s, max(0.0, min(extend) - decode_s), max_running)
    log.info("jump-forward: an extend step costs %.2f ms more than a %.2f ms decode step: a jump must add "
             ">= %d forced tokens per running request", 1e3 * policy.penalty_s, 1e3 * decode_s,
             policy.min_gain(1) or 0)
    return policy
