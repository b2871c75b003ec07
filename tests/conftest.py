"""Shared fixtures: the default model's files, converted once per machine into the cache dir.

The suite runs in pytest-xdist workers (pyproject's addopts: ``-n auto --dist loadfile``, one
module's tests in one worker, so module fixtures such as a server start once), each with its share
of the cores for torch: a decode step of the default model is bound by memory bandwidth, which one
thread nearly saturates (bs1 fp32: 59.7 ms a token on one thread, 55.7 ms on two, AVX2 EPYC), so
two workers on two cores run the suite ~1.65x faster than one process on both (docs/benchmarks.md,
"Suite time").
``-n 0`` runs it in one process."""

from __future__ import annotations

import os

import pytest

from radixlm.runtime.config import default_cache_dir
from radixlm.runtime.model.source import DEFAULT_MODEL, ModelSource, resolve_model


def _cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# for the servers the tests start (they inherit it), and for torch here (pytest_configure)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SET_THREADS = _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ
if _SET_THREADS:
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores() // _WORKERS))


@pytest.fixture(scope="session")
def default_source() -> ModelSource:
    return resolve_model(DEFAULT_MODEL, default_cache_dir())


@pytest.fixture(scope="session")
def smol_tokenizer(default_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_source.tokenizer_dir))


GIB_PER_WORKER = 10  # a worker's peak: engines with their KV pools, the servers it starts (2 workers: 13.4 GB)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, as many as the memory holds."""
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):  # (no such sysconf name here: one worker per core)
        return _cores()
    return max(1, min(_cores(), int(mem_gib // GIB_PER_WORKER)))


def pytest_configure(config):
    """The suite's process holds millions of long-lived objects (tokenizers, grammar vocabularies,
    JSONSchemaBench data, session fixtures) that every full collection walks again; with Python's
    default thresholds (700, 10, 10) collections took ~5% of the suite's time. Collect less often
    (dropped engines are still collected after each module, below)."""
    import gc

    gc.set_threshold(50_000, 20, 20)
    if _SET_THREADS:  # (torch may have started before this file set OMP_NUM_THREADS)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module", autouse=True)
def _collect_engines_after_each_module():
    """Engines a module's tests dropped are freed before the next module starts theirs: an engine
    in a reference cycle holds its KV pool (GBs, zeroed at start on the CPU) until the cyclic
    collector runs, which large tensors barely prompt (the pytest process reached 18 GB and was
    killed on a 24 GiB machine)."""
    yield
    import gc

    gc.collect()
