"""The Llama-family transformer (Llama 2/3, Qwen2, Mistral, SmolLM2) over a ragged token batch.

Tokens of all sequences in a step are flattened into one [T, hidden] batch; attention is the
only part that needs to know where sequences begin and end, and the backend holds that.
On CUDA, RMSNorm (with the residual add), RoPE and SiLU*up run as fused triton kernels
(radixlm.runtime.kernels.fused); a step of at most 32 tokens runs each layer's linear layers as
triton few-row kernels with the residual adds folded in, and at one token the norms and SiLU*up
too (radixlm.runtime.kernels.gemv); elsewhere the plain PyTorch below, which the CPU runs as one
loop over the layers' bound modules (`LlamaModel._forward_host`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.distributed.layers import RowParallelLinear, VocabParallelEmbedding, gather_logits
from radixlm.runtime.distributed.sharding import ShardPlan
from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.kernels.attention import AttentionBackend
from radixlm.runtime.kernels.attention.torch_backend import TorchAttention
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.dense_linear import DenseLinear
from radixlm.runtime.model.fused_decode import FusedDecode, LayerParts
from radixlm.runtime.model.quant_linear import NativeBlockLinear, WeightOnlyLinear
from radixlm.runtime.model.rope import RotaryBatch, RotaryEmbedding

PAIRED_NORM = (torch.bfloat16, torch.float32)  # dtypes whose CPU RMSNorm runs as LayerNorm over [x, -x]


def host_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm off CUDA: normalise in fp32, scale in the model dtype (HF's order).

    In bf16 and fp32 the norm is LayerNorm's fused kernel over [x, -x]: that row's mean is zero
    and its variance is mean(x^2), so its first half is x / sqrt(mean(x^2) + eps), computed in
    fp32 (and rounded once to bf16, as HF's RMSNorm rounds it): one fused op where `F.rms_norm`
    runs as six separate ones on the CPU, 61 calls a step in the default model (docs/machines.md).
    In bf16 the results equal HF's formula except a few elements in 10^5 (at most 1 in 10^3), each
    one bf16 step apart; in fp32 they are within a few fp32 steps of it: the kernel's fp32 mean and
    variance round differently (tests/runtime/model/test_host_rms_norm.py). fp32 rows go to the
    native kernels where they run (`native.rms_norm`: one pass a row, the rows split between
    threads; docs/machines.md)."""
    if _native_norm(x, weight):
        return native.rms_norm(x, weight, eps)
    if x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and weight.dtype == torch.float32):
        n = x.shape[-1]
        return weight * torch.layer_norm(torch.cat([x, x.neg()], -1), (2 * n,), None, None, eps)[..., :n]
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def host_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection [..., 2 * I] off CUDA: fp32 rows on the
    native kernels where they run (one pass instead of two ops: docs/machines.md), else two torch
    ops on the halves (slices: fewer ops than chunk)."""
    inter = gate_up.shape[-1] // 2
    if (gate_up.dtype == torch.float32 and gate_up.dim() == 2 and inter % 16 == 0 and gate_up.is_contiguous()
            and native.available()):
        return native.swiglu(gate_up)
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


def _native_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `native.rms_norm` takes this norm: fp32 [rows, K] rows (K a multiple of 16) and
    weight, contiguous, where the native kernels run."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2 and x.shape[-1] % 16 == 0
            and x.is_contiguous() and weight.is_contiguous() and native.available())


class HostStream:
    """The CPU layer loop's residual stream [rows, hidden], and its norms. In bf16 (and fp32 where
    the native RMSNorm does not run) it is the first half of a [rows, 2 * hidden] buffer whose
    second half takes its negation before each norm, so `host_rms_norm`'s LayerNorm over [x, -x]
    runs on the buffer itself instead of a concatenated copy: an op fewer a norm (61 a step in the
    default model), the same values."""

    def __init__(self, h: torch.Tensor) -> None:
        paired = h.dtype in PAIRED_NORM and not (h.dtype == torch.float32 and h.shape[-1] % 16 == 0
                                                   and native.available())
        self.pair: torch.Tensor | None = torch.cat([h, h.neg()], 1) if paired else None
        self.residual = h
        self._halves()

    def _halves(self) -> None:
        if self.pair is not None:
            self._n = n = self.pair.shape[1] // 2
            self.residual, self._negated, self._shape = self.pair[:, :n], self.pair[:, n:], (2 * n,)

    def norm(self, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """host_rms_norm(residual)."""
        if self.pair is None:
            return host_rms_norm(self.residual, weight, eps)
        torch.neg(self.residual, out=self._negated)
        return weight * torch.layer_norm(self.pair, self._shape, None, None, eps)[:, : self._n]

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows from here on."""
        if self.pair is None:
            self.residual = self.residual[rows]
        else:
            self.pair = self.pair[rows]
            self._halves()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from radixlm.runtime.kernels import fused

            return fused.rms_norm(x, self.weight, self.eps)
        return host_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum is written into `residual`."""
        if x.is_cuda:
            from radixlm.runtime.kernels import fused

            return fused.rms_norm(x, self.weight, self.eps, residual), residual
        summed = residual.add_(x)
        return self.forward(summed), summed


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear; on CUDA a single row goes through the triton GEMV, which reads the weights
    faster than cuBLAS does at batch 1 (docs/gpu.md)."""
    if x.is_cuda and x.shape[0] == 1 and x.is_contiguous():
        from radixlm.runtime.kernels.gemv import gemv

        return gemv(x, weight)
    return F.linear(x, weight)


