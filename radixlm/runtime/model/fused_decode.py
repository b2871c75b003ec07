"""A CPU decode step's decoder layers in one native call (`ir_elementwise._decode_layers`).

At batch 1 the layer loop issues ~13 calls a layer from Python (norms, the four products, the
rotation, the K/V write, the attention, SwiGLU, two adds): ~390 a step of the default model, each
a few microseconds of ctypes, tensor allocation and dispatch on top of its work. Where every one
of them would run on the native kernels anyway (fp32, the native products, native decode
attention), the same functions are called in the same order on the same buffers from one IR
function, so the results are equal to the bit; the layer loop stays for everything else. Steps
of up to 4 rows use the row kernels; where every product has tiles, up to a busy stretch's 32.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.quant_linear import NativeBlockLinear

if TYPE_CHECKING:
    from radixlm.runtime.kernels.attention.torch_backend import TorchAttention
    from radixlm.runtime.model.rope import RotaryBatch


def _bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


@dataclass(frozen=True)
class LayerParts:
    """What `decode_layers` takes of a decoder layer: its four products (q/k/v, o, gate/up, down)
    and its two norms' weights and eps."""

    linears: tuple[nn.Module, nn.Module, nn.Module, nn.Module]
    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float


class FusedDecode:
    """The model's layers bound for `decode_layers`: their descriptors, and per step shape the
    buffers the ops write (reused from step to step)."""

    def __init__(self, shape: ModelArch, layers: list[LayerParts], backend: TorchAttention) -> None:
        self.heads, self.kv_heads, self.d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.hidden, self.inter = shape.hidden_size, shape.intermediate_size
        self.pool = backend.pool
        assert self.pool.kv_layers is not None
        rows = []
        for parts, kv in zip(layers, self.pool.kv_layers, strict=True):
            products = [m.product for m in parts.linears if isinstance(m, NativeBlockLinear)]
            tiles = [0 if p.tiles is None else p.tile_descriptor.data_ptr() for p in products]
            rows.append([*(p.descriptor_address for p in products), parts.norm1.data_ptr(), parts.norm2.data_ptr(),
                         _bits(parts.eps1), _bits(parts.eps2), kv.data_ptr(), *tiles])
        self.layers = torch.tensor(rows, dtype=torch.int64)
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def supported(shape: ModelArch, layers: list[LayerParts], parallel: bool) -> int:
        """Up to how many rows the layers could run as one call (0: never): fp32 on the native
        kernels, no tensor parallelism, every layer's four products on the native kernels without
        bias (up to their `kernel_rows`; up to MAX_ROWS on the row kernels, to a busy stretch's
        BUSY_ROWS where every product also has tiles), norms and sizes the native ops take."""
        linears = [m for parts in layers for m in parts.linears]
        native_linears = [m for m in linears if isinstance(m, NativeBlockLinear) and m.bias is None
                          and m.product.dtype == torch.float32]
        norms = [w for parts in layers for w in (parts.norm1, parts.norm2)]
        if (parallel or not native.available() or shape.head_dim not in native_ir.HEAD_DIMS
                or shape.hidden_size % 16 or shape.intermediate_size % 16 or not linears
                or len(native_linears) != len(linears)
                or not all(w.dtype == torch.float32 and w.is_contiguous() for w in norms)):
            return 0
        tiled = all(m.product.tiles is not None for m in native_linears)
        return min(native_ir.BUSY_ROWS if tiled else native_ir.MAX_ROWS, *(m.kernel_rows for m in native_linears))

    @staticmethod
    def fits(h: torch.Tensor, backend: object, logit_rows: torch.Tensor | None, rows: int) -> bool:
        """Whether this step runs as one call: decode rows only (at most `rows`), every row's
        logits, on the native decode attention."""
        from radixlm.runtime.kernels.attention.torch_backend import TorchAttention

        return (0 < h.shape[0] <= rows and logit_rows is None and isinstance(backend, TorchAttention)
                and backend.decode_only and backend.native)

    @staticmethod
    def padded(m: int) -> int:
        """The rows a product's output has: m on the row kernels, a multiple of 8 on the tiles."""
        return m if m <= native_ir.MAX_ROWS else -(-m // native_ir.TILE_M) * native_ir.TILE_M

    def _buffers(self, m: int) -> dict[str, torch.Tensor]:
        """The step's buffers for m rows; the products' outputs (qkv, o, gu, h) with `padded(m)`."""
        if m not in self.buffers:
            all_heads = self.heads + 2 * self.kv_heads
            shapes = {"x": self.hidden, "qkv": all_heads * self.d, "rot": all_heads * self.d,
                      "att": self.heads * self.d, "o": self.hidden, "gu": 2 * self.inter, "act": self.inter,
                      "h": self.hidden}
            outputs = ("qkv", "o", "gu", "h")
            self.buffers[m] = {name: torch.empty(self.padded(m) if name in outputs else m, width)
                               for name, width in shapes.items()}
        return self.buffers[m]

    def run(self, h: torch.Tensor, rotary: RotaryBatch, backend: TorchAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers of a decode step: (the last MLP output, the residual stream before it), as
        `LlamaModel._forward_host` returns them. `h` (the embeddings) becomes the residual."""
        m = h.shape[0]
        residual = h.contiguous()
        buffers = self._buffers(m)
        cos, sin = rotary.cos.contiguous(), rotary.sin.contiguous()  # (a token's row: `ir_elementwise._rotate`)
        slots = backend.meta.out_slots.contiguous()
        idx, lens = backend.decode_kv_idx.contiguous(), backend.decode_lens.contiguous()
        longest = idx.numel() // m
        mpad = self.padded(m)
        lib = native.library()
        with native.running(lib):
            stride = lib.attention_scratch(longest)
            lib.tile_scratch(mpad * max(self.hidden, self.inter, self.heads * self.d))  # (the products' widest K)
            fields = {"m": m, "residual": residual.data_ptr(), **{k: t.data_ptr() for k, t in buffers.items()},
                      "cos": cos.data_ptr(), "sin": sin.data_ptr(), "slots": slots.data_ptr(), "idx": idx.data_ptr(),
                      "maxkv": longest, "lens": lens.data_ptr(), "heads": self.heads, "kvheads": self.kv_heads,
                      "d": self.d, "hidden": self.hidden, "inter": self.inter, "scalebits": _bits(backend.scale),
                      "scratch": lib.scratch.data_ptr(), "sstride": stride, "workers": lib.workers,
                      "layers": self.layers.data_ptr(), "count": self.layers.shape[0], "mpad": mpad,
                      "tvals": lib.tile_values.data_ptr(), "tscales": lib.tile_scales.data_ptr()}
            step = torch.tensor([fields[f] for f in native_ir.STEP_FIELDS], dtype=torch.int64)
            lib.decode_layers.addresses(ctl=lib.control_address, step=step.data_ptr())
        return buffers["h"][:m], residual
