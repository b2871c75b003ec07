"""A dense linear layer for the CPU whose weight is packed once, at load, in oneDNN's blocked layout.

`F.linear` on a bf16 CPU tensor runs oneDNN's matmul, which lays the weight out in its own
blocked format on every call; a weight packed once (`mkldnn._reorder_linear_weight`, the op
torch's own compiler uses when it freezes a model) skips that work, most at steps of few rows,
with the same result to the bit (docs/machines.md; benchmarks/quant_kernels.py,
docs/benchmarks.md). Only bf16 is packed: in fp32 the packed
kernel rounds differently from `F.linear` (MKL's), so fp32 models keep plain weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def packing_available() -> bool:
    """Whether bf16 weights can be packed here: oneDNN multiplies bf16 on this processor and
    the packed product equals `F.linear`'s, bit for bit, on a probe."""
    try:
        mkldnn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        if not (mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=gen).bfloat16()
        x = torch.randn(3, 64, generator=gen).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return bool(torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def amx_packing() -> bool:
    """Whether packed bf16 weights multiply in AMX tiles here (torch sees AMX and packs bf16)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(amx()) and packing_available()


def packs(weight: torch.Tensor) -> bool:
    """Whether `DenseLinear` packs this weight (a bf16 CPU matrix, where packing is available)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2 \
        and packing_available()


class DenseLinear(nn.Module):
    """y = x @ W^T (+ bias) with W dense: packed for oneDNN where `packs(W)`, else a plain
    `F.linear` weight. The packed tensor is the only copy held (no `weight` then). Activations
    of another dtype than W's are multiplied in W's and the result returned in theirs (fp32
    activations against a bf16 copy in AMX tiles)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = None if bias is None else nn.Parameter(bias.to(weight.dtype), requires_grad=False)
        self.packed: torch.Tensor | None = None
        self.weight: nn.Parameter | None = None
        if packs(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        else:
            self.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            return self.forward(x.to(self.dtype)).to(x.dtype)
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias,
                                                                   "none", [], "")
            return out
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, packed={self.packed is not None}"
