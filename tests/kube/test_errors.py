"""Library errors become resilienced errors at the boundary, and calls recover once the API does."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from resilienced.errors import BackendUnavailable, PermanentError, ResilienceError
from resilienced.kube.cluster import KubeCluster, KubeOptions
from resilienced.kube.api import KubeStatusError, translate
from resilienced.model import Target
from .conftest import LOCAL_BOUND_S, FAST, GcsFactory, node
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


def _api(status: int, body: str = '{"kind":"Status","reason":"X","message":"m"}') -> ApiException:
    err = ApiException(status=status, reason="R")
    err.body = body
    return err


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        (_api(500), BackendUnavailable, None),
        (_api(503), BackendUnavailable, None),
        (_api(504), BackendUnavailable, None),
        (_api(429), BackendUnavailable, None),
        (ApiException(status=0, reason="client error"), BackendUnavailable, None),
        (_api(403), KubeStatusError, 403),
        (_api(401), KubeStatusError, 401),
        (_api(404), KubeStatusError, 404),
        (_api(409), KubeStatusError, 409),
        (_api(410), KubeStatusError, 410),
        (_api(422, "not json"), KubeStatusError, 422),
        (asyncio.TimeoutError(), BackendUnavailable, None),
        (aiohttp.ServerDisconnectedError(), BackendUnavailable, None),
        (aiohttp.ClientConnectionError("refused"), BackendUnavailable, None),
        (aiohttp.ClientPayloadError("truncated"), BackendUnavailable, None),
        (ConnectionResetError(), BackendUnavailable, None),
        (ValueError("Malformed JSON response"), BackendUnavailable, None),
    ],
    ids=["500", "503", "504", "429", "status-0", "403", "401", "404", "409", "410", "422", "timeout",
         "disconnected", "connection", "payload", "reset", "malformed-watch"],
)
def test_every_library_error_is_translated(error: BaseException, expected: type, status: int | None) -> None:
    translated = translate(error, verb="patch", resource="nodes")
    assert isinstance(translated, expected) and isinstance(translated, ResilienceError)
    assert "patch nodes" in str(translated)
    if status is not None:
        assert isinstance(translated, PermanentError) and translated.status == status


def test_429_carries_retry_after_as_the_delay() -> None:
    translated = translate(_api(429), verb="list", resource="pods", headers={"Retry-After": "7"})
    assert isinstance(translated, BackendUnavailable) and translated.delay == 7.0


def test_403_names_verb_and_resource() -> None:
    translated = translate(_api(403), verb="patch", resource="nodes")
    assert isinstance(translated, PermanentError)
    assert "may not patch nodes" in str(translated)


def _target(node_name: str = "n1") -> Target:
    return Target(instance_id="i-00000000000000001", node=node_name, ray_cluster=None, ray_job=None,
                  ray_node_ids=(), checkpoint_uri=None)


@pytest.mark.parametrize("status", [500, 503, 429], ids=["500", "503", "429"])
async def test_api_errors_are_backend_unavailable_then_recover(
    cluster: KubeCluster, kubeapi: KubeApiServer, status: int
) -> None:
    kubeapi.create(node("n1", "i-00000000000000001"))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
    kubeapi.fail(verb="patch", resource="nodes", status=status, times=1)
    with pytest.raises(BackendUnavailable) as err:
        await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    assert err.value.backend == "kubernetes"
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    assert kubeapi.get("nodes", "n1")["spec"]["taints"][0]["key"] == "resilienced.io/interruption"


async def test_a_request_timeout_is_backend_unavailable(kubeapi: KubeApiServer, api, gcs: GcsFactory) -> None:
    kubeapi.create(node("n1", "i-00000000000000001"))
    options = KubeOptions(cache=FAST.cache, request_timeout_s=0.2)
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=options) as kube:
        await kube.caches.wait_ready()
        kubeapi.delay(5.0, verb="create", resource="events")
        with pytest.raises(BackendUnavailable) as err:
            await kube.record(_target(), reason="SpotInterruption", message="m")
        assert "timed out" in str(err.value)
        await kube.record(_target(), reason="SpotInterruption", message="m")
    assert [e["count"] for e in kubeapi.list("events")] == [1]


async def test_forbidden_is_permanent_and_names_the_call(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", "i-00000000000000001"))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
    kubeapi.fail(verb="patch", resource="nodes", status=403)
    with pytest.raises(PermanentError) as err:
        await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    assert "patch nodes" in str(err.value) and not isinstance(err.value, BackendUnavailable)


async def test_an_unreachable_api_server_is_backend_unavailable(gcs: GcsFactory) -> None:
    server = KubeApiServer()
    await server.start()
    client = server.api_client()
    try:
        async with KubeCluster(client, ray_control_factory=gcs, replica="r", options=FAST) as kube:
            await kube.caches.wait_ready()
            await server.stop()
            with pytest.raises(BackendUnavailable):
                await kube.record(_target(), reason="SpotInterruption", message="m")
    finally:
        await client.close()


async def test_connect_reads_a_kubeconfig(kubeapi: KubeApiServer, tmp_path) -> None:
    from kubernetes_asyncio import client as k8s

    from resilienced.kube.api import connect

    kubeapi.create(node("n1", None))
    client = await connect(kubeconfig=kubeapi.write_kubeconfig(tmp_path / "config"))
    async with client:
        assert [n.metadata.name for n in (await k8s.CoreV1Api(client).list_node()).items] == ["n1"]


async def test_connect_without_credentials_is_a_config_error(tmp_path) -> None:
    from resilienced.errors import ConfigError
    from resilienced.kube.api import connect

    with pytest.raises(ConfigError) as err:
        await connect(kubeconfig=tmp_path / "absent")
    assert err.value.setting == "kubeconfig"
