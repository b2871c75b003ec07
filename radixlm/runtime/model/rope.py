"""Rotary position embeddings (rotate-half layout, as HF Llama/Qwen2/Mistral use)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.model.arch import ModelArch, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Precomputed cos/sin tables; `apply` rotates q and k of a ragged token batch."""

    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device | str) -> None:
        inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.max_positions = max_positions

        half = arch.head_dim // 2
        # sin with the first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin
        self.signed_sin = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def batch(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryBatch:
        """What every layer of one forward needs to rotate its q and k."""
        if positions.is_cuda:  # the fused kernel reads the fp32 tables by position
            return RotaryBatch(positions, self.cos, self.sin, fused=True)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        signed_sin = self.signed_sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return RotaryBatch(positions, cos, signed_sin, fused=False)


@dataclass(frozen=True)
class RotaryBatch:
    """One forward's rotary inputs: per-token cos and signed sin (`RotaryEmbedding.signed_sin`)
    [T, 1, d] in the model dtype, or (fused, CUDA) the positions and the whole fp32 cos/sin tables."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool

    def apply(self, qk: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q [T, num_heads, d] and k [T, kv_heads, d] from qk [T, num_heads + kv_heads, d]
        (a view of the q/k/v projection; rotated in place when fused). On the CPU q and k rotate
        together: x * cos + swap_halves(x) * signed_sin, rounded as `apply_rotary` rounds (one
        fused addcmul would round once less, and flipped the default model's q4 answer to a
        prompt whose top two logits are one bf16 step apart)."""
        if self.fused:
            from radixlm.runtime.kernels import fused

            q, k = qk[:, :num_heads], qk[:, num_heads:]
            fused.rotary_(q, k, self.positions, self.cos, self.sin)
            return q, k
        rotated = self.rotate(qk, qk.shape[1])
        return rotated[:, :num_heads], rotated[:, num_heads:]

    def rotate(self, x: torch.Tensor, rot: int) -> torch.Tensor:
        """Off CUDA: a token's q/k/v heads x [T, heads, d] with its first `rot` heads (q and k)
        rotated, x * cos + swap_halves(x) * signed_sin, each product rounded as `apply_rotary`
        rounds, and the rest (v) as they are. The CPU layer loop rotates the q/k/v projection so,
        in one tensor whose K and V heads stay side by side. In fp32 on the native kernels where
        they run (one pass over x, the tables a token's row)."""
        cos, sin = self.cos, self.sin
        if (x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] in native_ir.HEAD_DIMS
                and x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and native.available()):
            return native.rotate(x, cos, sin, rot)
        turned = x[:, :rot]
        turned = turned * cos + turned.roll(x.shape[-1] // 2, -1) * sin
        return turned if rot == x.shape[1] else torch.cat([turned, x[:, rot:]], 1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] (the textbook form; the reference in tests)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
