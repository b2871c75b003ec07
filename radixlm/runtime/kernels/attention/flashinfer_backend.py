"""Attention backend `flashinfer`: flashinfer's paged-KV kernels over the KV slot pool (CUDA, fp16/bf16).

The pool is used as a paged KV cache with page_size 1: a slot is a page, a layer's K (and V)
buffer [slots, kv_heads, d] is viewed as [pages, 1, kv_heads, d] (NHD), and a sequence's page
list is its row of req_to_token up to kv_len. So kv_indptr is the running sum of kv_lens, every
last page holds one token, and kv_indices is req_to_token gathered on the device.

- A batch of decodes only (q_len 1 everywhere) runs flashinfer's batch decode wrapper: the CUDA-core
  decode kernel for GQA groups of 1-4, the tensor-core path (flashinfer's prefill kernel) for
  larger groups, and for group sizes the decode kernel has no instance for (e.g. 7).
- Any other batch (extends, or extends mixed with decodes) runs the paged prefill wrapper, causal
  with the diagonal at the end of each sequence (a decode row sees its whole context).
The new tokens' K/V are written into the pool first (as every backend does); attention then
reads the whole context from the pool.

Host work per forward is one plan() of one wrapper, from host-side indptrs (built from the
step's lists, no device sync); the page indices are built on the device. flashinfer's plan
stages its schedule in a pinned host buffer and copies it to the device asynchronously, so a
wrapper must not be re-planned before that copy ran: two wrapper sets alternate, and a set
waits for the event recorded after its previous plan (the GPU has long passed it unless the
host runs two steps ahead).

No CUDA graphs (no `bind_decode`): flashinfer's graph mode needs a host plan() before every
replay, which DecodeGraphs does not call; the runner keeps flashinfer steps eager.
flashinfer's kernels take fp16/bf16 only, so a float32 pool is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from radixlm.runtime.kernels.attention.base import AttentionMeta

if TYPE_CHECKING:
    from radixlm.runtime.kv_pool import KVPool

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-KV scratch; shared by all wrappers
DECODE_KERNEL_GROUPS = (1, 2, 3, 4)  # groups run on the CUDA-core decode kernel; others on tensor cores


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:  # not installed, or installed without its dependencies
        raise ValueError(
            "the flashinfer attention backend needs the flashinfer-python package (and its "
            "apache-tvm-ffi and nvidia-ml-py dependencies, plus nvcc for its JIT builds): "
            f"pip install flashinfer-python, or use --attention-backend triton ({e})"
        ) from e
    return flashinfer


class _WrapperSet:
    """One decode and one prefill wrapper, planned together for one forward at a time."""

    def __init__(self, flashinfer: Any, workspace: torch.Tensor, tensor_core_decode: bool) -> None:
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_core_decode, backend="fa2")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self.planned: torch.cuda.Event | None = None


class FlashInferAttention:
    """Attention backend `flashinfer`: batch decode / paged prefill wrappers over the KV pool."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        flashinfer = _import_flashinfer()
        device = pool.k.device
        if device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device; use --attention-backend torch")
        if pool.k.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flashinfer attention runs fp16/bf16 only, the KV pool is {pool.k.dtype}: "
                             "use --dtype bfloat16, or --attention-backend triton")
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.kv_heads = pool.k.shape[2]
        self.dtype = pool.k.dtype
        self.scale = head_dim**-0.5
        group = num_heads // self.kv_heads
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._sets = [_WrapperSet(flashinfer, workspace, group not in DECODE_KERNEL_GROUPS) for _ in range(2)]
        self._turn = 0
        self._run: Callable[..., Any] | None = None  # the planned wrapper's run, for this forward
        self.out_slots: torch.Tensor | None = None
        self.device = device

    def prepare(self, meta: AttentionMeta) -> None:
        n = meta.num_seqs
        qo_indptr = [0]
        kv_indptr = [0]
        for i in range(n):
            if meta.q_starts[i] != qo_indptr[-1]:
                raise ValueError("flashinfer attention needs each sequence's tokens contiguous and in sequence order")
            qo_indptr.append(qo_indptr[-1] + meta.q_lens[i])
            kv_indptr.append(kv_indptr[-1] + meta.kv_lens[i])
        total = kv_indptr[-1]
        # one H2D copy: rows, kv lengths, kv indptr (host copies of the indptrs go to plan())
        host = torch.tensor([*meta.rows, *meta.kv_lens, *kv_indptr], dtype=torch.int64).pin_memory()
        dev = host.to(self.device, non_blocking=True)
        rows, kv_lens, starts = dev[:n], dev[n:2 * n], dev[2 * n:3 * n]
        seq = torch.repeat_interleave(torch.arange(n, device=self.device), kv_lens, output_size=total)
        pos = torch.arange(total, device=self.device) - starts[seq]
        kv_indices = meta.req_to_token[rows[seq], pos].to(torch.int32)
        kv_indptr_h = torch.tensor(kv_indptr, dtype=torch.int32).pin_memory()
        last_page_len_h = torch.ones(n, dtype=torch.int32).pin_memory()

        wrappers = self._sets[self._turn]
        self._turn ^= 1
        if wrappers.planned is not None:  # its previous plan's staged copy must have run
            wrappers.planned.synchronize()
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        if all(q == 1 for q in meta.q_lens):
            wrappers.decode.plan(kv_indptr_h, kv_indices, last_page_len_h, self.num_heads, self.kv_heads,
                                 self.head_dim, 1, **common)
            self._run = wrappers.decode.run
        else:
            qo_indptr_h = torch.tensor(qo_indptr, dtype=torch.int32).pin_memory()
            wrappers.prefill.plan(qo_indptr_h, kv_indptr_h, kv_indices, last_page_len_h, self.num_heads,
                                  self.kv_heads, self.head_dim, 1, causal=True, **common)
            self._run = wrappers.prefill.run
        wrappers.planned = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__new__ untyped
        wrappers.planned.record()
        self.out_slots = meta.out_slots

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._run is not None and self.out_slots is not None, "prepare() first"
        self.pool.write(layer, self.out_slots, k, v)
        # [slots, kv_heads, d] -> [pages, page_size 1, kv_heads, d]
        kv = (self.pool.k[layer].unsqueeze(1), self.pool.v[layer].unsqueeze(1))
        q = q.contiguous()  # a no-op unless RoPE left a strided view of the fused qkv
        out = torch.empty_like(q)
        self._run(q, kv, out=out)
        return out.view(q.shape[0], -1)
