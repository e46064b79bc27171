"""Test controls of the emulator: injected errors, delays, dropped connections, the request log."""

from __future__ import annotations

import aiohttp
import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("status", [500, 503, 429], ids=["500", "503", "429"])
async def test_injected_errors_answer_n_times_then_recover(api: k8s.ApiClient, kubeapi: KubeApiServer, status: int) -> None:
    kubeapi.create(node("n1", None))
    fault = kubeapi.fail(verb="list", resource="nodes", status=status, times=2, retry_after=3 if status == 429 else None)
    core = k8s.CoreV1Api(api)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            await core.list_node()
        assert err.value.status == status
    if status == 429:
        assert err.value.headers["Retry-After"] == "3"
    assert [n.metadata.name for n in (await core.list_node()).items] == ["n1"]
    assert fault.hits == 2


async def test_faults_match_verb_resource_and_name(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(node("n1", None), node("n2", None))
    kubeapi.fail(verb="get", resource="nodes", name="n2", times=None)
    core = k8s.CoreV1Api(api)
    assert (await core.read_node("n1")).metadata.name == "n1"
    await core.list_node()
    for _ in range(3):
        with pytest.raises(ApiException):
            await core.read_node("n2")
    kubeapi.clear_faults()
    assert (await core.read_node("n2")).metadata.name == "n2"


async def test_status_zero_drops_the_connection(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """aiohttp retries an idempotent request once on a dropped connection: one drop goes unseen."""
    once = kubeapi.fail(verb="list", resource="nodes", status=0, times=1)
    assert (await k8s.CoreV1Api(api).list_node()).items == []
    assert once.hits == 1 and [r.status for r in kubeapi.requests] == [0, 200]
    twice = kubeapi.fail(verb="list", resource="nodes", status=0, times=2)
    with pytest.raises(aiohttp.ClientError):
        await k8s.CoreV1Api(api).list_node()
    assert twice.hits == 2
    assert (await k8s.CoreV1Api(api).list_node()).items == []


async def test_a_delay_provokes_a_client_timeout(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.delay(5.0, verb="list", resource="nodes")
    with pytest.raises(TimeoutError):
        await k8s.CoreV1Api(api).list_node(_request_timeout=0.2)
    assert (await k8s.CoreV1Api(api).list_node(_request_timeout=2)).items == []
    assert [r.status for r in kubeapi.requests] == [499, 200]  # the first caller went away


async def test_a_failing_watch_request(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    from kubernetes_asyncio import watch

    kubeapi.fail(verb="watch", resource="pods", status=503)
    stream = watch.Watch()
    with pytest.raises(ApiException) as err:
        async with stream:
            async for _ in stream.stream(k8s.CoreV1Api(api).list_pod_for_all_namespaces, timeout_seconds=5):
                pass
    assert err.value.status == 503


async def test_request_log_counts_per_verb_and_resource(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    await core.create_node(node("n1", None))
    await core.list_node(label_selector="a=b")
    await core.patch_node("n1", {"spec": {"unschedulable": True}})
    await custom.list_cluster_custom_object("ray.io", "v1", "rayjobs")
    await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayjobs", {
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "j"}, "spec": {}})  # a custom resource names its kind
    await custom.patch_namespaced_custom_object_status("ray.io", "v1", "ml", "rayjobs", "j", {"status": {"x": 1}},
                                                      _content_type="application/merge-patch+json")
    counts = kubeapi.counts()
    assert counts == {
        ("create", "nodes"): 1, ("list", "nodes"): 1, ("patch", "nodes"): 1,
        ("list", "rayjobs.ray.io"): 1, ("create", "rayjobs.ray.io"): 1, ("patch", "rayjobs.ray.io/status"): 1,
    }
    assert kubeapi.verbs_seen() == {
        ("", "nodes", "create"), ("", "nodes", "list"), ("", "nodes", "patch"),
        ("ray.io", "rayjobs", "list"), ("ray.io", "rayjobs", "create"), ("ray.io", "rayjobs/status", "patch"),
    }
    listed = next(r for r in kubeapi.requests if r.verb == "list" and r.resource == "nodes")
    assert listed.label_selector == "a=b"
    patched = next(r for r in kubeapi.requests if r.verb == "patch" and r.resource == "nodes")
    assert patched.content_type == "application/strategic-merge-patch+json"
    kubeapi.reset_log()
    assert kubeapi.counts() == {}
