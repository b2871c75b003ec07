"""A GGUF file's linear weights as weight-only quantized layers, read from its blocks.

4-bit blocks (Q4_0, Q4_1, Q4_K) become int4 layers without a float round trip: each block of 32
weights is w = scale * q + minimum with q in 0..15 (Q4_0: minimum = -8 * scale; Q4_K: per
32-weight sub-block, scale = d * sc and minimum = -dmin * m from its 6-bit scales), which is
the int4 kernel's own form. Q8_0 blocks (w = d * q, q in -128..127; the default model's
embedding and LM head) run in bf16 as two 4-bit halves of the same kernel (`Int8BlockLinear`). Other
tensors (Q6_K, Q5_*, F16, ...), and a fused layer whose parts mix types (a Q4_K_M file's Q4_K
attn_q with its Q6_K attn_v), are dequantized to fp32 by the `gguf` package and, under q4 in bf16,
quantized to 8 bits per block of 32 as Q8_0 is (Q6_K's 6-bit values keep nearly all their levels
there, where one scale per row rounds a row's small blocks away); under int8, or in another dtype
(where the int4 kernel is slow), to int8 per row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.runtime.model.gguf_convert import _unpermute_rope_rows
from radixlm.runtime.model.quant_linear import (
    Int8Linear,
    WeightOnlyLinear,
    eight_bit_linear,
    four_bit_linear,
    q8_from_float,
    uses_native,
)

# our fused layer -> the GGUF tensors it stacks (rows in this order)
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
Q8_0_BYTES = 34  # a Q8_0 block: an f16 scale, then 32 int8 weights


def _f16(raw: np.ndarray) -> np.ndarray:
    """A [..., 2] uint8 field as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def four_bit_blocks(kind: str, data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [n, k] uint8 in 0..15, scale [n, k/32], minimum [n, k/32]) of a 4-bit GGUF tensor's raw
    bytes, so that w = scale * q + minimum per 32 weights along k."""
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        raw = data.reshape(n, k // 32, size)
        scale = _f16(raw[..., 0:2])
        minimum = -8 * scale if kind == "Q4_0" else _f16(raw[..., 2:4])
        qs = raw[..., size - 16 :]
        q = np.concatenate([qs & 0xF, qs >> 4], -1).reshape(n, k)
        return q, scale, minimum
    if kind == "Q4_K":
        raw = data.reshape(n, k // 256, 144)
        d, dmin = _f16(raw[..., 0:2]), _f16(raw[..., 2:4])
        sc = raw[..., 4:16].astype(np.int32)
        s = np.empty((*sc.shape[:-1], 8), np.int32)
        m = np.empty_like(s)
        s[..., :4], m[..., :4] = sc[..., 0:4] & 63, sc[..., 4:8] & 63
        s[..., 4:] = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
        m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
        qs = raw[..., 16:].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
        q = np.stack([qs & 0xF, qs >> 4], 3).reshape(n, k)
        scale = (d[..., None] * s).reshape(n, k // 32)
        minimum = (-dmin[..., None] * m).reshape(n, k // 32)
        return q, scale, minimum
    raise ValueError(f"{kind} is not a 4-bit GGUF type ({', '.join(FOUR_BIT)})")


def q8_0_blocks(kind: str, data: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(q [n, k] int8, scale [n, k/32]) of a Q8_0 tensor's raw bytes: w = scale * q per 32 weights."""
    if kind != "Q8_0":
        raise ValueError(f"{kind} is not Q8_0")
    raw = data.reshape(n, k // 32, Q8_0_BYTES)
    return np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k), _f16(raw[..., 0:2])


def _dequantized(kind: str, data: np.ndarray, n: int, k: int) -> tuple[np.ndarray]:
    """Any GGUF type's raw bytes as fp32 [n, k], by the `gguf` package."""
    import gguf

    return (gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(n, k),)


