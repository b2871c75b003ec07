"""Tensor parallelism over gloo on the CPU: TP=2 and TP=4 (dummy:llama-tiny, 8 heads over 2 KV
heads, so TP=4 replicates KV heads) and TP=3 on the default model (9 heads over 3 KV heads) give
TP=1's greedy tokens and its logits within fp32 / bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.engine import Engine

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fib(n):",
           "The capital of France is a city of"]  # shares a cached prefix with the first
GREEDY = {"max_new_tokens": 12, "temperature": 0}
# Small chunks: prompts run as several extend steps over their cached prefix, batched with decodes.
OPTS = {"max_total_tokens": 2048, "context_length": 1536, "chunked_prefill_size": 8, "max_running_requests": 8}
LAST = 16


def step_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The last LAST positions' logits of `ids` as one prefill in a fresh row, through every
    rank (over 1,000 tokens: the step's description takes a second broadcast)."""
    runner = engine.core.runner
    seq = SeqStep(0, 0, ids, list(range(1, len(ids) + 1)), len(ids) - LAST, prefix_slots=[])
    return runner.forward([seq]).clone()


def run(model: str, dtype: str, tp: int, ids: list[int], **opts: object) -> tuple[list[list[int]], torch.Tensor]:
    threads = torch.get_num_threads()
    with Engine(model, dtype=dtype, tp_size=tp, **OPTS, **opts) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert (engine.core.ahead_steps > 0) == bool(opts.get("overlap_schedule"))
        logits = step_logits(engine, ids)
        procs = engine.core.workers.procs if engine.core.workers else []
    assert all(p.returncode == 0 for p in procs)  # shutdown stops every worker cleanly
    # rank 0 took its share of the cores while the workers ran; the process has its threads back
    assert torch.get_num_threads() == threads
    return [o["output_ids"] for o in outs], logits


@pytest.fixture(scope="module")
def ids(smol_tokenizer) -> list[int]:
    ids = smol_tokenizer.encode("Tensor parallelism splits every layer over the ranks, one shard each. ")
    return (ids * 100)[:1100]


@pytest.fixture(scope="module")
def tiny_tp1(ids):
    return run("dummy:llama-tiny", "float32", 1, ids)


@pytest.mark.parametrize(("tp", "overlap"), [(2, True), (4, False)])
def test_dummy_model_tp_matches_tp1(tp, overlap, ids, tiny_tp1):
    """With the overlap schedule, decode steps reach the workers with their tokens still on
    rank 0's device (sent over the device group)."""
    tokens, logits = run("dummy:llama-tiny", "float32", tp, ids, overlap_schedule=overlap)
    ref_tokens, ref_logits = tiny_tp1
    assert tokens == ref_tokens
    assert logits.shape == ref_logits.shape == (LAST, 49152)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_dummy_model_tp2_bf16_logits_within_tolerance(ids, tiny_tp1):
    _, logits = run("dummy:llama-tiny", "bfloat16", 2, ids)
    _, ref = run("dummy:llama-tiny", "bfloat16", 1, ids)
    # bf16 rounds each partial sum of the row-parallel layers before the all-reduce
    torch.testing.assert_close(logits, ref, rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits, tiny_tp1[1], rtol=0.1, atol=0.1)  # and near fp32


@pytest.mark.slow
def test_default_model_tp3_matches_tp1(ids):
    tokens, logits = run("smollm2-135m-instruct", "float32", 3, ids)
    ref_tokens, ref_logits = run("smollm2-135m-instruct", "float32", 1, ids)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize(("family", "tp"), [("llama", 2), ("qwen2", 4)])
def test_checkpoint_shards_match_hf(family, tp, tmp_path, default_source):
    """A safetensors checkpoint cut while loading: an untied head over an odd vocabulary (97 rows:
    zero padding on the last rank) at TP=2; Qwen2's q/k/v biases with KV heads replicated at TP=4.
    The gathered logits equal HF transformers' on the same weights."""
    import transformers

    tiny = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg = (transformers.LlamaConfig(**tiny, tie_word_embeddings=False) if family == "llama"
           else transformers.Qwen2Config(**tiny, tie_word_embeddings=True))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a dropped or misplaced piece shows
        for n, p in hf.named_parameters():
            if n.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with Engine(str(tmp_path), dtype="float32", tp_size=tp, tokenizer_path=str(default_source.tokenizer_dir),
                max_total_tokens=512, context_length=256) as engine:
        seq = SeqStep(0, 0, ids[0].tolist(), list(range(1, 25)), 0, prefix_slots=[])
        logits = engine.core.runner.forward([seq])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    assert logits.shape == ref.shape == (24, 97)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
