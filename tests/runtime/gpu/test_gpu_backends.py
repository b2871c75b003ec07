"""On CUDA: the triton backend against the torch reference (attention and model logits on
ragged batches with cached prefixes, GQA and long contexts), the fused kernels against plain
PyTorch, the whole GPU path against the CPU model, greedy outputs equal across backends, and
CUDA-graph decode equal to eager decode."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from triton_cases import compare, fused_errors, store_kv_matches, tiny_arch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.cuda_graph import GRAPH_EXTEND_ROWS
from radixlm.runtime.engine import Engine
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import DUMMY_CONFIGS
from radixlm.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # relative L2 error of bf16 attention against the bf16 torch reference
LOGITS_TOL = 3e-2  # the same for the logits of a 2-layer model


@pytest.mark.parametrize(("shape", "seqs"), [
    ((32, 8, 128), [(0, 1), (37, 1), (500, 1), (8000, 1), (3, 1)]),  # Llama-3-8B heads, decode, long
    ((32, 8, 128), [(0, 700), (1000, 300), (4000, 129), (0, 1), (2000, 1)]),  # extend + decode
    ((14, 2, 64), [(0, 333), (777, 65), (12, 1), (6000, 1)]),  # Qwen2.5-0.5B heads (group 7)
    ((9, 3, 64), [(0, 2048), (100, 1)]),  # SmolLM2-135M heads (group 3)
])
def test_triton_attention_matches_torch(shape, seqs):
    err = compare("triton", tiny_arch(*shape), seqs, torch.bfloat16, "cuda", seed=len(seqs))
    assert err < BF16_TOL


def test_triton_attention_fp32_is_exact():
    err = compare("triton", tiny_arch(32, 8, 128), [(0, 300), (1500, 40), (900, 1), (0, 1)], torch.float32, "cuda", 7)
    assert err < 1e-5


@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (14, 2, 64)])
def test_fused_kernels_match_torch(shape):
    errs = fused_errors(tiny_arch(*shape), 300, torch.bfloat16, "cuda", seed=1)
    assert max(errs.values()) < 1e-2, errs
    assert store_kv_matches("cuda", torch.bfloat16, torch.Generator().manual_seed(2))


def _small(name: str) -> ModelArch:
    """A named dummy config cut to 2 layers and a small vocabulary (heads and rope kept)."""
    cfg = dict(DUMMY_CONFIGS[name], num_hidden_layers=2, vocab_size=2048, intermediate_size=1024)
    return ModelArch.from_hf_config(cfg, source=name)


class Schedule:
    """A fixed ragged schedule over teacher-forced token streams: chunked prefills (later chunks
    read a cached prefix), a sequence that starts on another's cached prefix, then decodes."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lens = [3100, 37, 1, 1300]
        self.tokens = [torch.randint(0, vocab, (n + 16,), generator=gen).tolist() for n in self.lens]
        self.tokens[3][:1200] = self.tokens[0][:1200]  # sequence 3 shares sequence 0's first 1200 tokens
        perm = (torch.randperm(8000, generator=gen) + 1).tolist()
        self.slots = [perm[0:3116], perm[3116:3169], perm[3169:3186], perm[0:1200] + perm[3186:3302]]
        self.first = {0: True, 1: True, 2: True, 3: True}

    def step(self, parts: list[tuple[int, int, int]]) -> list[SeqStep]:
        out = []
        for seq, start, end in parts:
            prefix = self.slots[seq][:start] if self.first[seq] else None
            self.first[seq] = False
            out.append(SeqStep(row=seq, cached_len=start, token_ids=self.tokens[seq][start:end],
                               slots=self.slots[seq][start:end], logit_start=end - start - 1, prefix_slots=prefix))
        return out

    def plan(self) -> list[list[tuple[int, int, int]]]:
        steps = [[(0, 0, 1500), (1, 0, 37), (2, 0, 1)],
                 [(1, 37, 38), (2, 1, 2), (0, 1500, 3100), (3, 1200, 1300)]]
        pos = [3100, 38, 2, 1300]
        for _ in range(4):  # decodes of all four (a bucket size)
            steps.append([(i, pos[i], pos[i] + 1) for i in range(4)])
            pos = [p + 1 for p in pos]
        for _ in range(3):  # three of them (padded to a bucket)
            steps.append([(i, pos[i], pos[i] + 1) for i in (0, 1, 3)])
            pos[0], pos[1], pos[3] = pos[0] + 1, pos[1] + 1, pos[3] + 1
        for _ in range(2):  # one sequence alone: the one-row path (GEMV kernels, fused norms)
            steps.append([(2, pos[2], pos[2] + 1)])
            pos[2] += 1
        return steps


