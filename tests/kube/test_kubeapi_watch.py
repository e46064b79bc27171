"""Watches as kubernetes_asyncio's ``watch.Watch`` sees them: resourceVersions, selectors, 410, bookmarks.

The tests with a ``kubeapi`` run on the emulator and on the real API server, but those that need
the emulator's own controls (compaction, expiry, dropped watches, bookmarks on demand).  On the
real plane kwok and the node controller write the Nodes a test makes (Ready, a taint taken off,
heartbeats): :func:`mine` keeps the events of the test's own writes.  A watch from a
resourceVersion replays what happened after it, so where the emulator can say that the watch is
open (``open_watches``) the real server need not be asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import LOCAL_BOUND_S, eventually, node, ray_pod
from tests.support.controlplane.facade import RealKubeApi, emulator_only, serve, server_params
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


@pytest.fixture(params=server_params())
async def kubeapi(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The emulator, and the real API server (tests/support/controlplane/facade.py) where the test
    can play there (``emulator_only()`` marks those that cannot)."""
    async with serve(request) as server:
        yield server


class Collector:
    """Runs one watch in a task and keeps (type, name, resourceVersion) of every event."""

    def __init__(self, func: Callable[..., Any], **kwargs: Any) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.error: BaseException | None = None
        self.ended = False
        self._watch = watch.Watch()
        self._task = asyncio.get_running_loop().create_task(self._run(func, kwargs), name="test-watch")

    async def _run(self, func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        try:
            async with self._watch:
                async for event in self._watch.stream(func, **kwargs):
                    raw = event["raw_object"]
                    self.events.append((event["type"], raw["metadata"].get("name", ""), raw["metadata"]["resourceVersion"]))
        except ApiException as err:
            self.error = err
        finally:
            self.ended = True

    def types(self) -> list[tuple[str, str]]:
        return [(t, n) for t, n, _ in self.events]

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def mine(kubeapi: Any, watcher: Collector) -> list[tuple[str, str]]:
    """(type, name) of the events the test's own writes caused (on the emulator: every event)."""
    if isinstance(kubeapi, RealKubeApi):
        return [(t, n) for t, n, rv in watcher.events if kubeapi.caused(t, n, rv)]
    return watcher.types()


async def opened(kubeapi: Any, count: int) -> None:
    """Wait until ``count`` watches are open on the emulator; a watch from a resourceVersion on
    the real server misses nothing written after it, so there is nothing to wait for."""
    if isinstance(kubeapi, KubeApiServer):
        await eventually(lambda: kubeapi.open_watches == count, what=f"{count} watch(es) to open")


@pytest.fixture
async def collectors() -> AsyncIterator[list[Collector]]:
    made: list[Collector] = []
    yield made
    for collector in made:
        await collector.close()


async def test_watch_from_a_list_resource_version_gets_only_later_changes(
    api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]
) -> None:
    kubeapi.create(node("old", None))
    core = k8s.CoreV1Api(api)
    listed = await core.list_node()
    watcher = Collector(core.list_node, resource_version=listed.metadata.resource_version, timeout_seconds=30)
    collectors.append(watcher)
    await opened(kubeapi, 1)
    kubeapi.create(node("new", None))
    kubeapi.patch("nodes", "new", body={"metadata": {"labels": {"x": "y"}}})
    kubeapi.delete("nodes", "old")
    await eventually(lambda: len(mine(kubeapi, watcher)) == 3, what="three events")
    assert mine(kubeapi, watcher) == [("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "old")]
    rvs = [int(rv) for _, _, rv in watcher.events]
    assert rvs == sorted(rvs) and rvs[0] > int(listed.metadata.resource_version)


async def test_watch_resumes_from_history(api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]) -> None:
    first = kubeapi.create(node("a", None))
    kubeapi.create(node("b", None))
    kubeapi.patch("nodes", "a", body={"metadata": {"labels": {"k": "v"}}})
    watcher = Collector(k8s.CoreV1Api(api).list_node, resource_version=first["metadata"]["resourceVersion"], timeout_seconds=30)
    collectors.append(watcher)
    await eventually(lambda: len(mine(kubeapi, watcher)) == 2, what="the two changes after the first")
    assert mine(kubeapi, watcher) == [("ADDED", "b"), ("MODIFIED", "a")]


async def test_watch_without_resource_version_starts_with_the_current_objects(
    api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]
) -> None:
    kubeapi.seed(node("a", None), node("b", None))
    watcher = Collector(k8s.CoreV1Api(api).list_node, timeout_seconds=30)
    collectors.append(watcher)
    await eventually(lambda: len(watcher.events) >= 2, what="synthetic ADDED events")
    assert sorted(watcher.types()[:2]) == [("ADDED", "a"), ("ADDED", "b")]  # (kwok's heartbeats may follow)


