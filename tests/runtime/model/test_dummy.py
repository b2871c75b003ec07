"""Dummy (random) weights of a named config run end to end with the stand-in tokenizer."""

from __future__ import annotations

import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.model.source import DUMMY_CONFIGS, resolve_model

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_dummy_config_shapes(name, tmp_path, default_source):
    src = resolve_model(f"dummy:{name}", default_source.weights_dir.parent)
    assert src.weights_dir is None and src.tokenizer_dir == default_source.tokenizer_dir
    assert src.arch.num_heads % src.arch.num_kv_heads == 0


def test_dummy_qwen_generates():
    e = Engine("dummy:qwen2.5-0.5b", max_total_tokens=512, context_length=256)
    out = e.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 4
    assert all(0 <= t < 151936 for t in out["output_ids"])
    e.shutdown()
