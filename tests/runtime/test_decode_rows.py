"""A step of few new tokens per sequence as decode rows (radixlm.runtime.cuda_graph.decode_rows):
the layout the CUDA graphs replay, and, on the CPU, that decode rows of one sequence give the
logits of the extend step they stand for (the GPU side: tests/runtime/gpu/test_gpu_backends.py)."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.cuda_graph import GRAPH_EXTEND_TOKENS, decode_rows
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import DUMMY_CONFIGS
from radixlm.runtime.model_runner import ModelRunner


def test_rows_of_a_mixed_step():
    seqs = [
        SeqStep(row=0, cached_len=10, token_ids=[5], slots=[100], logit_start=0),  # a decode
        SeqStep(row=3, cached_len=7, token_ids=[6, 7, 8], slots=[200, 201, 202], logit_start=2),  # a jump
        SeqStep(row=1, cached_len=2, token_ids=[9, 4], slots=[300, 301], logit_start=0, prefix_slots=[1, 2]),
    ]
    step = decode_rows(seqs, max_rows=8)
    assert step is not None
    assert step.ids == [5, 6, 7, 8, 9, 4]
    assert step.positions == [10, 7, 8, 9, 2, 3]
    assert step.kv_lens == [11, 8, 9, 10, 3, 4]
    assert step.slots == [100, 200, 201, 202, 300, 301]
    assert step.rows == [0, 3, 3, 3, 1, 1]
    assert step.logit_rows == [0, 3, 4, 5]


def test_every_row_wanted_and_a_chunk_with_no_logits():
    decodes = [SeqStep(row=i, cached_len=4, token_ids=[1], slots=[i], logit_start=0) for i in range(3)]
    step = decode_rows(decodes, max_rows=4)
    assert step is not None and step.logit_rows is None
    chunk = SeqStep(row=0, cached_len=0, token_ids=[1, 2], slots=[1, 2], logit_start=2)  # a middle prefill chunk
    step = decode_rows([chunk], max_rows=4)
    assert step is not None and step.logit_rows == []


def test_steps_the_graphs_cannot_run():
    decodes = [SeqStep(row=i, cached_len=4, token_ids=[1], slots=[i], logit_start=0) for i in range(5)]
    assert decode_rows(decodes, max_rows=4) is None  # more rows than the largest graph
    n = GRAPH_EXTEND_TOKENS + 1
    long = SeqStep(row=0, cached_len=0, token_ids=[1] * n, slots=list(range(1, n + 1)), logit_start=n - 1)
    assert decode_rows([long], max_rows=256) is None  # each row would read the sequence's KV again


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b"])
def test_decode_rows_give_the_extend_steps_logits(name):
    """The runner's eager path on the CPU (torch attention): a prompt, then an extend of 5 tokens
    next to another sequence's decode, against the same 5 tokens as 5 one-token rows of the same
    request row in one step."""
    cfg = dict(DUMMY_CONFIGS[name], num_hidden_layers=2, vocab_size=512, intermediate_size=256)
    arch = ModelArch.from_hf_config(cfg, source=name)
    model = build_model(arch, None, torch.float32, "cpu", max_positions=256, seed=0)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, 512, (n,), generator=gen).tolist() for n in (20, 12))

    def run(as_rows: bool) -> torch.Tensor:
        runner = ModelRunner(model, num_slots=64, max_requests=2, max_context=256)
        runner.forward([SeqStep(0, 0, a[:15], list(range(1, 16)), 14, []),
                        SeqStep(1, 0, b[:11], list(range(30, 41)), 10, [])])
        decode = SeqStep(1, 11, [b[11]], [41], 0)
        if not as_rows:
            return runner.forward([SeqStep(0, 15, a[15:], list(range(16, 21)), 0), decode])
        rows = [SeqStep(0, 15 + i, [a[15 + i]], [16 + i], 0) for i in range(5)]
        return runner.forward(rows + [decode])

    extend, rows = run(False), run(True)
    assert extend.shape == rows.shape == (6, 512)
    torch.testing.assert_close(rows, extend, rtol=1e-4, atol=1e-4)