async def test_objects_moving_in_and_out_of_a_selector_are_added_and_deleted(
    api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]
) -> None:
    """By a label, and by a field: a pod's phase (its node cannot change: the real server refuses
    a change of ``spec.nodeName``, which the emulator took)."""
    core = k8s.CoreV1Api(api)
    rv = (await core.list_pod_for_all_namespaces()).metadata.resource_version
    watcher = Collector(core.list_pod_for_all_namespaces, label_selector="ray.io/node-type",
                        field_selector="spec.nodeName=n1,status.phase=Running", resource_version=rv, timeout_seconds=30)
    collectors.append(watcher)
    await opened(kubeapi, 1)
    kubeapi.create(ray_pod("w1", cluster="a", node_name="n1", ip="10.0.0.1"))
    kubeapi.create(ray_pod("w2", cluster="a", node_name="n2", ip="10.0.0.2"))  # other node: not seen
    kubeapi.create(ray_pod("w3", cluster="a", node_name="n1", ip="10.0.0.3", phase="Pending"))  # not running yet
    kubeapi.patch("pods", "w1", body={"metadata": {"labels": {"ray.io/node-type": None}}}, namespace="ml")
    kubeapi.patch("pods", "w1", body={"metadata": {"labels": {"ray.io/node-type": "worker"}}}, namespace="ml")
    kubeapi.patch("pods", "w3", body={"status": {"phase": "Running"}}, namespace="ml")
    await eventually(lambda: len(mine(kubeapi, watcher)) == 4, what="four events")
    assert mine(kubeapi, watcher) == [("ADDED", "w1"), ("DELETED", "w1"), ("ADDED", "w1"), ("ADDED", "w3")]


@emulator_only()  # send_bookmarks(): the real server sends them on its own schedule
async def test_bookmarks_only_for_watches_that_ask(api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]) -> None:
    core = k8s.CoreV1Api(api)
    rv = (await core.list_node()).metadata.resource_version
    with_bookmarks = Collector(core.list_node, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=30)
    without = Collector(core.list_node, resource_version=rv, timeout_seconds=30)
    collectors += [with_bookmarks, without]
    await eventually(lambda: kubeapi.open_watches == 2, what="both watches to open")
    kubeapi.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"}, "spec": {}})
    kubeapi.send_bookmarks()
    kubeapi.create(node("n1", None))
    await eventually(lambda: len(with_bookmarks.events) == 2 and len(without.events) == 1, what="events")
    assert with_bookmarks.events[0][0] == "BOOKMARK"
    assert int(with_bookmarks.events[0][2]) == kubeapi.resource_version - 1  # the pod's RV: nodes seen up to it
    assert without.types() == [("ADDED", "n1")]


async def test_periodic_bookmarks() -> None:
    async with KubeApiServer(bookmark_interval=0.05) as server:
        async with server.api_client() as client:
            core = k8s.CoreV1Api(client)
            rv = (await core.list_node()).metadata.resource_version
            watcher = Collector(core.list_node, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=30)
            try:
                await eventually(lambda: len(watcher.events) >= 2, what="periodic bookmarks")
                assert {t for t, _, _ in watcher.events} == {"BOOKMARK"}
            finally:
                await watcher.close()


