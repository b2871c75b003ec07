"""The native block products (radixlm.runtime.kernels.native): exact against the same arithmetic
in torch (int8 activation blocks, integer block sums, fp32 scales) for each instruction set the
processor runs (AVX-512 VNNI, AVX2) and each activation dtype (bf16, fp32), the same with and
without worker threads, and their layout's errors."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.kernels.cpuinfo import cpuinfo_field

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llvmlite and AVX-512 VNNI or AVX2")
ISAS = native.supported_isas()


def _blocks(bits: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (n, k), generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    minimum = (-(2 ** (bits - 1)) * scale - torch.rand(n, k // 32, generator=g) * 1e-3).half().float()
    return u, scale, minimum


def _reference(x: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in float64: x to int8 per block of 32 (round half to even), exact
    integer block sums, then the scales."""
    rows, k = x.shape
    xb = x.float().view(rows, k // 32, 32)
    amax = xb.abs().amax(-1)
    da = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    qa = torch.round(xb * inv[..., None])  # (torch.round: half to even, as the kernel's rint)
    ub = u.double().view(u.shape[0], k // 32, 32)
    sums = torch.einsum("rbi,nbi->rnb", qa.double(), ub)  # exact in float64
    sa = (da.double() * qa.double().sum(-1))
    return (sums * (scale.double()[None] * da.double()[:, None]) + minimum.double()[None] * sa[:, None]).sum(-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_product_is_the_int8_block_arithmetic(isa, dtype, bits, rows):
    n, k = 200, 320
    u, scale, minimum = _blocks(bits, n, k, seed=bits * 10 + rows)
    product = native.BlockProduct.affine(u, scale, minimum, bits, dtype, isa)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, :32] = 0  # an all-zero block
    got = product(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    ref = _reference(x, u, scale, minimum)
    # only the fp32 scale products and the order of the fp32 sums differ (then bf16's rounding)
    rtol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), ref, rtol=rtol, atol=rtol / 8 * ref.abs().max().item())
    # and against the weights in fp32: within int8 activation blocks' error
    w = (u.float().view(n, k // 32, 32) * scale[..., None] + minimum[..., None]).view(n, k)
    exact = x.float() @ w.T
    rel = (got.float() - exact).abs().max().item() / exact.abs().max().item()
    assert 1e-4 < rel < 0.02


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_output_is_the_fp32_output_rounded_to_nearest_even(bits):
    """The bf16 products round their fp32 sums as torch does (to nearest, ties to even), in
    integers (no bf16 instructions needed); and both instruction sets give the same sums."""
    u, scale, minimum = _blocks(bits, 96, 256, seed=bits)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(bits)).bfloat16()
    outputs = []
    for isa in ISAS:
        as_bf16 = native.BlockProduct.affine(u, scale, minimum, bits, torch.bfloat16, isa)(x)
        as_fp32 = native.BlockProduct.affine(u, scale, minimum, bits, torch.float32, isa)(x.float())
        assert torch.equal(as_bf16, as_fp32.bfloat16())
        outputs.append(as_fp32)
    for other in outputs[1:]:  # the integer sums are equal; the fp32 sums' order may differ
        assert torch.allclose(other, outputs[0], rtol=1e-6, atol=1e-6 * outputs[0].abs().max().item())


def test_rows_are_the_same_alone_in_a_batch_and_across_threads():
    u, scale, minimum = _blocks(4, 131, 128, seed=3)
    product = native.BlockProduct.affine(u, scale, minimum, 4)
    x = torch.randn(6, 128).bfloat16()
    together = product(x)
    for r in range(6):
        assert torch.equal(product(x[r : r + 1]), together[r : r + 1])
    threads = torch.get_num_threads()
    with native.busy():
        assert torch.get_num_threads() == 1 or native.library().workers == 0
        busy = product(x)
    assert torch.get_num_threads() == threads
    assert torch.equal(busy, together)


TILED = pytest.mark.skipif(not native.tiles_available(), reason="the tiled products need AVX-512 VNNI or AVX2")
TILE_ISAS = [i for i in ISAS if i in native_ir.TILE_ISAS]


@TILED
@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [5, 8, 13, 40])
def test_tiled_product_is_the_int8_block_arithmetic(isa, dtype, bits, rows):
    """More than MAX_ROWS rows on the tiled layout (rows padded to TILE_M, the padding cut off):
    the same arithmetic as the row kernels, on the caller's threads and on torch's OpenMP pool,
    in each instruction set's form."""
    n, k = 208, 320
    u, scale, minimum = _blocks(bits, n, k, seed=bits * 10 + rows)
    product = native.BlockProduct.affine(u, scale, minimum, bits, dtype, isa, tiled=True)
    assert product.tiles is not None and product.tiles.shape == (n // 16, k // 32 * native_ir.TILE_BYTES[bits])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, :32] = 0
    got = product(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    # the row kernels' results (MAX_ROWS rows a call): the same integer sums, the fp32 sums in
    # another order (then bf16's rounding)
    rows_kernel = torch.cat([product(x[r : r + native_ir.MAX_ROWS]) for r in range(0, rows, native_ir.MAX_ROWS)])
    top = rows_kernel.float().abs().max().item()
    rtol = 8e-3 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), rows_kernel.float(), rtol=rtol, atol=rtol / 8 * top)
    with native.busy():  # on our own workers, not the OpenMP pool
        assert torch.allclose(product(x).float(), rows_kernel.float(), rtol=rtol, atol=rtol / 8 * top)
    w = (u.float().view(n, k // 32, 32) * scale[..., None] + minimum[..., None]).view(n, k)
    exact = x.float() @ w.T
    assert 1e-4 < (got.float() - exact).abs().max().item() / exact.abs().max().item() < 0.02


@pytest.mark.skipif(len(TILE_ISAS) < 2, reason="needs a processor that runs both forms of the tiles")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_tiles_equal_in_both_instruction_sets(dtype, bits):
    """The AVX2 tiles (vpmaddubsw in 16 bits, four passes a tile; 8-bit weights as two nibble
    halves) sum the same integers as AVX-512 VNNI's and scale them in the same order: equal to
    the bit, over a stretch of rows longer than AVX2's (TILE_CACHE)."""
    n, k, rows = 64, 1536, 40
    u, scale, minimum = _blocks(bits, n, k, seed=bits)
    u[:16, :64] = 2**bits - 1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1] = 0
    x[2, :64] = 127.0  # rows at the quantization's extremes: the 16-bit sums' largest
    x[3, :64] = -127.0
    got = [native.BlockProduct.affine(u, scale, minimum, bits, dtype, isa, tiled=True)(x) for isa in ("avx512", "avx2")]
    assert torch.equal(got[0], got[1])


@TILED
def test_tiled_layout_needs_whole_tiles():
    u, scale, minimum = _blocks(4, 24, 128, seed=0)
    with pytest.raises(ValueError, match="divisible by 16"):
        native.pack_tiles(u, scale, minimum, 4)
    product = native.BlockProduct.affine(u, scale, minimum, 4, tiled=True)  # 24 rows: no tiles, MAX_ROWS at a time
    assert product.tiles is None and product(torch.randn(9, 128).bfloat16()).shape == (9, 24)


@pytest.mark.skipif(not native.prefill_available(), reason="the native prompt attention needs AVX-512 VNNI or AVX2")
@pytest.mark.parametrize("isa", [i for i in ISAS if i in native_ir.PREFILL_ISAS])  # (each plan's registers)
@pytest.mark.parametrize(("n", "total"), [(1, 1), (3, 3), (5, 20), (16, 16), (37, 37), (100, 300), (260, 260)])
def test_prompt_attention_is_causal_attention(isa, n, total):
    """Queries at the last n of `total` positions (the first a cached prefix), 9 heads over 3 KV
    heads, tokens strided as the model's q/k/v tensor gives them: SDPA's result with the mask."""
    gen = torch.Generator().manual_seed(n + total)
    q = torch.randn(n, 15, 64, generator=gen)[:, :9]
    k, v = torch.randn(total, 3, 64, generator=gen), torch.randn(total, 3, 64, generator=gen)
    got = native.prefill_attention(q, k, v, 0.125, isa).view(n, 9, 64)
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=0.125,
        enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32 q"):
        native.prefill_attention(q.bfloat16(), k, v, 0.125)


@pytest.mark.skipif(not native.prefill_bf16_available(), reason="the bf16 prompt attention needs avx512_bf16")
@pytest.mark.parametrize(("n", "total"), [(1, 1), (3, 3), (5, 20), (16, 16), (37, 37), (100, 301), (260, 260)])
def test_bf16_prompt_attention_is_causal_attention_of_rounded_inputs(n, total):
    """bf16 products (`vdpbf16ps`, fp32 sums): the causal attention of q, K, V rounded to bf16,
    within the rounding of the weights to bf16 too (odd key counts: a pair's second key past the
    end weighs 0); not the fp32 kernel's result."""
    gen = torch.Generator().manual_seed(n + total)
    q = torch.randn(n, 15, 64, generator=gen)[:, :9]
    k, v = torch.randn(total, 3, 64, generator=gen), torch.randn(total, 3, 64, generator=gen)
    got = native.prefill_attention(q, k, v, 0.125, bf16=True).view(n, 9, 64)
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    qr, kr, vr = (t.bfloat16().double() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(0, 1)[None], kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], attn_mask=mask, scale=0.125,
        enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-2)
    assert (got.double() - ref).abs().mean() < 2e-3
    fp32 = native.prefill_attention(q, k, v, 0.125).view(n, 9, 64)
    assert not torch.equal(got, fp32)
    with pytest.raises(ValueError, match="avx512_bf16|AVX-512 BF16"):
        native.prefill_attention(q, k, v, 0.125, "avx2", bf16=True)


@pytest.mark.skipif(not native.prefill_available(), reason="the native prompt attention needs AVX-512 VNNI or AVX2")
@pytest.mark.parametrize("bf16", [False, True] if native.prefill_bf16_available() else [False])
def test_prompt_attention_reads_pool_rows_at_slots(bf16):
    """K and V read in place from a host pool's layer (K and V sharing a row, slots in any order):
    the result of the same rows gathered first; slots out of range refused."""
    gen = torch.Generator().manual_seed(5)
    n, total = 21, 53
    pool = torch.randn(100, 6, 64, generator=gen)  # [slots, K heads then V heads, d]
    slots = torch.randperm(100, generator=gen)[:total]
    q = torch.randn(n, 15, 64, generator=gen)[:, :9]
    k, v = pool[:, :3], pool[:, 3:]
    got = native.prefill_attention(q, k, v, 0.125, bf16=bf16, slots=slots)
    gathered = native.prefill_attention(q, k[slots].contiguous(), v[slots].contiguous(), 0.125, bf16=bf16)
    assert torch.equal(got, gathered)
    with pytest.raises(ValueError, match="slots"):
        native.prefill_attention(q, k, v, 0.125, slots=torch.tensor([0] * 30 + [100]))


def test_rotation_takes_a_tokens_row_of_the_tables():
    """cos and sin are one row a token ([T, 1, d]), not one a head; at most all heads rotate."""
    x = torch.zeros(4, 10, 64)
    with pytest.raises(ValueError, match="cos and sin"):
        native.rotate(x, torch.zeros(4, 10, 64), torch.zeros(4, 10, 64), 8)
    with pytest.raises(ValueError, match="heads to rotate"):
        native.rotate(x, torch.zeros(4, 1, 64), torch.zeros(4, 1, 64), 11)


def test_prompt_attention_refuses_positions_past_32_bits():
    """The kernel compares positions as 32-bit lanes: 2^31 keys (a view of one) get a clear error
    before anything is laid out."""
    kv = torch.zeros(1, 3, 64).expand(2**31, 3, 64)
    with pytest.raises(ValueError, match="2\\^31 positions"):
        native.prefill_attention(torch.zeros(1, 9, 64), kv, kv, 0.125)


def test_prompt_attention_preferred_per_processor(tmp_path, monkeypatch):
    """AVX-512 wherever it runs; AVX2 on AMD processors (the vendor read from /proc/cpuinfo)."""
    amd, intel = tmp_path / "amd", tmp_path / "intel"
    amd.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2\n")
    intel.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    def vendor(cpuinfo):  # as native._vendor reads it
        return cpuinfo_field(("vendor_id",), cpuinfo) or ""

    assert (vendor(amd), vendor(intel), vendor(tmp_path / "none")) == ("AuthenticAMD", "GenuineIntel", "")
    for isa, maker, preferred in [("avx512", "GenuineIntel", True), ("avx2", "AuthenticAMD", True),
                                  ("avx2", "GenuineIntel", False), (None, "AuthenticAMD", False)]:
        monkeypatch.setattr(native, "isa", lambda isa=isa: isa)
        monkeypatch.setattr(native, "_vendor", lambda maker=maker: maker)
        assert native.prefill_preferred() is preferred


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_swiglu_is_silu_times_up(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96, generator=gen) * 4
    gate_up[0, :5] = torch.tensor([0.0, -0.0, 100.0, -100.0, -200.0])  # saturated both ways, zeros
    ref = torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:]
    torch.testing.assert_close(native.swiglu(gate_up), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        native.swiglu(torch.randn(2, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_is_index_copy(dtype):
    dst = torch.zeros(10, 6, 64, dtype=dtype)
    src = torch.randn(3, 15, 64).to(dtype)[:, 9:]  # rows strided, as the K/V heads of a q/k/v tensor
    slots = torch.tensor([7, 2, 5])
    ref = dst.clone().index_copy_(0, slots, src)
    native.write_rows(dst, slots, src)
    assert torch.equal(dst, ref)
    with pytest.raises(ValueError, match="int64 slots"):
        native.write_rows(dst, slots.int(), src)


def test_rms_norm_errors_say_what_it_takes():
    with pytest.raises(ValueError, match="multiple of 16"):
        native.rms_norm(torch.randn(2, 24), torch.randn(24), 1e-6)
    with pytest.raises(ValueError, match="fp32"):
        native.rms_norm(torch.randn(2, 32).bfloat16(), torch.randn(32).bfloat16(), 1e-6)


def test_layout_and_input_errors():
    u, scale, minimum = _blocks(4, 8, 96, seed=0)
    with pytest.raises(ValueError, match="divisible by 64"):
        native.pack_blocks(u, scale, minimum, 4)
    u, scale, minimum = _blocks(4, 8, 128, seed=0)
    product = native.BlockProduct.affine(u, scale, minimum, 4)
    assert product.packed.shape == (8, 2 * native_ir.CHUNK_BYTES[4])
    assert product(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 8)  # a step whose rows all left
    with pytest.raises(ValueError, match=r"\[rows, 128\] bf16"):
        product(torch.randn(1, 128))
    with pytest.raises(ValueError, match=r"\[rows, 128\] fp32"):
        native.BlockProduct.affine(u, scale, minimum, 4, torch.float32)(torch.randn(1, 128).bfloat16())
    with pytest.raises(ValueError, match="bf16 or fp32"):
        native.BlockProduct.affine(u, scale, minimum, 4, torch.float16)
    with pytest.raises(ValueError, match=r"\[rows, 128\] bf16"):
        product(torch.randn(1, 64).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", native_ir.HEAD_DIMS)
def test_decode_attention_reads_the_pool_in_place(dim, dtype):
    """Against fp32 softmax attention over the gathered K/V: sequences of different lengths (one
    of a single key), grouped query heads, q rows strided as in the layer loop's rotated tensor."""
    torch.manual_seed(dim)
    heads, kv_heads = 6, 2
    pool = torch.randn(900, 2 * kv_heads, dim).to(dtype)
    lengths = [1, 130, 517]
    longest = max(lengths)
    slots = torch.zeros(len(lengths), longest, dtype=torch.int64)  # padding reads slot 0
    for b, n in enumerate(lengths):
        slots[b, :n] = torch.randperm(899)[:n] + 1
    rotated = torch.randn(len(lengths), heads + 2 * kv_heads, dim).to(dtype)
    q = rotated[:, :heads]
    scale = dim**-0.5
    got = native.decode_attention(q, pool, slots.flatten(), torch.tensor(lengths), kv_heads, scale)
    assert got.shape == (len(lengths), heads * dim) and got.dtype == dtype
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-5
    for b, n in enumerate(lengths):
        kv = pool[slots[b, :n]].float()
        k, v = kv[:, :kv_heads].transpose(0, 1), kv[:, kv_heads:].transpose(0, 1)  # [kv_heads, n, d]
        group = q[b].float().view(kv_heads, heads // kv_heads, dim)
        ref = torch.softmax(group @ k.transpose(1, 2) * scale, -1) @ v
        assert torch.allclose(got[b].float(), ref.reshape(-1), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="head size"):
        native.decode_attention(q.half(), pool, slots.flatten(), torch.tensor(lengths), kv_heads, scale)
    with pytest.raises(ValueError, match="int64 slots"):
        native.decode_attention(q, pool, slots.flatten().int(), torch.tensor(lengths), kv_heads, scale)
