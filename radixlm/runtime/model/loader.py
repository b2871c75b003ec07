"""Build a LlamaModel from a HF folder of safetensors, or fill it with dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.dense_linear import DenseLinear, packs
from radixlm.runtime.model.formats import QuantChoice
from radixlm.runtime.model.gguf_quant import LAYER_LINEARS, GGUFLinears
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.quant_linear import GGUF_BLOCK_METHODS, QUANT_METHODS

# HF tensor name suffix -> (our parameter suffix, which part of a fused tensor it fills)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _our_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{f}: listed in {index.name} but not found")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files; a model folder needs its weights as safetensors")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield f, name, st.get_tensor(name)


def _slices(arch: ModelArch, fused: str, part: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        sizes = [arch.q_size, arch.kv_size, arch.kv_size]
    else:
        sizes = [arch.intermediate_size, arch.intermediate_size]
    start = sum(sizes[:part])
    return start, start + sizes[part]


def load_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy every tensor of the checkpoint into `model` (its rank's shard under tensor
    parallelism), checking names and shapes."""
    arch = model.arch
    params = dict(model.named_parameters())
    whole = params if model.plan is None else _whole_params(arch)
    filled: set[str] = set()
    for path, hf_name, tensor in _iter_tensors(_checkpoint_files(Path(model_dir))):
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        stem, _, kind = _our_name(hf_name).rpartition(".")
        target = f"{stem}.{kind}"
        rows: tuple[int, int] | None = None
        fused_part: int | None = None
        for hf_suffix, (ours, part) in _FUSED.items():
            if stem.endswith(hf_suffix):
                target = f"{stem[: -len(hf_suffix)]}{ours}.{kind}"
                rows, fused_part = _slices(arch, ours, part), part
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"{path.name}: unexpected tensor {hf_name!r} for a {arch.family} model of this config")
        full = whole[target]
        expected = full if rows is None else full[rows[0] : rows[1]]
        if tuple(expected.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{path.name}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"but config.json implies {tuple(expected.shape)}"
            )
        if model.plan is not None:
            tensor = model.plan.shard(target, tensor, fused_part)
            if fused_part is not None:
                rows = _slices(model.shard, target.rsplit(".", 1)[0], fused_part)
        dest = param.data if rows is None else param.data[rows[0] : rows[1]]
        dest.copy_(tensor)
        filled.add(hf_name)
    missing = [n for n in expected_tensor_names(arch) if n not in filled]
    if missing:
        raise ValueError(
            f"{model_dir}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def expected_tensor_names(arch: ModelArch) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkv"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if arch.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    for i in range(arch.num_layers):
        names += [f"model.layers.{i}.{p}" for p in per_layer]
    return names


def _whole_params(arch: ModelArch) -> dict[str, torch.nn.Parameter]:
    """The parameters of the whole (unsharded) model, on the meta device (shapes only)."""
    with torch.device("meta"):
        return dict(LlamaModel(arch).named_parameters())


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every parameter of a model built on the meta device uninitialized storage of `dtype`
    on `device` (``Module.to_empty``'s effect, without its path through torch._refs, whose first
    call imports torch's symbolic-shapes module: ~1.2 s of every engine start)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device),
                                                              requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def build_model(
    arch: ModelArch,
    model_dir: Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    seed: int = 0,
    tp: TPGroup | None = None,
    quant: QuantChoice | None = None,
    gguf: GGUFLinears | Path | None = None,
) -> LlamaModel:
    """The model with weights from `model_dir`, or random weights (std 0.02) when it is None.
    With `tp`, this rank's shard of it; dummy weights are then drawn whole, as without
    tensor parallelism, and cut, so every tp_size runs the same model. With `quant`, its linear
    layers weight-only quantized (from the blocks of the GGUF file `gguf`, if given); not with `tp`."""
    with torch.device("meta"):
        model = LlamaModel(arch, tp)
        whole = model if tp is None else LlamaModel(arch)
    materialize(model, dtype, device)  # (never whole in fp32: a 70B shard would not fit)
    if model_dir is None:
        gen = torch.Generator(device=device).manual_seed(seed)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, meta in whole.named_parameters():
                p = params[name]
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                elif model.plan is None:
                    p.normal_(0.0, 0.02, generator=gen)
                else:
                    full = torch.empty(meta.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
                    p.copy_(model.plan.shard(name, full))
    else:
        with torch.no_grad():
            load_weights(model, model_dir)
    if quant is not None and quant.method != "none":
        if torch.device(device).type != "cpu":
            raise ValueError(f"--quantization {quant.method} runs on the CPU only; use --quantization none")
        if tp is not None:
            raise ValueError(f"--quantization {quant.method} does not shard over --tp-size; use --quantization none")
        if quant.method not in GGUF_BLOCK_METHODS:  # (made from the loaded weights: the file's blocks are not read)
            gguf = None
        quantize_linears(model, quant, dtype, GGUFLinears(gguf) if isinstance(gguf, Path) else gguf)
    elif tp is None and packs(model.lm_head_weight):
        pack_linears(model)
    model.eval().requires_grad_(False)
    model.init_rope(max_positions)
    return model


def pack_linears(model: LlamaModel) -> None:
    """Replace every layer's linear modules and the LM head by `DenseLinear`s, their weights packed
    once for oneDNN (a bf16 model on a CPU that multiplies bf16 natively; the same products, bit for
    bit, faster: radixlm.runtime.model.dense_linear). The embedding keeps its own plain matrix."""
    for _, ours, parent in _linear_slots(model):
        leaf = ours.rpartition(".")[2]
        dense = getattr(parent, leaf)
        setattr(parent, leaf, DenseLinear(dense.weight.data, None if dense.bias is None else dense.bias.data))
    model.host_head = DenseLinear(model.lm_head_weight.data)
    model.rebind()


def _linear_slots(model: LlamaModel) -> list[tuple[int, str, torch.nn.Module]]:
    """(layer index, linear name as in LAYER_LINEARS, the module holding it) for every layer's linears."""
    return [(i, ours, layer.get_submodule(ours.rpartition(".")[0])) for i, layer in enumerate(model.layers)
            for ours in LAYER_LINEARS]


def quantize_linears(model: LlamaModel, quant: QuantChoice, dtype: torch.dtype, gguf: GGUFLinears | None) -> None:
    """Replace every layer's linear modules and the LM head by weight-only quantized ones: from
    the GGUF file's own blocks when there is one, else from the loaded float weights (in
    torch.get_num_threads() threads: packing is a torch op per matrix that releases the GIL,
    ~1.6 s of the default model's start in fp16 on one thread)."""
    from concurrent.futures import ThreadPoolExecutor

    from torch import nn

    if quant.method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization {quant.method!r}; choose one of none, {', '.join(sorted(QUANT_METHODS))}")
    keep = quant.dense_above is not None
    slots = _linear_slots(model)

    def build(slot: tuple[int, str, nn.Module]) -> nn.Module:
        i, ours, parent = slot
        dense = getattr(parent, ours.rpartition(".")[2])
        if gguf is not None:
            new = gguf.layer(i, ours, quant.method, dtype, quant.dense_above)
        else:
            new = QUANT_METHODS[quant.method](dense.weight.data, dtype, dense.bias, keep_dense=keep,
                                              dense_above=quant.dense_above)
        if dense.bias is not None and new.bias is None:
            new.bias = nn.Parameter(dense.bias.data, requires_grad=False)
        return new

    def head() -> nn.Module:
        if gguf is not None:
            return gguf.head(quant.method, dtype, quant.dense_above)
        return QUANT_METHODS[quant.method](model.lm_head_weight.data, dtype, keep_dense=keep,
                                           dense_above=quant.dense_above)

    threads = 1 if gguf is not None else max(1, torch.get_num_threads())  # (GGUF blocks: numpy, one file)
    with ThreadPoolExecutor(threads) as pool:
        host_head = pool.submit(head)
        built = list(pool.map(build, slots))
        model.host_head = host_head.result()
    for (_, ours, parent), new in zip(slots, built, strict=True):
        setattr(parent, ours.rpartition(".")[2], new)
    model.rebind()