@emulator_only()  # compact()
async def test_watch_from_a_compacted_resource_version_gets_410(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    core = k8s.CoreV1Api(api)
    rv = (await core.list_node()).metadata.resource_version
    kubeapi.create(node("a", None))
    kubeapi.compact()
    watcher = Collector(core.list_node, resource_version=rv, timeout_seconds=30)
    await eventually(lambda: watcher.ended, what="the watch to end")
    assert isinstance(watcher.error, ApiException) and watcher.error.status == 410
    assert watcher.events == []


async def test_history_limit_compacts_on_its_own() -> None:
    async with KubeApiServer(history=3) as server:
        async with server.api_client() as client:
            core = k8s.CoreV1Api(client)
            rv = (await core.list_node()).metadata.resource_version
            for i in range(5):
                server.create(node(f"n{i}", None))
            watcher = Collector(core.list_node, resource_version=rv, timeout_seconds=30)
            await eventually(lambda: watcher.ended, what="the watch to end")
            assert isinstance(watcher.error, ApiException) and watcher.error.status == 410


@emulator_only()  # expire_watches()
async def test_expire_watches_ends_open_watches_with_410(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    core = k8s.CoreV1Api(api)
    rv = (await core.list_node()).metadata.resource_version
    watcher = Collector(core.list_node, resource_version=rv, timeout_seconds=30)
    await eventually(lambda: kubeapi.open_watches == 1, what="the watch to open")
    kubeapi.expire_watches()
    await eventually(lambda: watcher.ended, what="the watch to end")
    assert isinstance(watcher.error, ApiException) and watcher.error.status == 410
    assert kubeapi.open_watches == 0


async def test_timeout_seconds_ends_the_watch(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    core = k8s.CoreV1Api(api)
    rv = (await core.list_node()).metadata.resource_version  # (the real server's RV 1 is long compacted: 410)
    watcher = Collector(core.list_node, resource_version=rv, timeout_seconds=1)
    await eventually(lambda: watcher.ended, what="the server to end the watch", timeout=LOCAL_BOUND_S)
    assert watcher.error is None
    if isinstance(kubeapi, KubeApiServer):
        assert kubeapi.open_watches == 0


@emulator_only()  # drop_watches(), the request log
async def test_a_dropped_watch_is_resumed_by_the_client_from_its_last_version(
    api: k8s.ApiClient, kubeapi: KubeApiServer, collectors: list[Collector]
) -> None:
    core = k8s.CoreV1Api(api)
    rv = (await core.list_node()).metadata.resource_version
    watcher = Collector(core.list_node, resource_version=rv)  # no timeout: kubernetes_asyncio reconnects
    collectors.append(watcher)
    await eventually(lambda: kubeapi.open_watches == 1, what="the watch to open")
    kubeapi.create(node("a", None))
    await eventually(lambda: len(watcher.events) == 1, what="the first event")
    kubeapi.drop_watches()
    kubeapi.create(node("b", None))
    await eventually(lambda: len(watcher.events) == 2, what="the event after the reconnect")
    assert watcher.types() == [("ADDED", "a"), ("ADDED", "b")]
    watches = [r for r in kubeapi.requests if r.verb == "watch"]
    assert len(watches) == 2


async def test_stop_closes_open_watches() -> None:
    server = KubeApiServer()
    await server.start()
    client = server.api_client()
    try:
        watcher = Collector(k8s.CoreV1Api(client).list_node, resource_version="1", timeout_seconds=60)
        await eventually(lambda: server.open_watches == 1, what="the watch to open")
        await server.stop()
        await eventually(lambda: watcher.ended, what="the watch to end")
        assert server.open_watches == 0
    finally:
        await client.close()
        await server.stop()