class GGUFLinears:
    """The linear weights of one Llama GGUF file, by layer, as quantized modules."""

    def __init__(self, path: Path) -> None:
        """Reads the file's header (parsing its metadata takes seconds: open it once per load)."""
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.tensors: dict[str, Any] = {t.name: t for t in self.reader.tensors}
        heads = self.reader.fields["llama.attention.head_count"].contents()
        kv_heads = self.reader.fields["llama.attention.head_count_kv"].contents()
        self.permute = {"attn_q": int(heads), "attn_k": int(kv_heads)}

    def four_bit_share(self) -> float:
        """The share of the layers' linear weights (by count) stored in a 4-bit type."""
        parts = sum(_LAYER_PARTS.values(), ())
        kinds = [t.tensor_type.name for name, t in self.tensors.items()
                 if name.startswith("blk.") and name.split(".")[2] in parts]
        return sum(k in FOUR_BIT for k in kinds) / max(1, len(kinds))

    def _parts(self, names: list[str]) -> list[tuple[str, Any]]:
        out = []
        for name in names:
            t = self.tensors.get(name)
            if t is None:
                raise ValueError(f"GGUF file has no tensor {name!r}")
            out.append((name, t))
        return out

    def _stacked(self, parts: list[tuple[str, Any]],
                 decode: Callable[[str, np.ndarray, int, int], tuple[np.ndarray, ...]]) -> list[torch.Tensor]:
        """decode(kind, raw bytes, n, k)'s arrays for each tensor of `parts`, rows in HF's order
        (llama.cpp interleaves Q/K's RoPE rows), stacked along the rows."""
        stacks = []
        for name, t in parts:
            k, n = (int(d) for d in t.shape)
            arrays = decode(t.tensor_type.name, np.asarray(t.data), n, k)
            heads = self.permute.get(name.split(".")[-2])
            stacks.append(arrays if heads is None else tuple(_unpermute_rope_rows(a, heads) for a in arrays))
        return [torch.from_numpy(np.concatenate(column)) for column in zip(*stacks, strict=True)]

    def build(self, names: list[str], method: str, dtype: torch.dtype, dense_above: int | None) -> WeightOnlyLinear:
        """One layer whose weight stacks the rows of the GGUF tensors `names`."""
        parts = self._parts(names)
        keep = dense_above is not None
        kinds = {t.tensor_type.name for _, t in parts}
        if method == "q4" and kinds <= set(FOUR_BIT):
            q, scale, minimum = self._stacked(parts, four_bit_blocks)
            return four_bit_linear(q.to(torch.int32), scale, minimum, dtype, keep_dense=keep,
                                   dense_above=dense_above)
        # 8-bit blocks run on the native kernels, or on the int4 kernel, whose fast path is bf16: in
        # fp32 a head through the int4 kernel is slower than as int8 per row (docs/machines.md)
        row_length = int(parts[0][1].shape[0])  # (GGUF shapes list the row's length first)
        blocks = method == "q4" and (dtype == torch.bfloat16 or uses_native(dtype, row_length))
        if blocks and kinds == {"Q8_0"}:
            q, scale = self._stacked(parts, q8_0_blocks)
            return eight_bit_linear(q, scale, dtype, keep_dense=keep, dense_above=dense_above)
        (weight,) = self._stacked(parts, _dequantized)
        if blocks and weight.shape[1] % 32 == 0:  # 8-bit blocks of 32, as Q8_0
            return q8_from_float(weight, dtype, keep_dense=keep, dense_above=dense_above)
        return Int8Linear.from_float(weight, dtype, keep_dense=keep, dense_above=dense_above)

    def layer(self, index: int, ours: str, method: str, dtype: torch.dtype,
              dense_above: int | None) -> WeightOnlyLinear:
        names = [f"blk.{index}.{p}.weight" for p in _LAYER_PARTS[ours]]
        return self.build(names, method, dtype, dense_above)

    def head(self, method: str, dtype: torch.dtype, dense_above: int | None) -> WeightOnlyLinear:
        name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        return self.build([name], method, dtype, dense_above)


LAYER_LINEARS = tuple(_LAYER_PARTS)
_SHARE_FILE = "gguf_four_bit_share"


def four_bit_share(path: Path, cache_dir: Path | None) -> float:
    """GGUFLinears(path).four_bit_share(), remembered in `cache_dir` (the file's converted
    weights, keyed by its path, size and time): its header takes seconds to parse, at every start."""
    remembered = None if cache_dir is None else cache_dir / _SHARE_FILE
    if remembered is not None and remembered.is_file():
        try:
            return float(remembered.read_text())
        except ValueError:
            pass  # a damaged file: parse again
    share = GGUFLinears(path).four_bit_share()
    if remembered is not None and remembered.parent.is_dir():
        tmp = remembered.with_name(f"{_SHARE_FILE}.{os.getpid()}")
        try:
            tmp.write_text(repr(share))
            tmp.replace(remembered)  # atomic: engines starting together read a whole file or none
        except OSError:  # a read-only cache: parse again next time
            tmp.unlink(missing_ok=True)
    return share
