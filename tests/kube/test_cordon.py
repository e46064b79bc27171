"""cordon(): one NoSchedule taint, by patch, kept through conflicts, never duplicated."""

from __future__ import annotations

from datetime import datetime, timezone

from resilienced.kube.cluster import KubeCluster
from resilienced.kube.marks import DEADLINE_ANNOTATION, EVENT_ANNOTATION, TAINT_KEY
from resilienced.model import Target
from .conftest import LOCAL_BOUND_S, eventually, instance, node
from tests.support.kubeapi import KubeApiServer
import pytest

pytestmark = pytest.mark.integration

OTHER = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _target(name: str = "n1") -> Target:
    return Target(instance_id=instance(1), node=name, ray_cluster="ml/rc", ray_job=None,
                  ray_node_ids=(), checkpoint_uri=None)


async def _cached(cluster: KubeCluster, name: str = "n1") -> None:
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, name) is not None, timeout=LOCAL_BOUND_S)


async def test_cordon_adds_one_taint_and_keeps_the_others(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", instance(1), taints=[OTHER]))
    await _cached(cluster)
    deadline = datetime(2026, 3, 1, 12, 2, tzinfo=timezone.utc)
    await cluster.cordon(_target(), reason="spot_interruption", deadline=deadline)
    stored = kubeapi.get("nodes", "n1")
    assert stored["spec"]["taints"] == [OTHER, {"key": TAINT_KEY, "value": "spot_interruption", "effect": "NoSchedule"}]
    assert stored["metadata"]["annotations"][DEADLINE_ANNOTATION] == "2026-03-01T12:02:00Z"
    verbs = {(r.verb, r.content_type) for r in kubeapi.requests if r.resource == "nodes" and r.verb not in ("list", "watch")}
    assert verbs == {("patch", "application/strategic-merge-patch+json")}  # a patch, never a replace


async def test_cordon_is_idempotent(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    await cluster.caches.nodes.wait_until(lambda c: bool((c.get(None, "n1") or {}).get("spec", {}).get("taints")), timeout=LOCAL_BOUND_S)
    kubeapi.reset_log()
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    await cluster.cordon(_target(), reason="rebalance_recommendation", deadline=None)
    assert [t["key"] for t in kubeapi.get("nodes", "n1")["spec"]["taints"]] == [TAINT_KEY]
    assert kubeapi.requests == []  # the cache already shows the taint: nothing to send


async def test_cordon_from_a_stale_cache_rereads_and_retries(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    kubeapi.drop_watches()
    kubeapi.fail(verb="watch", resource="nodes", status=503, times=None)  # the cache stops following
    await eventually(lambda: kubeapi.open_watches < 4, what="the nodes watch to stop")
    kubeapi.patch("nodes", "n1", body={"spec": {"taints": [OTHER]}})  # another controller, unseen by the cache
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    assert [t["key"] for t in kubeapi.get("nodes", "n1")["spec"]["taints"]] == ["nvidia.com/gpu", TAINT_KEY]
    writes = [(r.verb, r.status) for r in kubeapi.requests if r.resource == "nodes" and r.verb in ("get", "patch")]
    assert writes == [("patch", 409), ("get", 200), ("patch", 200)]
    kubeapi.clear_faults()


async def test_cordon_of_a_tainted_node_read_after_a_conflict_sends_nothing_more(
    cluster: KubeCluster, kubeapi: KubeApiServer
) -> None:
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    kubeapi.drop_watches()
    kubeapi.fail(verb="watch", resource="nodes", status=503, times=None)
    await eventually(lambda: kubeapi.open_watches < 4, what="the nodes watch to stop")
    kubeapi.patch("nodes", "n1", body={"spec": {"taints": [{"key": TAINT_KEY, "value": "x", "effect": "NoSchedule"}]}})
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    assert len(kubeapi.get("nodes", "n1")["spec"]["taints"]) == 1
    kubeapi.clear_faults()


async def test_cordon_of_a_vanished_node_is_a_no_op(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    await cluster.caches.wait_ready()
    await cluster.cordon(_target("gone"), reason="state_change", deadline=None)
    assert [(r.verb, r.status) for r in kubeapi.requests if r.resource == "nodes" and r.verb == "get"] == [("get", 404)]


async def test_taint_value_is_label_safe(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    await cluster.cordon(_target(), reason="EC2 Spot Instance Interruption Warning!", deadline=None)
    (taint,) = kubeapi.get("nodes", "n1")["spec"]["taints"]
    assert taint["value"] == "EC2-Spot-Instance-Interruption-Warning"


async def test_a_cordon_claim_names_its_event_and_is_made_once(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    """``ports.CordonClaims``: the cordon that stands for a run-less notice's event claim names the
    event; asked again for that event it is ``decided``, for another ``taken``; no Node, ``gone``."""
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    assert cluster.cordon_claimable(instance(1), event_id="e-1")
    assert not cluster.cordon_claimable(instance(2), event_id="e-1")  # no Node for it in the cache
    assert await cluster.cordon_claim(instance(1), event_id="e-1", reason="spot_interruption", deadline=None) == "cordoned"
    assert kubeapi.get("nodes", "n1")["metadata"]["annotations"][EVENT_ANNOTATION] == "e-1"
    assert await cluster.cordon_claim(instance(1), event_id="e-1", reason="spot_interruption", deadline=None) == "decided"
    assert await cluster.cordon_claim(instance(1), event_id="e-2", reason="spot_interruption", deadline=None) == "taken"
    assert await cluster.cordon_claim(instance(2), event_id="e-1", reason="spot_interruption", deadline=None) == "gone"
    await cluster.caches.nodes.wait_until(lambda c: bool((c.get(None, "n1") or {}).get("spec", {}).get("taints")),
                                          timeout=LOCAL_BOUND_S)
    assert cluster.cordon_claimable(instance(1), event_id="e-1") and not cluster.cordon_claimable(instance(1), event_id="e-2")
    assert [t["key"] for t in kubeapi.get("nodes", "n1")["spec"]["taints"]] == [TAINT_KEY]


async def test_a_plain_cordon_drops_the_event_a_lifted_cordon_had_decided(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    """The annotation says which cordon is on the Node: a cordon lifted by hand (the taint removed,
    the annotation left) and made again for a notice with a run does not keep the old event's name."""
    kubeapi.create(node("n1", instance(1)))
    await _cached(cluster)
    assert await cluster.cordon_claim(instance(1), event_id="e-1", reason="spot_interruption", deadline=None) == "cordoned"
    kubeapi.patch("nodes", "n1", body={"spec": {"taints": []}})  # an operator uncordons it
    await cluster.caches.nodes.wait_until(lambda c: not (c.get(None, "n1") or {}).get("spec", {}).get("taints"),
                                          timeout=LOCAL_BOUND_S)
    await cluster.cordon(_target(), reason="spot_interruption", deadline=None)
    stored = kubeapi.get("nodes", "n1")
    assert [t["key"] for t in stored["spec"]["taints"]] == [TAINT_KEY]
    assert EVENT_ANNOTATION not in (stored["metadata"].get("annotations") or {})
