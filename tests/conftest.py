"""Fixtures shared by every topic: the local AWS stand-in (moto server over HTTP), and a
kubernetes_asyncio client to whichever emulated API server (``kubeapi``) a topic's conftest serves."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer

REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server process for the session, stopped at the end (also on failure)."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with MotoServer(log_path=log) as server:
        yield server


@pytest.fixture
def aws(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoServer]:
    """A clean moto (reset before each test) and fake credentials in the environment."""
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    moto_server.reset()
    yield moto_server


@pytest.fixture
async def api(kubeapi: Any) -> AsyncIterator[Any]:
    """A real kubernetes_asyncio ApiClient to the topic's emulated API server, closed afterwards."""
    client = kubeapi.api_client()
    try:
        yield client
    finally:
        await client.close()
