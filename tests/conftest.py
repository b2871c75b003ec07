"""Shared fixtures: the default model's files, converted once per machine into the cache dir."""

from __future__ import annotations

import pytest

from radixlm.runtime.config import default_cache_dir
from radixlm.runtime.model.source import DEFAULT_MODEL, ModelSource, resolve_model


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    return resolve_model(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def smol_tokenizer(default_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_source.tokenizer_dir))


def pytest_configure(config):
    """The suite's process holds millions of long-lived objects (tokenizers, grammar vocabularies,
    JSONSchemaBench data, session fixtures) that every full collection walks again; with Python's
    default thresholds (700, 10, 10) collections took ~5% of the suite's time. Collect less often
    (dropped engines are still collected after each module, below)."""
    import gc

    gc.set_threshold(50_000, 20, 20)


@pytest.fixture(scope="module", autouse=True)
def _collect_engines_after_each_module():
    """Engines a module's tests dropped are freed before the next module starts theirs: an engine
    in a reference cycle holds its KV pool (GBs, zeroed at start on the CPU) until the cyclic
    collector runs, which large tensors barely prompt (the pytest process reached 18 GB and was
    killed on a 24 GiB machine)."""
    yield
    import gc

    gc.collect()
