"""DSL fixtures: one fp32 Engine and one fp32 server for the whole tests/lang session, with the
same options, so greedy results are comparable exactly."""

from __future__ import annotations

import pytest
from server_harness import start_server

API_KEY = "dsl-test-key"
OPTIONS = {"dtype": "float32", "max_total_tokens": 8000, "context_length": 2048}


@pytest.fixture(scope="session")
def engine(default_source):
    from radixlm.runtime.engine import Engine

    e = Engine(**OPTIONS)
    yield e
    e.shutdown()


@pytest.fixture(scope="session")
def engine_backend(engine):
    from radixlm.lang.backends.engine import EngineBackend

    return EngineBackend(engine)


@pytest.fixture(scope="session")
def server(default_source):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS.items()]
    with start_server(*args, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="session")
def endpoint(server):
    from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint

    return RuntimeEndpoint(server.url, api_key=API_KEY)
