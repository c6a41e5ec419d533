"""Fixtures of the server tests: one real ``leanserve serve`` on the default model for the whole session."""

from __future__ import annotations

import pytest
from server_helpers import ServerProcess

# Context length C of the shared server: small, so the length cases stay fast on a CPU.
SERVER_MAX_MODEL_LEN = 512


@pytest.fixture(scope="session")
def server():
    """The shared server: default model, 256 MiB KV cache, C = 512, an API key (clients send it)."""
    srv = ServerProcess(["--kv-cache-memory", str(256 << 20), "--max-model-len", str(SERVER_MAX_MODEL_LEN)]).start()
    yield srv
    status = srv.stop()
    assert status == 0, f"server exit status {status}\n{srv.stderr()}"


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(autouse=True)
def _server_still_healthy(request):
    """After every test that used the shared server: it still answers /health with 200."""
    yield
    if "server" not in request.fixturenames:
        return
    srv = request.getfixturevalue("server")
    assert srv.healthy(), srv.stderr()[-3000:]
