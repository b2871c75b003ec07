"""Weight-only quantized linears: GGUF 4-bit blocks read exactly, products within the
quantization's error, and the default model from its own Q4_1 weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.kernels import native
from radixlm.runtime.model import quant_linear
from radixlm.runtime.model.dense_linear import DenseLinear, amx_packing
from radixlm.runtime.model.formats import QuantChoice, auto_dense_above
from radixlm.runtime.model.gguf_quant import four_bit_blocks, q8_0_blocks
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.quant_linear import (
    Fp16Linear,
    Int4Linear,
    Int8BlockLinear,
    Int8Linear,
    fp16_available,
    q4_from_float,
)
from radixlm.runtime.model_runner import ModelRunner

# block weights in bf16 go to the native VNNI kernels where they run, else to torch's int4 kernel
FOUR_BIT = "NativeBlockLinear" if native.available() else "Int4Linear"
EIGHT_BIT_BLOCKS = "NativeBlockLinear" if native.available() else "Int8BlockLinear"

BLOCK = {"Q4_0": (32, 18, [(0, 2)]), "Q4_1": (32, 20, [(0, 2), (2, 4)]), "Q4_K": (256, 144, [(0, 2), (2, 4)])}


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes of a [n, k] tensor of `kind`, with small finite f16 scale fields."""
    size, nbytes, f16_fields = BLOCK[kind]
    raw = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    for lo, hi in f16_fields:
        raw[..., lo:hi] = rng.uniform(0.001, 0.05, (n, k // size, 1)).astype(np.float16).view(np.uint8)
    if kind == "Q4_1":  # the block minimum is negative in practice
        raw[..., 2:4] = (-rng.uniform(0.0, 0.3, (n, k // size, 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_four_bit_blocks_match_gguf_dequantize(kind):
    n, k = 6, 512
    data = _random_blocks(kind, n, k, np.random.default_rng(0))
    q, scale, minimum = four_bit_blocks(kind, data, n, k)
    assert q.shape == (n, k) and q.max() <= 15 and scale.shape == minimum.shape == (n, k // 32)
    ours = (q.reshape(n, k // 32, 32) * scale[..., None] + minimum[..., None]).reshape(n, k)
    ref = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_from_blocks_equals_dequantized_product(kind, dtype):
    n, k = 64, 512
    data = _random_blocks(kind, n, k, np.random.default_rng(1))
    q, scale, minimum = four_bit_blocks(kind, data, n, k)
    layer = Int4Linear.from_affine(torch.from_numpy(q).to(torch.int32), torch.from_numpy(scale),
                                   torch.from_numpy(minimum), dtype)
    w = torch.from_numpy(gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k))
    x = torch.randn(3, k)
    ref = x @ w.T
    got = layer(x.to(dtype)).float()
    # bf16: the activations, scales and zero points are rounded to 8 bits of mantissa
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()


def _q8_0_bytes(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes of a [n, k] Q8_0 tensor, every int8 value (-128 too) and block scales
    over three orders of magnitude (a per-row scale would lose the small blocks)."""
    raw = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = (10.0 ** rng.uniform(-4, -1, (n, k // 32, 1))).astype(np.float16).view(np.uint8)
    raw[0, 0, 2:] = np.arange(-128, -96, dtype=np.int8).view(np.uint8)
    raw[0, 1, 2:] = np.arange(96, 128, dtype=np.int8).view(np.uint8)
    return raw.reshape(n, -1)


def test_q8_0_blocks_match_gguf_dequantize():
    n, k = 6, 256
    data = _q8_0_bytes(n, k, np.random.default_rng(2))
    q, scale = q8_0_blocks("Q8_0", data, n, k)
    assert q.dtype == np.int8 and q.min() == -128 and q.max() == 127 and scale.shape == (n, k // 32)
    ours = (q.reshape(n, k // 32, 32) * scale[..., None]).reshape(n, k)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(n, k))
    with pytest.raises(ValueError, match="not Q8_0"):
        q8_0_blocks("Q4_1", data, n, k)


def test_int8_blocks_as_two_int4_halves_are_the_blocks_weights_and_product():
    """The int4 kernel over [x, x] and the 4-bit halves of each int8 weight multiplies by the
    file's Q8_0 weights: each within one step of its block (~0.1 step on average; the scales, the
    halves and the output are rounded to bf16), where int8 with one scale per row (what Q8_0
    became before) is ~18 steps off on average, rounding a row's small blocks away."""
    torch.manual_seed(0)
    n, k = 96, 512
    data = _q8_0_bytes(n, k, np.random.default_rng(3))
    q, scale = q8_0_blocks("Q8_0", data, n, k)
    w = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0).reshape(n, k))
    blocks = Int8BlockLinear.from_blocks(torch.from_numpy(q), torch.from_numpy(scale), torch.bfloat16)
    assert blocks.in_features == k and blocks.out_features == n and blocks.dense is None
    eye = torch.eye(k, dtype=torch.bfloat16)
    step = torch.from_numpy(np.repeat(scale, 32, 1))  # each weight's block scale
    seen = (blocks(eye).float().T - w).abs() / step  # the product of e_j is column j: the weights as used
    assert seen.max().item() < 1 and seen.mean().item() < 0.2
    per_row = (Int8Linear.from_float(w, torch.bfloat16)(eye).float().T - w).abs() / step
    assert per_row.mean().item() > 5

    layer = Int8BlockLinear.from_blocks(torch.from_numpy(q), torch.from_numpy(scale), torch.bfloat16,
                                        keep_dense=True, dense_above=3)
    x = torch.randn(5, k).bfloat16()
    ref = x.double() @ w.double().T
    one = layer(x[:2])  # at most dense_above rows: the int4 kernel
    assert one.shape == (2, n) and one.dtype == torch.bfloat16
    assert torch.equal(layer.row_product()(x[:2]), one)  # the CPU loop's direct call, the same bits
    assert (one.double() - ref[:2]).abs().max().item() < 1e-2 * ref[:2].abs().max().item()
    assert torch.equal(layer(x), F.linear(x, w.to(torch.bfloat16)))  # 5 rows > 3: the dense copy
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8BlockLinear(torch.zeros(4, 40, dtype=torch.int8), torch.ones(4, 1), torch.bfloat16)


def _q6_k_bytes(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes of a [n, k] Q6_K tensor (256 weights in 210 bytes: 6-bit values, an int8
    scale per 16, an f16 scale last), its f16 scales over two orders of magnitude."""
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = (10.0 ** rng.uniform(-5, -3, (n, k // 256, 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def test_gguf_layers_of_other_types_become_8_bit_blocks_under_q4(tmp_path):
    """A fused layer whose parts mix types (a Q4_K_M file's Q4_K attn_q/attn_k with its Q6_K
    attn_v) and a Q6_K layer load under q4 as 8-bit blocks of 32 (as Q8_0): the file's weights
    within ~1% of each block's largest, where one int8 scale per row (int8) is ~10x further off."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    from radixlm.runtime.model.gguf_convert import _unpermute_rope_rows
    from radixlm.runtime.model.gguf_quant import GGUFLinears

    rng = np.random.default_rng(4)
    heads, kv_heads, d, hidden = 4, 2, 16, 256
    tensors = {"attn_q": ("Q4_K", heads * d), "attn_k": ("Q4_K", kv_heads * d), "attn_v": ("Q6_K", kv_heads * d),
               "ffn_down": ("Q6_K", hidden)}
    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    dense = {}
    for name, (kind, rows) in tensors.items():
        raw = _random_blocks(kind, rows, hidden, rng) if kind == "Q4_K" else _q6_k_bytes(rows, hidden, rng)
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_shape=raw.shape, raw_dtype=getattr(T, kind))
        w = gguf.quants.dequantize(raw, getattr(T, kind)).reshape(rows, hidden)
        rope_heads = {"attn_q": heads, "attn_k": kv_heads}.get(name)  # llama.cpp's RoPE row order, undone
        dense[name] = w if rope_heads is None else _unpermute_rope_rows(w, rope_heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFLinears(path)
    for ours, names in (("self_attn.qkv_proj", ("attn_q", "attn_k", "attn_v")), ("mlp.down_proj", ("ffn_down",))):
        w = torch.from_numpy(np.concatenate([dense[n] for n in names]))
        eye = torch.eye(hidden, dtype=torch.bfloat16)
        step = w.view(w.shape[0], -1, 32).abs().amax(-1).repeat_interleave(32, 1)  # each block's largest
        blocks = file.layer(0, ours, "q4", torch.bfloat16, None)
        assert type(blocks).__name__ == EIGHT_BIT_BLOCKS
        err = ((blocks(eye).float().T - w).abs() / step).max().item()
        per_row = file.layer(0, ours, "int8", torch.bfloat16, None)
        assert type(per_row).__name__ == "Int8Linear"
        err_row = ((per_row(eye).float().T - w).abs() / step).max().item()
        assert err < 0.015 and err_row > 10 * err, (ours, err, err_row)
        # in fp32 the blocks go to the native kernels where they run; torch's int4 kernel is fast in
        # bf16 only, so without them the blocks stay int8 per row
        in_fp32 = file.layer(0, ours, "q4", torch.float32, None)
        assert type(in_fp32).__name__ == ("NativeBlockLinear" if native.available() else "Int8Linear")
        if native.available():
            err32 = ((in_fp32(eye.float()).T - w).abs() / step).max().item()
            assert err32 < 0.015, (ours, err32)


@pytest.mark.parametrize("method", ["int8", "q4"])
def test_from_float_within_quantization_error_and_dense_above(method):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.02
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    make = Int8Linear.from_float if method == "int8" else q4_from_float
    layer = make(w, torch.bfloat16, keep_dense=True, dense_above=2)
    ref = F.linear(x.float(), w)
    one = layer(x[:1]).float()  # quantized kernel (1 row <= 2)
    rel = (one - ref[:1]).abs().max().item() / ref.abs().max().item()
    # expected error of a dot product of 256 terms: int8 (step max/127) ~1%, int4 (step range/15) ~10%
    assert rel < (0.02 if method == "int8" else 0.15)
    assert rel > 1e-4  # the quantized path really ran (a dense bf16 product would be ~1e-3 from fp32)
    many = layer(x)  # 5 rows > 2: the dense copy
    assert torch.equal(many, F.linear(x, w.to(torch.bfloat16)))
    # without a dense copy, every row count goes through the quantized kernel
    plain = make(w, torch.bfloat16)
    assert plain.dense is None and torch.allclose(plain(x)[:1].float(), one, atol=1e-2)


@pytest.mark.skipif(not fp16_available(), reason="this torch has no FBGEMM fp16 linear for this processor")
def test_fp16_linear_is_the_fp16_weights_product_at_any_batch_size():
    """fp32 in and out; the product of the fp16-rounded weights to fp32 accuracy (accumulated
    in fp32), and a row's output the same alone or in a batch to ~1e-6, as a fp32 matmul's."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 256) * 0.02, torch.randn(96)
    layer = Fp16Linear.from_float(w, torch.float32, bias)
    x = torch.randn(64, 256)
    ref = F.linear(x.double(), w.half().double(), bias.double())
    for rows in (1, 5, 64):
        got = layer(x[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        assert (got.double() - ref[:rows]).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert torch.allclose(layer(x)[:1], layer(x[:1]), rtol=0, atol=1e-5)
    assert (F.linear(x, w) - layer(x)).abs().max().item() > 0  # really the fp16 weights
    three_d = layer(x.view(4, 16, 256))
    assert torch.equal(three_d.view(64, 96), layer(x))
    with pytest.raises(ValueError, match="fp32 activations"):
        Fp16Linear.from_float(w, torch.bfloat16)


@pytest.mark.skipif(not native.tiles_available(), reason="the tiled products need AVX-512 VNNI or AVX2")
def test_fp32_layer_with_a_bf16_copy_above_its_tiles(monkeypatch):
    """As `auto` builds a 4-bit GGUF model where oneDNN multiplies bf16 in AMX tiles (forced here):
    fp32 activations on the 4-bit blocks up to `dense_above` rows (the row kernels, then the tiles),
    a bf16 copy above them, the result in fp32; in bf16 the copy alone serves the steps above."""
    monkeypatch.setattr(quant_linear, "amx_packing", lambda: True)
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.02
    layer = q4_from_float(w, torch.float32, keep_dense=True, dense_above=32)
    assert layer.product.tiles is not None
    assert isinstance(layer.dense, DenseLinear) and layer.dense.dtype == torch.bfloat16
    plain = q4_from_float(w, torch.float32)  # no copy: the blocks at every row count
    x = torch.randn(40, 256)
    for rows in (1, 4, 5, 32):
        assert torch.equal(layer(x[:rows]), plain(x[:rows]))
    many = layer(x)  # 40 rows > 32: the bf16 copy
    assert many.dtype == torch.float32
    assert torch.equal(many, F.linear(x.bfloat16(), w.bfloat16()).float())
    assert q4_from_float(w, torch.bfloat16, keep_dense=True, dense_above=16).product.tiles is None
    assert q4_from_float(w, torch.float32, keep_dense=True, dense_above=4).product.tiles is None


def test_q4_needs_groups_of_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        q4_from_float(torch.randn(8, 40), torch.bfloat16)


# -- the default model from its shipped Q4_1 GGUF --------------------------------------------
CHATS = [
    ([{"role": "user", "content": "What is the capital of France?"}], "Paris"),
    ([{"role": "user", "content": "What is 2 + 3? Answer with the number."}], "5"),
]


def _ids(tokenizer, chat):
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _greedy(model, tokenizer, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    runner = ModelRunner(model, num_slots=1024, max_requests=2, max_context=2048)
    logits = runner.forward([SeqStep(0, 0, ids, list(range(1, len(ids) + 1)), len(ids) - 1, prefix_slots=[])])
    first = logits[-1].clone()
    out: list[int] = []
    while len(out) < n:
        out.append(int(logits[-1].argmax()))
        if out[-1] == tokenizer.eos_token_id:
            break
        pos = len(ids) + len(out) - 1
        logits = runner.forward([SeqStep(0, pos, [out[-1]], [pos + 1], 0)])
    return out, first


@pytest.mark.slow
@pytest.mark.parametrize("method", ["q4", "int8", "fp16"])
def test_default_model_quantized_logits_and_greedy(default_source, smol_tokenizer, method):
    """fp16: the fp32 model with fp16 weights (auto without native bf16); not from the GGUF's blocks."""
    src = default_source
    dense = build_model(src.arch, src.weights_dir, torch.float32, "cpu", max_positions=2048)
    if method == "fp16" and not fp16_available():
        pytest.skip("this torch has no FBGEMM fp16 linear for this processor")
    dtype = torch.float32 if method == "fp16" else torch.bfloat16
    quant = build_model(src.arch, src.weights_dir, dtype, "cpu", max_positions=2048,
                        quant=QuantChoice(method, None, "test"), gguf=src.gguf_path)
    names = {"q4": FOUR_BIT, "int8": "Int8Linear", "fp16": "Fp16Linear"}
    assert type(quant.layers[0].mlp.down_proj).__name__ == names[method]
    # (the head: the file's Q8_0 embedding as two 4-bit halves under q4)
    assert type(quant.host_head).__name__ == (EIGHT_BIT_BLOCKS if method == "q4" else names[method])
    native_kernels = method == "q4" and FOUR_BIT == "NativeBlockLinear"
    references = []
    for chat, answer in CHATS:
        ids = _ids(smol_tokenizer, chat)
        ref_out, ref_logits = _greedy(dense, smol_tokenizer, ids, 24)
        references.append(ref_logits)
        out, logits = _greedy(quant, smol_tokenizer, ids, 24)
        # q4 reads the very Q4_1 and Q8_0 values the dense model was converted from: what is left
        # is bf16 activations and scales (torch's int4 kernel) or int8 activation blocks (the
        # native kernels, as llama.cpp's); int8 requantizes every layer
        bound = {"q4": 0.07 if native_kernels else 0.035, "int8": 0.1, "fp16": 1e-3}[method]
        scale = ref_logits.abs().max().item()
        rel = (logits - ref_logits).abs().max().item() / scale
        assert rel < bound, rel
        if native_kernels:
            # as llama.cpp on the same file, the first token of the France chat flips between two
            # that the fp32 model has 0.1 apart ('The' / 'L'): the pick is within the error's reach
            assert ref_logits[int(logits.argmax())] >= ref_logits.max() - 2 * bound * scale
            continue
        assert int(logits.argmax()) == int(ref_logits.argmax())
        assert answer in smol_tokenizer.decode(out), smol_tokenizer.decode(out)
    if native_kernels:
        # as `auto` serves the default model: where the tiled products run, fp32 activations and the
        # file's blocks at every step; else bf16 with a dense copy above a few rows
        tiled = native.tiles_available()
        served = build_model(src.arch, src.weights_dir, torch.float32 if tiled else dtype, "cpu", max_positions=2048,
                             quant=QuantChoice(method, None if tiled else auto_dense_above(), "test"),
                             gguf=src.gguf_path)
        answered = 0
        for (chat, answer), ref_logits in zip(CHATS, references):
            out, logits = _greedy(served, smol_tokenizer, _ids(smol_tokenizer, chat), 24)
            scale = ref_logits.abs().max().item()
            assert ref_logits[int(logits.argmax())] >= ref_logits.max() - 2 * bound * scale
            # France's first token is a near-tie ('The' / 'L', 0.1 apart in fp32) that the 4-bit weights flip
            # (fp32 on the tiles: 'L' on both instruction sets; llama.cpp picks 'L' on the same file too), and
            # then the answer is another: where the first token is the fp32 model's, so is the answer
            if int(logits.argmax()) == int(ref_logits.argmax()):
                answered += 1
                assert answer in smol_tokenizer.decode(out), smol_tokenizer.decode(out)
        assert answered, "every chat's first token flipped"


@pytest.mark.slow
@pytest.mark.skipif(not native.available() or not fp16_available(),
                    reason="needs the native kernels and FBGEMM's fp16 linear")
@pytest.mark.parametrize("tiled", [False, True])
def test_default_model_in_fp32_on_the_native_kernels(default_source, smol_tokenizer, tiled):
    """As `auto` serves on a processor without native bf16: the GGUF's 4-bit and 8-bit blocks on
    the native kernels with fp32 activations for steps of few rows, and above them (a prompt) the
    tiled products (AVX-512 VNNI or AVX2) or an fp16 copy in FBGEMM; logits within the int8 activation
    blocks' error of the fp32 model, the answers."""
    if tiled and not native.tiles_available():
        pytest.skip("the tiled products need AVX-512 VNNI or AVX2")
    src = default_source
    dense = build_model(src.arch, src.weights_dir, torch.float32, "cpu", max_positions=2048)
    rows = 16 if tiled else auto_dense_above("float32")  # the prompt's rows below: on the tiles, or the copy
    quant = build_model(src.arch, src.weights_dir, torch.float32, "cpu", max_positions=2048,
                        quant=QuantChoice("q4", None if tiled else rows, "test"), gguf=src.gguf_path)
    down = quant.layers[0].mlp.down_proj
    assert type(down).__name__ == "NativeBlockLinear"
    if tiled:
        assert down.dense is None and down.product.tiles is not None
    else:
        assert type(down.dense).__name__ == ("DenseLinear" if amx_packing() else "Fp16Linear")
    assert type(quant.host_head).__name__ == "NativeBlockLinear"
    answered = 0
    for chat, answer in CHATS:
        ids = _ids(smol_tokenizer, chat)
        _, ref_logits = _greedy(dense, smol_tokenizer, ids[-rows:], 1)  # a prompt short enough for the kernels
        _, logits = _greedy(quant, smol_tokenizer, ids[-rows:], 1)
        scale = ref_logits.abs().max().item()
        assert (logits - ref_logits).abs().max().item() < 0.07 * scale
        out, first = _greedy(quant, smol_tokenizer, ids, 24)
        _, ref_first = _greedy(dense, smol_tokenizer, ids, 1)
        # the first token comes from the head on the kernels (one row): as llama.cpp's on the same
        # file, the France chat's may flip between two the fp32 model has 0.1 apart ('The' / 'L')
        assert ref_first[int(first.argmax())] >= ref_first.max() - 0.14 * scale
        if int(first.argmax()) == int(ref_first.argmax()):
            assert answer in smol_tokenizer.decode(out), smol_tokenizer.decode(out)
            answered += 1
    assert answered >= 1


@pytest.mark.slow
def test_four_bit_share_is_remembered_beside_the_converted_weights(default_source, tmp_path):
    from radixlm.runtime.model.gguf_quant import four_bit_share

    assert four_bit_share(default_source.gguf_path, tmp_path) == 1.0  # Q4_1 layers: parsed, then written
    assert (tmp_path / "gguf_four_bit_share").read_text() == "1.0"
    (tmp_path / "gguf_four_bit_share").write_text("0.25")
    assert four_bit_share(default_source.gguf_path, tmp_path) == 0.25  # read back, not parsed again
    assert four_bit_share(default_source.gguf_path, tmp_path / "missing") == 1.0  # no cache dir: parsed
    assert not (tmp_path / "missing").exists()
