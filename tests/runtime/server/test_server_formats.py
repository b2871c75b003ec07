"""The server with the default number formats (--dtype auto, --quantization auto) reports what it
chose and why, in /get_server_info and /server_info and in its start-up log, and serves with it."""

from __future__ import annotations

import pytest
from server_harness import start_server

from radixlm.runtime.kernels import native
from radixlm.runtime.model.dense_linear import amx_packing, packing_available
from radixlm.runtime.model.formats import choose_attention, choose_dtype, choose_quantization, cpu_flags

pytestmark = pytest.mark.slow


def test_auto_formats_reported_and_served():
    server = start_server("--max-total-tokens", "4096", "--context-length", "1024")
    try:
        # the default model is a Q4_1 GGUF: fp32 where the native tiles run and there is no AMX
        expected = choose_dtype("auto", "cpu", cpu_flags(), native_four_bit=native.tiles_available())
        if native.tiles_available():  # the default model's Q4_1 weights on the tiles: fp32, bf16 flags or not
            assert expected.dtype == "float32"
        quant = choose_quantization("auto", "cpu", expected.dtype, gguf_four_bit=True, auto_dtype=True,  # Q4_1
                                    amx=amx_packing())
        attention = choose_attention("auto", expected.dtype, "cpu", 64, "torch")  # (SmolLM2: head size 64)
        if expected.dtype == "float32" and native.prefill_bf16_available():
            assert attention.dtype == "bfloat16"
        for route in ("/get_server_info", "/server_info"):
            status, info = server.get(route)
            engine = info["engine"]
            assert status == 200
            assert (engine["dtype"], engine["dtype_reason"]) == (expected.dtype, expected.reason)
            assert (engine["quantization"], engine["quantization_reason"]) == (quant.method, quant.reason)
            assert engine["quant_dense_above"] == quant.dense_above
            assert (engine["attention_dtype"], engine["attention_dtype_reason"]) == (attention.dtype, attention.reason)
            # q4 in bf16 keeps a dense copy of each of the 30 layers' 4 matrices, packed where oneDNN
            # multiplies bf16 (the head stays int8 and keeps its dense copy too); in fp32 only where
            # it does so in AMX tiles (the copy in bf16), else none
            copies = expected.dtype == "bfloat16" or quant.dense_above is not None and amx_packing()
            packed = 30 * 4 + 1 if copies and packing_available() else 0
            assert engine["packed_weights"] == packed
            # the 4-bit layers and the 8-bit head on the native kernels, where they run
            native_products = 30 * 4 + 1 if quant.method == "q4" and native.available() else 0
            assert engine["native_products"] == native_products
            assert info["engine_config"]["model"]["dtype"] == "auto"
        assert server.get("/get_model_info")[1]["dtype"] == expected.dtype
        out = server.generate({"text": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                       "<|im_start|>assistant\n",
                               "sampling_params": {"temperature": 0, "max_new_tokens": 12}})
        assert "Paris" in out["text"]
    finally:
        log = server.log()
        assert server.stop() == 0
    assert f"dtype {expected.dtype}: {expected.reason}" in log
    assert f"quantization {quant.method}: {quant.reason}" in log
    assert f"prompt attention in {attention.dtype}: {attention.reason}" in log
    assert ("packed once for oneDNN" in log) == (packed > 0)
    assert ("native VNNI kernels" in log) == (native_products > 0)
