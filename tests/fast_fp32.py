"""The number format of the tests that compare engines with each other (batched with alone,
overlap with the plain loop, engine with server): fp32 activations, so a row's result does not
depend on the batch it runs in beyond ~1e-6, with the fastest weights that keep that: fp16 in
FBGEMM's fp16 GEMM where this torch has it (about twice the fp32 matmul's speed at a few rows on
2 cores), else dense fp32. Tests that compare with HF transformers' fp32 model keep dense fp32."""

from __future__ import annotations

from radixlm.runtime.kernels.quant import fp16_available

ENGINE: dict[str, str] = {"dtype": "float32", **({"quantization": "fp16"} if fp16_available() else {})}
SERVER: list[str] = [f"--{k}={v}" for k, v in ENGINE.items()]
