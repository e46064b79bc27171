"""The watch caches follow the API server: list once, watch, re-list on 410, back off on errors."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.errors import BackendUnavailable
from resilienced.kube.cache import CacheOptions, Informer
from resilienced.kube.cluster import KubeCluster, KubeOptions
from resilienced.kube.cache import Source
from .conftest import LOCAL_BOUND_S, FAST, GcsFactory, eventually, instance, node, ray_node, ray_pod, raycluster
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


async def _settled(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    await cluster.caches.wait_ready()
    await eventually(lambda: kubeapi.open_watches == len(cluster.caches.informers), what="every cache's watch to open")


async def test_a_pod_added_after_start_is_found_through_the_watch(
    cluster: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory
) -> None:
    kubeapi.seed(node("n1", instance(1)), raycluster("rc", head_ip="10.0.0.1"))
    await _settled(cluster, kubeapi)
    lists_before = kubeapi.counts()[("list", "pods")]
    assert (await cluster.locate(instance_ids=[instance(1)])).targets == ()

    kubeapi.create(ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.0.2"))
    gcs.nodes["10.0.0.1:6379"] = [ray_node(1, "10.0.0.2")]
    await cluster.caches.pods.wait_until(lambda c: c.get("ml", "w1") is not None, timeout=LOCAL_BOUND_S)
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert target.ray_node_ids == ("01" * 28,)
    assert kubeapi.counts()[("list", "pods")] == lists_before == 1
    assert cluster.caches.pods.stats.lists == 1 and cluster.caches.pods.stats.events["ADDED"] == 1


async def test_changes_and_deletes_update_the_indices(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.0.2"))
    await _settled(cluster, kubeapi)
    assert [p["metadata"]["name"] for p in cluster.caches.pods.by_index("node", "n1")] == ["w1"]
    kubeapi.patch("pods", "w1", body={"spec": {"nodeName": "n2"}}, namespace="ml")
    await cluster.caches.pods.wait_until(lambda c: bool(c.by_index("node", "n2")), timeout=LOCAL_BOUND_S)
    assert cluster.caches.pods.by_index("node", "n1") == []
    kubeapi.delete("pods", "w1", namespace="ml")
    await cluster.caches.pods.wait_until(lambda c: len(c) == 0, timeout=LOCAL_BOUND_S)
    assert cluster.caches.pods.by_index("node", "n2") == [] and cluster.caches.pods.by_index("cluster", "ml/rc") == []


async def test_pods_without_the_ray_label_are_not_cached(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.seed({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ml"},
                  "spec": {"nodeName": "n1"}}, ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.0.2"))
    await _settled(cluster, kubeapi)
    assert [p["metadata"]["name"] for p in cluster.caches.pods.values()] == ["w1"]
    assert {r.label_selector for r in kubeapi.requests if r.resource == "pods"} == {"ray.io/node-type"}


async def test_410_gone_relists_and_recovers(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(node("n1", instance(1)))
    await _settled(cluster, kubeapi)
    kubeapi.expire_watches()  # every open watch gets ERROR 410, history is compacted
    kubeapi.create(node("n2", instance(2)))
    kubeapi.delete("nodes", "n1")
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n2") is not None and c.get(None, "n1") is None, timeout=LOCAL_BOUND_S)
    assert cluster.caches.nodes.stats.expired == 1 and cluster.caches.nodes.stats.lists == 2
    assert kubeapi.counts()[("list", "nodes")] == 2
    assert cluster.caches.ready()


async def test_a_dropped_watch_resumes_from_its_resource_version_without_a_list(
    cluster: KubeCluster, kubeapi: KubeApiServer
) -> None:
    await _settled(cluster, kubeapi)
    kubeapi.drop_watches()
    kubeapi.create(node("n1", instance(1)))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
    assert kubeapi.counts()[("list", "nodes")] == 1 and kubeapi.counts()[("watch", "nodes")] >= 2


async def test_watch_errors_back_off_and_resume(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    await _settled(cluster, kubeapi)
    kubeapi.fail(verb="watch", resource="nodes", status=503, times=2)
    kubeapi.drop_watches()
    kubeapi.create(node("n1", instance(1)))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
    assert cluster.caches.nodes.stats.errors == 2 and "503" in (cluster.caches.nodes.stats.last_error or "")
    assert kubeapi.counts()[("list", "nodes")] == 1


async def test_a_failing_watch_makes_the_cache_no_answer_until_the_server_is_followed_again(
        cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    """Issue #45: the follow-up judges from the caches only while they follow their server; a cache
    whose watch fails says so (``answers`` false, ``behind`` the error) until an event or a bookmark
    shows it follows again (kube/progress raises NoAnswerYet meanwhile)."""
    await _settled(cluster, kubeapi)
    nodes = cluster.caches.nodes
    assert nodes.answers and nodes.behind is None
    kubeapi.fail(verb="watch", resource="nodes", status=503, times=None)
    kubeapi.drop_watches()
    await eventually(lambda: nodes.stats.errors >= 1, what="a failed watch of nodes")
    assert not nodes.answers and "503" in (nodes.behind or "")
    kubeapi.clear_faults()
    await eventually(lambda: kubeapi.open_watches == len(cluster.caches.informers), what="the nodes watch again")
    assert not nodes.answers  # a watch open again is not yet shown to follow
    kubeapi.send_bookmarks()
    await eventually(lambda: nodes.answers, what="a bookmark on the nodes watch")
    assert nodes.behind is None and kubeapi.counts()[("list", "nodes")] == 1


async def test_bookmarks_advance_the_resource_version(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    await _settled(cluster, kubeapi)
    before = cluster.caches.nodes.resource_version
    kubeapi.create(ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.0.2"))  # moves the global RV
    kubeapi.send_bookmarks()
    await eventually(lambda: cluster.caches.nodes.stats.events["BOOKMARK"] == 1, what="a bookmark")
    assert int(cluster.caches.nodes.resource_version) > int(before)
    assert len(cluster.caches.nodes) == 0  # a bookmark changes no object


async def test_list_errors_keep_locate_waiting_then_answer(kubeapi: KubeApiServer, api, gcs: GcsFactory) -> None:
    kubeapi.seed(node("n1", instance(1)))
    kubeapi.fail(verb="list", resource="nodes", status=500, times=3)
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=FAST) as kube:
        location = await kube.locate(instance_ids=[instance(1)])
        assert location.unresolved == {instance(1): f"Node n1 ({instance(1)}) runs no Ray pods"}
        assert kube.caches.nodes.stats.errors == 3 and kube.caches.nodes.stats.lists == 1


async def test_locate_gives_up_waiting_with_backend_unavailable(kubeapi: KubeApiServer, api, gcs: GcsFactory) -> None:
    kubeapi.fail(verb="list", resource="rayjobs", status=503, times=None)
    options = KubeOptions(cache=FAST.cache, ready_timeout_s=0.3)
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=options) as kube:
        await eventually(lambda: kube.caches.rayjobs.stats.errors >= 1, what="a failed list of rayjobs")
        with pytest.raises(BackendUnavailable) as err:
            await kube.locate(instance_ids=[instance(1)])
        assert "rayjobs.ray.io" in str(err.value) and "503" in str(err.value)
        kubeapi.clear_faults()
        await kube.caches.wait_ready(timeout=LOCAL_BOUND_S)
        assert kube.caches.ready()


async def test_lists_are_paged(kubeapi: KubeApiServer, api) -> None:
    kubeapi.seed(*(node(f"n{i:02d}", instance(i)) for i in range(25)))
    informer = Informer(Source("nodes", k8s.CoreV1Api(api).list_node),
                        options=CacheOptions(page_size=10, backoff_initial_s=0.05))
    informer.start()
    try:
        await asyncio.wait_for(informer.synced.wait(), 5)
        assert len(informer) == 25 and informer.stats.list_pages == 3
    finally:
        await informer.stop()


async def test_stop_ends_the_tasks_and_the_watches(kubeapi: KubeApiServer, api, gcs: GcsFactory) -> None:
    kube = KubeCluster(api, ray_control_factory=gcs, replica="r", options=FAST)
    await kube.start()
    await _settled(kube, kubeapi)
    assert all(i.running for i in kube.caches.informers)
    await kube.stop()
    assert not any(i.running for i in kube.caches.informers)
    await eventually(lambda: kubeapi.open_watches == 0, what="the server to see the watches closed")
    # the autouse fixture also checks that no task is left behind


async def test_a_namespace_restricted_cluster_watches_that_namespace(kubeapi: KubeApiServer, api, gcs: GcsFactory) -> None:
    kubeapi.seed(ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.0.2"),
                 ray_pod("w2", cluster="rc", node_name="n1", ip="10.0.0.3", namespace="other"))
    options = KubeOptions(cache=FAST.cache, namespace="ml")
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=options) as kube:
        await kube.caches.wait_ready()
        assert [p["metadata"]["name"] for p in kube.caches.pods.values()] == ["w1"]
    assert {r.namespace for r in kubeapi.requests if r.resource != "nodes"} == {"ml"}