def _out_linear(local_in: int, out: int, tp: TPGroup | None) -> nn.Linear:
    """O and down: row-parallel (one all-reduce) under tensor parallelism."""
    return nn.Linear(local_in, out, bias=False) if tp is None else RowParallelLinear(local_in, out, tp)


class Attention(nn.Module):
    """`arch` is this rank's shard of the model (all of it without tensor parallelism)."""

    def __init__(self, arch: ModelArch, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.layer = layer
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias)
        self.o_proj = _out_linear(arch.q_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor, rotary: RotaryBatch, backend: AttentionBackend) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(self.attend(self.qkv_proj(x), rotary, backend))
        return out

    def attend(self, qkv: torch.Tensor, rotary: RotaryBatch, backend: AttentionBackend) -> torch.Tensor:
        """Attention output [T, q_size] (before o_proj) from the fused q/k/v projection."""
        a = self.arch
        heads = qkv.view(qkv.shape[0], a.num_heads + 2 * a.num_kv_heads, a.head_dim)  # q, k, v heads
        q, k = rotary.apply(heads[:, : a.num_heads + a.num_kv_heads], a.num_heads)
        return backend.forward(self.layer, q, k, heads[:, a.num_heads + a.num_kv_heads :])


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = _out_linear(arch.intermediate_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            from radixlm.runtime.kernels import fused

            out: torch.Tensor = self.down_proj(fused.silu_mul(gate_up))
            return out
        out = self.down_proj(host_swiglu(gate_up))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the
        layer's output, added by the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, rotary, backend), residual)
        return self.mlp(x), residual

    def forward_rows(self, stream: torch.Tensor, rotary: RotaryBatch, backend: AttentionBackend) -> None:
        """A step of few tokens on CUDA (decode of up to 32 sequences): add this layer into the
        residual stream [T, hidden] in place. The residual adds run inside the few-row linear
        kernels, and at one row the norms and SiLU*up too (a layer is then four GEMVs plus RoPE,
        the K/V write and attention)."""
        from radixlm.runtime.kernels.gemv import linear_few

        attn, mlp, ln1, ln2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv = linear_few(stream, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_weight=ln1.weight, eps=ln1.eps)
        _add_rows(attn.o_proj, attn.attend(qkv, rotary, backend).contiguous(), stream)
        gate_up = linear_few(stream, mlp.gate_up_proj.weight, norm_weight=ln2.weight, eps=ln2.eps)
        _add_rows(mlp.down_proj, gate_up, stream, silu_mul=True)


Linear = Callable[[torch.Tensor], torch.Tensor]


def _few_rows_call(module: nn.Module) -> tuple[Linear, int]:
    """A linear layer's call for the CPU loop's steps of few rows, and up to how many rows it
    holds: a weight-only quantized layer's kernel alone up to its `kernel_rows`, else the
    layer's own `forward` (any rows)."""
    if isinstance(module, WeightOnlyLinear) and module.bias is None:
        return module.row_product(), module.kernel_rows
    return module.forward, sys.maxsize


@dataclass(frozen=True)
class HostLayer:
    """A decoder layer's norm weights and linear layers (q/k/v, o, gate/up, down) bound once for
    the CPU loop (`LlamaModel._forward_host`): calling a bound `forward` skips nn.Module's call
    machinery and attribute lookups, paid per layer and per product in every step
    (docs/machines.md). `few` are the same four products for steps of at most `few_rows` rows,
    where a quantized layer's kernel is called directly."""

    index: int
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    linears: tuple[Linear, ...]
    few: tuple[Linear, ...]
    few_rows: int

    @classmethod
    def of(cls, layer: DecoderLayer) -> HostLayer:
        attn, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        few, rows = zip(*(_few_rows_call(m) for m in modules))
        return cls(attn.layer, ln1.weight, ln1.eps, ln2.weight, ln2.eps, tuple(m.forward for m in modules), few,
                   min(rows))


def _add_rows(layer: nn.Linear, x: torch.Tensor, stream: torch.Tensor, silu_mul: bool = False) -> None:
    """stream += layer(x) with the few-row kernels; a row-parallel layer's partial sums are
    all-reduced before the add (the kernel's fused add would add them per rank)."""
    from radixlm.runtime.kernels.gemv import linear_few

    if isinstance(layer, RowParallelLinear):
        stream.add_(layer.group.all_reduce(linear_few(x, layer.weight, silu_mul=silu_mul)))
    else:
        linear_few(x, layer.weight, silu_mul=silu_mul, add_to=stream)


class LlamaModel(nn.Module):
    """Parameter names follow HF's, with q/k/v and gate/up fused (see loader.py).

    With a tensor-parallel group `tp`, the model holds this rank's shard (`plan`; `shard` is the
    shard's shape, `arch` the whole model's): heads, KV heads, MLP columns and vocabulary rows are
    split Megatron-style and every rank returns the whole step's logits."""

    def __init__(self, arch: ModelArch, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.plan = None if tp is None else ShardPlan.of(arch, tp.rank, tp.size)
        self.shard = arch if self.plan is None else self.plan.local_shape(arch)
        shard = self.shard
        # (an explicit weight skips nn.Embedding's random init: on the meta device that init
        # imports torch._dynamo, ~0.7 s of every engine start; build_model fills the weights)
        self.embed_tokens = (nn.Embedding(arch.vocab_size, arch.hidden_size,
                                          _weight=torch.empty(arch.vocab_size, arch.hidden_size))
                             if self.plan is None or tp is None
                             else VocabParallelEmbedding(self.plan, arch.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(shard, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, shard.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        # the LM head as a module of its own on the CPU: weight-only quantized, or packed (loader.py)
        self.host_head: nn.Module | None = None
        self._host_layers: list[HostLayer] | None = None  # bound at the first CPU forward
        self._native_rows: int | None = None  # steps of up to this many rows run native.busy()
        self._fused_rows: int | None = None  # decode steps of up to this many rows run as one native call
        self._fused: FusedDecode | None = None

    def host_layers(self) -> list[HostLayer]:
        """The layers bound for the CPU loop; `rebind()` after replacing a layer's modules."""
        if self._host_layers is None:
            self._host_layers = [HostLayer.of(layer) for layer in cast("list[DecoderLayer]", self.layers)]
        return self._host_layers

    def rebind(self) -> None:
        self._host_layers, self._native_rows, self._fused_rows, self._fused = None, None, None, None

    def packed_weights(self) -> int:
        """How many weight matrices (layers, LM head, quantized layers' dense copies) are packed
        for oneDNN (radixlm.runtime.model.dense_linear)."""
        return sum(1 for m in self.modules() if isinstance(m, DenseLinear) and m.packed is not None)

    def native_products(self) -> int:
        """How many weight matrices (layers, LM head) multiply on the native VNNI kernels
        (radixlm.runtime.kernels.native)."""
        return sum(1 for m in self.modules() if isinstance(m, NativeBlockLinear))

    def init_rope(self, max_positions: int) -> None:
        self.rope = RotaryEmbedding(self.arch, max_positions, self.embed_tokens.weight.device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run T new tokens; return fp32 logits for the rows in `logit_rows` (all rows if None)."""
        assert self.rope is not None, "call init_rope() first"
        h = self.embed_tokens(input_ids)
        rotary = self.rope.batch(positions, h.dtype)
        if h.is_cuda:
            from radixlm.runtime.kernels.gemv import MAX_ROWS

            if h.shape[0] <= MAX_ROWS:
                return self._forward_rows(h, rotary, backend, logit_rows)
            h, residual = self._forward_modules(h, rotary, backend)
            if logit_rows is not None:
                h, residual = h[logit_rows], residual[logit_rows]
        else:
            with self._native_busy(h.shape[0]):
                fused = self._fused_decode(h, backend, logit_rows)
                if fused is not None:
                    h, residual = fused.run(h, rotary, cast("TorchAttention", backend))
                else:
                    h, residual = self._forward_host(h, rotary, backend, logit_rows)
                return self._logits(h, residual)
        return self._logits(h, residual)

    def _logits(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = self.norm.add_forward(h, residual)
        if self.host_head is not None:
            return cast("torch.Tensor", self.host_head(h)).float()
        return self._whole_vocab(linear(h, self.lm_head_weight).float())

    def _fused_decode(self, h: torch.Tensor, backend: AttentionBackend,
                      logit_rows: torch.Tensor | None) -> FusedDecode | None:
        """The layers bound for one native call (`fused_decode`), where this step can run so."""
        if self._fused_rows is None:
            self._fused_rows = FusedDecode.supported(self.shard, self._layer_parts(), self.tp is not None)
        if not self._fused_rows or not FusedDecode.fits(h, backend, logit_rows, self._fused_rows):
            return None
        attention = cast("TorchAttention", backend)
        if self._fused is None or self._fused.pool is not attention.pool:
            self._fused = FusedDecode(self.shard, self._layer_parts(), attention)
        return self._fused

    def _layer_parts(self) -> list[LayerParts]:
        parts = []
        for layer in cast("list[DecoderLayer]", self.layers):
            attn, mlp, ln1, ln2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            parts.append(LayerParts((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), ln1.weight,
                                    ln1.eps, ln2.weight, ln2.eps))
        return parts

    def _native_busy(self, rows: int) -> contextlib.AbstractContextManager[None]:
        """A CPU step whose products run on the native kernels' threads (radixlm.runtime.kernels.
        native.busy): its workers spin between the products and torch's ops keep to this thread."""
        if self._native_rows is None:
            rows_each = [layer.few_rows for layer in self.host_layers()] + [native_ir.BUSY_ROWS]
            self._native_rows = min(rows_each) if self.native_products() else 0
        return native.busy() if rows <= self._native_rows else contextlib.nullcontext()

    def _whole_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the logits -> all of them."""
        return logits if self.tp is None else gather_logits(self.tp, logits, self.arch.vocab_size)

    def _forward_modules(self, h: torch.Tensor, rotary: RotaryBatch,
                         backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers as modules (CUDA, above the few-row kernels' rows): (the last MLP output,
        the residual stream before it)."""
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, rotary, backend)
        assert residual is not None
        return h, residual

    def _forward_host(self, h: torch.Tensor, rotary: RotaryBatch, backend: AttentionBackend,
                      logit_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers off CUDA, as DecoderLayer.forward runs them (the same ops, so the same
        results), in one loop over the bound layers: at batch 1 a step is mostly the cost of
        issuing ~30 small ops per layer, so the Python around them counts. Returns (the last
        MLP output, the residual stream before it) of the rows in `logit_rows` (all if None).

        The last layer keeps only those rows after its attention (which writes every row's K
        and V): nothing reads the other rows' outputs, so a prompt's prefill skips its last
        layer's o_proj and MLP for all but the row it samples from."""
        a = self.shard
        qk_heads = a.num_heads + a.num_kv_heads
        stream = HostStream(h)  # (from the embeddings: then updated in place)
        rows = h.shape[0]
        layers = self.host_layers()
        keep = logit_rows if logit_rows is not None and logit_rows.numel() < rows else None
        # q and k rotated with v in one tensor, whose K and V heads the backend stores in one copy
        assert isinstance(backend, TorchAttention), "off CUDA the layers run on the torch attention backend"
        for layer in layers:
            qkv_proj, o_proj, gate_up_proj, down_proj = layer.few if rows <= layer.few_rows else layer.linears
            if layer.index > 0:
                stream.residual.add_(h)
            x = stream.norm(layer.norm1, layer.eps1)
            qkv = qkv_proj(x)
            heads = qkv.view(rows, qk_heads + a.num_kv_heads, a.head_dim)  # q, k, v heads
            rotated = rotary.rotate(heads, qk_heads)
            attended = backend.forward_joined(layer.index, rotated[:, : a.num_heads], rotated[:, a.num_heads :])
            if keep is not None and layer is layers[-1]:
                attended = attended[keep]
                stream.keep(keep)
            stream.residual.add_(o_proj(attended))
            gate_up = gate_up_proj(stream.norm(layer.norm2, layer.eps2))
            h = down_proj(host_swiglu(gate_up))
        residual = stream.residual
        if logit_rows is not None and keep is None:
            h, residual = h[logit_rows], residual[logit_rows]
        return h, residual

    def _forward_rows(self, h: torch.Tensor, rotary: RotaryBatch, backend: AttentionBackend,
                      logit_rows: torch.Tensor | None) -> torch.Tensor:
        """forward() for few tokens on CUDA: the residual stream updated in place layer by layer."""
        from radixlm.runtime.kernels.gemv import linear_few

        for layer in cast("list[DecoderLayer]", self.layers):
            layer.forward_rows(h, rotary, backend)
        if logit_rows is not None:
            h = h[logit_rows]
        if h.shape[0] == 0:
            return h.new_empty((0, self.arch.vocab_size), dtype=torch.float32)
        return self._whole_vocab(
            linear_few(h.contiguous(), self.lm_head_weight, norm_weight=self.norm.weight, eps=self.norm.eps).float())
