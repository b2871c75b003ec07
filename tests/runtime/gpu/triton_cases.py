"""Triton kernels against their PyTorch references: random ragged attention batches through
two backends over copies of one KV pool, and the fused RMSNorm / RoPE / SiLU*up kernels.

Run as a script (the CPU test does, under TRITON_INTERPRET=1) it checks them on tiny fp32
shapes and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from radixlm.runtime.kernels.attention import ATTENTION_BACKENDS, AttentionMeta
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.rope import RotaryEmbedding, apply_rotary


def tiny_arch(heads: int, kv_heads: int, head_dim: int) -> ModelArch:
    return ModelArch.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=1 << 16,
    ))


def compare(backend: str, arch: ModelArch, seqs: list[tuple[int, int]], dtype: torch.dtype,
            device: str, seed: int) -> float:
    """Relative L2 error of `backend` vs torch on one batch; seqs = (cached_len, new_len) each,
    with slots scattered at random over the pool."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(c + n for c, n in seqs)
    num_slots = total + 64
    pools = [KVPool(arch, num_slots, dtype, device) for _ in range(2)]
    perm = (torch.randperm(num_slots, generator=gen)[:total] + 1).tolist()
    r2t = torch.zeros((len(seqs), max(c + n for c, n in seqs)), dtype=torch.int64)
    shape = (num_slots + 1, arch.num_kv_heads, arch.head_dim)
    k_init, v_init = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for p in pools:  # every slot holds data (unwritten slots must still never be read)
        p.k[0, 1:].copy_(k_init[1:].to(dtype))
        p.v[0, 1:].copy_(v_init[1:].to(dtype))
    q_starts, q_lens, kv_lens, out_slots, off, t = [], [], [], [], 0, 0
    for i, (c, n) in enumerate(seqs):
        r2t[i, : c + n] = torch.tensor(perm[off : off + c + n])
        out_slots += perm[off + c : off + c + n]
        q_starts.append(t)
        q_lens.append(n)
        kv_lens.append(c + n)
        off, t = off + c + n, t + n
    meta = AttentionMeta(torch.tensor(out_slots, device=device), r2t.to(device), list(range(len(seqs))),
                         q_starts, q_lens, kv_lens)
    q = torch.randn(t, arch.num_heads, arch.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(t, arch.num_kv_heads, arch.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(t, arch.num_kv_heads, arch.head_dim, generator=gen).to(device, dtype)
    outs = []
    for name, pool in (("torch", pools[0]), (backend, pools[1])):
        attn = ATTENTION_BACKENDS[name](pool, arch.num_heads, arch.head_dim)
        attn.prepare(meta)
        outs.append(attn.forward(0, q, k, v).double())
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(pools[0].k[0, 1:], pools[1].k[0, 1:]) and torch.equal(pools[0].v[0, 1:], pools[1].v[0, 1:])
    return ((outs[1] - outs[0]).norm() / outs[0].norm()).item()


def fused_errors(arch: ModelArch, tokens: int, dtype: torch.dtype, device: str, seed: int) -> dict[str, float]:
    """Relative errors of the fused kernels against the plain PyTorch they replace."""
    from radixlm.runtime.kernels import fused

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    h, eps = arch.hidden_size, 1e-5
    x, res, w = rand(tokens, h), rand(tokens, h), rand(h)

    def ref_norm(v: torch.Tensor) -> torch.Tensor:
        vf = v.float()
        return w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    errs = {"rms_norm": rel(fused.rms_norm(x, w, eps), ref_norm(x))}
    summed = x + res
    got = fused.rms_norm(x, w, eps, res)
    errs["rms_norm+residual"] = max(rel(got, ref_norm(summed)), rel(res, summed))
    rope = RotaryEmbedding(arch, 4096, device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    qkv = rand(tokens, arch.q_size + 2 * arch.kv_size)
    q, k, _ = qkv.split([arch.q_size, arch.kv_size, arch.kv_size], dim=-1)
    q, k = q.view(tokens, arch.num_heads, -1), k.view(tokens, arch.num_kv_heads, -1)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    q_ref, k_ref = apply_rotary(q.float(), cos, sin), apply_rotary(k.float(), cos, sin)
    fused.rotary_(q, k, positions, rope.cos, rope.sin)  # in place, on views of qkv
    errs["rotary"] = max(rel(q, q_ref), rel(k, k_ref))
    gate_up = rand(tokens, 2 * arch.intermediate_size)
    gate, up = gate_up.chunk(2, dim=-1)
    errs["silu_mul"] = rel(fused.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    errs.update(gemv_errors(device, dtype, gen))
    return errs


def gemv_errors(device: str, dtype: torch.dtype, gen: torch.Generator) -> dict[str, float]:
    """The batch-1 GEMV kernel (and the few-row kernel) against an fp64 product: K a multiple of the block and not, with
    and without bias, N not a multiple of the block."""
    from radixlm.runtime.kernels.gemv import GemvConfig, gemv

    errs = {}
    for n, k, bias in ((40, 96, False), (33, 2048, True), (70, 1500, False)):
        x = torch.randn(1, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        for cfg in (GemvConfig(), GemvConfig(block_n=4, block_k=256)):
            got = gemv(x, w, b, cfg).double()
            errs[f"gemv {n}x{k} bias={bias} {cfg.block_n}x{cfg.block_k}"] = ((got - ref).norm() / ref.norm()).item()
    gate_up = torch.randn(1, 2 * 1500, generator=gen).to(device, dtype)
    w = (torch.randn(50, 1500, generator=gen) * 0.05).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w).double()
    got = gemv(gate_up, w, silu_mul=True).double()
    errs["gemv silu_mul"] = ((got - ref).norm() / ref.norm()).item()
    x = torch.randn(1, 1500, generator=gen).to(device, dtype)
    nw = torch.randn(1500, generator=gen).to(device, dtype)
    xf = x.float()
    normed = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    ref = torch.nn.functional.linear(normed, w).double()
    got = gemv(x, w, norm_weight=nw, eps=1e-5).double()
    errs["gemv rms_norm"] = ((got - ref).norm() / ref.norm()).item()
    stream = torch.randn(1, 50, generator=gen).to(device, dtype)
    ref = (stream + torch.nn.functional.linear(x, w)).double()
    out = gemv(x, w, add_to=stream)
    errs["gemv add_to"] = ((out.double() - ref).norm() / ref.norm()).item() + (0.0 if out is stream else 1.0)
    errs.update(rows_errors(device, dtype, gen))
    return errs


def rows_errors(device: str, dtype: torch.dtype, gen: torch.Generator) -> dict[str, float]:
    """The few-row linear kernel (through `linear_few`, as the model calls it) against PyTorch:
    row counts under and over one 16-row block, K and N not multiples of the block, bias, the
    RMSNorm prologue, SiLU*up and the residual add."""
    from radixlm.runtime.kernels.gemv import GemvConfig, linear_few, linear_rows

    errs = {}
    rel = lambda got, ref: ((got.double() - ref.double()).norm() / ref.double().norm()).item()  # noqa: E731
    for m, n, k in ((3, 70, 1500), (20, 33, 256)):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
        b = torch.randn(n, generator=gen).to(device, dtype)
        ref = x.double() @ w.double().T + b.double()
        errs[f"rows {m}x{n}x{k} bias"] = rel(linear_rows(x, w, b, GemvConfig(16, 64, 4, 2)), ref)
        nw = torch.randn(k, generator=gen).to(device, dtype)
        xf = x.float()
        normed = nw * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        errs[f"rows {m} rms_norm"] = rel(linear_few(x, w, norm_weight=nw, eps=1e-5), normed.double() @ w.double().T)
        gate_up = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w)
        errs[f"rows {m} silu_mul"] = rel(linear_few(gate_up, w, silu_mul=True), ref)
        stream = torch.randn(m, n, generator=gen).to(device, dtype)
        ref = stream.double() + x.double() @ w.double().T
        out = linear_few(x, w, add_to=stream)
        errs[f"rows {m} add_to"] = rel(out, ref) + (0.0 if out is stream else 1.0)
    return errs


def store_kv_matches(device: str, dtype: torch.dtype, gen: torch.Generator) -> bool:
    """The fused K/V pool write equals two index copies (k, v as strided views of a qkv row)."""
    from radixlm.runtime.kernels import fused

    heads, d, t = 3, 24, 5
    qkv = torch.randn(t, 8 * d, generator=gen).to(device, dtype)
    k, v = qkv[:, 2 * d : 5 * d].view(t, heads, d), qkv[:, 5 * d : 8 * d].view(t, heads, d)
    slots = torch.randperm(20, generator=gen)[:t].to(device)
    caches = [torch.zeros(21, heads, d, dtype=dtype, device=device) for _ in range(4)]
    fused.store_kv(caches[0], caches[1], slots, k, v)
    caches[2].index_copy_(0, slots, k)
    caches[3].index_copy_(0, slots, v)
    return torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# (heads, kv_heads, head_dim), batches of (cached_len, new_len): decode only, extend only, mixed
TINY_CASES = [
    ((4, 2, 32), [(0, 1), (37, 1), (100, 1)]),
    ((6, 2, 32), [(0, 45), (70, 20), (5, 1), (0, 1)]),
    ((3, 3, 24), [(33, 17), (0, 1), (64, 1)]),  # head_dim not a power of two, no GQA
]


def main() -> int:
    worst = 0.0
    for seed, ((h, kvh, d), seqs) in enumerate(TINY_CASES):
        err = compare("triton", tiny_arch(h, kvh, d), seqs, torch.float32, "cpu", seed)
        print(f"heads={h} kv_heads={kvh} head_dim={d} seqs={seqs}: rel err {err:.2e}")
        worst = max(worst, err)
    for name, err in fused_errors(tiny_arch(6, 2, 32), 5, torch.float32, "cpu", seed=9).items():
        print(f"{name}: rel err {err:.2e}")
        worst = max(worst, err)
    kv_ok = store_kv_matches("cpu", torch.float32, torch.Generator().manual_seed(3))
    print(f"store_kv equal to index copies: {kv_ok}")
    return 0 if worst < 1e-5 and kv_ok else 1


if __name__ == "__main__":
    sys.exit(main())