def _run(arch: ModelArch, dtype: torch.dtype, backend: str, buckets: tuple[int, ...],
         model: LlamaModel | None = None) -> list[torch.Tensor]:
    model = model or build_model(arch, None, dtype, "cuda", max_positions=4096, seed=0)
    runner = ModelRunner(model, num_slots=8000, max_requests=4, max_context=4096,
                         attention_backend=backend, graph_buckets=buckets)
    sched = Schedule(arch.vocab_size)
    return [runner.forward(sched.step(parts)).clone().cpu() for parts in sched.plan()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-0.5b", "smollm2-135m"])
def test_model_logits_triton_vs_torch(name):
    arch = _small(name)
    ref = _run(arch, torch.bfloat16, "torch", ())
    for buckets in ((), (1, 2, 4)):
        got = _run(arch, torch.bfloat16, "triton", buckets)
        errs = [_rel(g, r) for g, r in zip(got, ref)]
        assert max(errs) < LOGITS_TOL, errs


def test_gpu_path_matches_cpu_model_fp32():
    """Fused kernels, triton attention and graphs on CUDA against the plain modules on CPU."""
    arch = _small("llama-3-8b")
    gpu_model = build_model(arch, None, torch.float32, "cuda", max_positions=4096, seed=0)
    cpu_model = build_model(arch, None, torch.float32, "cpu", max_positions=4096, seed=1)
    cpu_model.load_state_dict({k: v.cpu() for k, v in gpu_model.state_dict().items()})
    got = _run(arch, torch.float32, "triton", (1, 2, 4), gpu_model)
    model_cpu_runner = ModelRunner(cpu_model, num_slots=8000, max_requests=4, max_context=4096)
    sched = Schedule(arch.vocab_size)
    ref = [model_cpu_runner.forward(sched.step(parts)) for parts in sched.plan()]
    errs = [_rel(g, r) for g, r in zip(got, ref)]
    assert max(errs) < 1e-4, errs


def test_graph_decode_equals_eager():
    arch = _small("llama-3-8b")
    eager = _run(arch, torch.bfloat16, "triton", ())
    graph = _run(arch, torch.bfloat16, "triton", (1, 2, 4, 8))
    for i, (g, e) in enumerate(zip(graph, eager)):
        if i < 6 or i >= 9:  # prefills (eager in both) and decodes whose batch is exactly a bucket
            assert torch.equal(g, e), f"step {i}: {_rel(g, e):.2e}"
        else:  # batch of 3 padded to 4: the same kernels, matrix products of another height
            assert _rel(g, e) < 1e-2


def _short_extends(sched: Schedule) -> list[list[SeqStep]]:
    """After the plan's two prefill steps: jump-sized extends next to decodes, one alone, and
    one that asks for every new token's logits (input logprobs)."""
    plan = sched.plan()[:2] + [[(0, 3100, 3105), (1, 38, 39), (2, 2, 14), (3, 1300, 1303)], [(2, 14, 16)]]
    steps = [sched.step(parts) for parts in plan]
    steps.append([replace(s, logit_start=0) for s in sched.step([(1, 39, 47)])])
    return steps


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_short_extends_in_graphs_equal_eager(dtype, tol):
    """Steps of few new tokens per sequence run in the decode graphs, a row per token
    (cuda_graph.decode_rows), and give the eager extend kernel's logits."""
    arch = _small("llama-3-8b")
    model = build_model(arch, None, dtype, "cuda", max_positions=4096, seed=0)
    out = {}
    for buckets in ((), (1, 2, 4, 8, 16, 24, 32)):
        runner = ModelRunner(model, num_slots=8000, max_requests=4, max_context=4096,
                             attention_backend="triton", graph_buckets=buckets)
        out[buckets] = [runner.forward(seqs).clone().cpu() for seqs in _short_extends(Schedule(arch.vocab_size))]
        assert runner.graph_steps == (3 if buckets else 0)  # the two prefills run eager
    eager, graph = out.values()
    assert [g.shape[0] for g in graph] == [3, 4, 4, 1, 8]
    errs = [_rel(g, e) for g, e in zip(graph, eager)]
    assert max(errs) < tol, errs


def _prompts(lengths: list[int], shared: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 49152, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def _greedy(tokenizer_dir: str, prompts: list[list[int]], dtype: str, backend: str,
            disable_graph: bool, overlap: bool = True, max_new: int | list[int] = 64) -> list[list[int]]:
    engine = Engine("dummy:smollm2-135m", device="cuda", dtype=dtype, tokenizer_path=tokenizer_dir,
                    attention_backend=backend, disable_cuda_graph=disable_graph, max_total_tokens=20000,
                    max_running_requests=16, chunked_prefill_size=256, overlap_schedule=overlap)
    lengths = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lengths]
    if backend == "triton" and not disable_graph:  # a full batch of decodes and room for short extends
        assert engine.core.runner.graphs is not None and engine.core.runner.graphs.max_bs == 16 + GRAPH_EXTEND_ROWS
    out = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.core.check_idle_integrity()
    engine.shutdown()
    return out


def test_greedy_outputs_equal_across_backends(tokenizer_dir):
    """Ragged prompts sharing a cached prefix, chunked prefill mixed with decodes; fp32, so that
    near-ties between random-weight logits cannot flip on rounding."""
    prompts = _prompts([1, 17, 400, 5, 90, 2, 33, 8], 300, seed=3) + _prompts([1000], 0, seed=4)
    ref = _greedy(tokenizer_dir, prompts, "float32", "torch", True)
    assert all(len(o) == 64 for o in ref)
    assert _greedy(tokenizer_dir, prompts, "float32", "triton", True) == ref
    assert _greedy(tokenizer_dir, prompts, "float32", "triton", False) == ref


def test_greedy_graph_equals_eager_bf16(tokenizer_dir):
    """Eight equal prompts: one prefill step, then every decode step is a batch of 8, a bucket."""
    prompts = _prompts([40] * 8, 0, seed=5)
    graph = _greedy(tokenizer_dir, prompts, "bfloat16", "triton", False)
    assert graph == _greedy(tokenizer_dir, prompts, "bfloat16", "triton", True)


def test_greedy_overlap_equals_plain_loop(tokenizer_dir):
    """Decode steps queued ahead of the host (the CUDA default) give the plain loop's outputs;
    requests of different lengths leave the batch at different steps, the last ones alone (bs1)."""
    prompts = _prompts([3, 50, 7, 120, 1, 64], 40, seed=6)
    lengths = [5, 64, 17, 33, 2, 48]
    plain = _greedy(tokenizer_dir, prompts, "bfloat16", "triton", False, overlap=False, max_new=lengths)
    assert [len(o) for o in plain] == lengths
    assert _greedy(tokenizer_dir, prompts, "bfloat16", "triton", False, overlap=True, max_new=lengths) == plain
    assert _greedy(tokenizer_dir, prompts, "float32", "triton", True, overlap=True, max_new=lengths) == \
        _greedy(tokenizer_dir, prompts, "float32", "triton", True, overlap=False, max_new=lengths)


def _sampled(tokenizer_dir: str, prompts: list[list[int]], overlap: bool, max_new: list[int]) -> list[list[int]]:
    """Seeded sampled requests (temperature, top-k, top-p, min-p), bf16 with graphs."""
    engine = Engine("dummy:smollm2-135m", device="cuda", dtype="bfloat16", tokenizer_path=tokenizer_dir,
                    attention_backend="triton", disable_cuda_graph=False, max_total_tokens=20000,
                    max_running_requests=16, chunked_prefill_size=256, overlap_schedule=overlap)
    filters = [{"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 20, "top_p": 0.95}, {}, {"top_p": 0.8}]
    params = [{"max_new_tokens": n, "temperature": 0.8, "seed": 100 + i, "ignore_eos": True, **filters[i % len(filters)]}
              for i, n in enumerate(max_new)]
    out = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    engine.core.check_idle_integrity()
    engine.shutdown()
    return out


def test_sampled_overlap_equals_plain_loop(tokenizer_dir):
    """Seeded sampled decode steps queued ahead of the host draw the plain loop's tokens: each
    request's generator is stepped once per step, in order; requests leave at different steps."""
    prompts = _prompts([3, 50, 7, 120, 1, 64], 40, seed=7)
    lengths = [5, 64, 17, 33, 2, 48]
    plain = _sampled(tokenizer_dir, prompts, overlap=False, max_new=lengths)
    assert [len(o) for o in plain] == lengths
    assert _sampled(tokenizer_dir, prompts, overlap=True, max_new=lengths) == plain


_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
           "required": ["name", "age"]}


def _constrained(tokenizer_dir: str, prompts: list[list[int]], overlap: bool, sampled: bool) -> list[list[int]]:
    """A mixed batch: two JSON schemas, a regex, choices (jump-forward on and off) and free rows.
    Both loops get the same jump cap (by default the overlap loop on CUDA jumps only while one
    request runs and the plain loop at any batch size, so they would jump at different points);
    the grammars are compiled before the batch, so all its requests start together whatever the
    compile times; fp32, since bf16 rounds differently with the batch's composition (a step queued
    ahead holds rows of requests that finished or jumped meanwhile), which flipped a token now and
    then."""
    engine = Engine("dummy:smollm2-135m", device="cuda", dtype="float32", tokenizer_path=tokenizer_dir,
                    attention_backend="triton", disable_cuda_graph=False, max_total_tokens=20000,
                    max_running_requests=16, chunked_prefill_size=256, overlap_schedule=overlap,
                    jump_forward_max_running=16)
    t = {"temperature": 0.8, "top_p": 0.95} if sampled else {"temperature": 0}
    kinds = [{"json_schema": _PERSON}, {"json_schema": _PERSON, "jump_forward": False},
             {"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
             {"regex": r"[0-9]{4}-[0-9]{2}"}, {"choices": ["alpha beta", "gamma"]}, {"ignore_eos": True}]
    params = [{**t, "seed": 10 + i, "max_new_tokens": 32, **kinds[i % len(kinds)]} for i in range(len(prompts))]
    engine.generate(input_ids=prompts, sampling_params=[{**p, "max_new_tokens": 1} for p in params])  # compiles
    out = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    assert overlap is False or engine.core.ahead_steps > 0
    engine.core.check_idle_integrity()
    engine.shutdown()
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_constrained_overlap_equals_plain_loop(tokenizer_dir, sampled):
    """Constrained rows queued ahead (their masks filled while the forward runs; rows that jumped
    forward dropped and rescheduled) give the plain loop's outputs, on the GPU with graphs."""
    prompts = _prompts([3, 50, 7, 120, 1, 64, 9, 30], 40, seed=8)
    plain = _constrained(tokenizer_dir, prompts, overlap=False, sampled=sampled)
    assert _constrained(tokenizer_dir, prompts, overlap=True, sampled=sampled) == plain
