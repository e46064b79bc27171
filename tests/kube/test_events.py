"""record(): an Event on the run naming its instances and their Nodes (on the Node only without a run
object), found by involvedObject, counted instead of repeated."""

from __future__ import annotations

from dataclasses import replace

from kubernetes_asyncio import client as k8s

from resilienced.kube.cluster import KubeCluster
from resilienced.kube.events import EventRecorder
from resilienced.kube.events import ObjectRef
from resilienced.model import Target
from .conftest import LOCAL_BOUND_S, instance, node, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer
import pytest

pytestmark = pytest.mark.integration


async def _world(cluster: KubeCluster, kubeapi: KubeApiServer) -> tuple[dict, dict, dict]:
    job = kubeapi.create(rayjob("train"))
    rc = kubeapi.create(raycluster("train-rc", owner_job=job))
    n1 = kubeapi.create(node("n1", instance(1)))
    await cluster.caches.wait_ready()
    await cluster.caches.rayjobs.wait_until(lambda c: c.get("ml", "train") is not None, timeout=LOCAL_BOUND_S)
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
    return n1, job, rc


def _target(ray_job: str | None = "ml/train", ray_cluster: str | None = "ml/train-rc") -> Target:
    return Target(instance_id=instance(1), node="n1", ray_cluster=ray_cluster, ray_job=ray_job,
                  ray_node_ids=(), checkpoint_uri=None)


async def test_an_event_goes_on_the_rayjob_naming_the_instance_and_its_node(cluster: KubeCluster,
                                                                           kubeapi: KubeApiServer, api) -> None:
    """Issue #45: on the run only (one write, not two); the Node keeps its taint, and the Event names it."""
    n1, job, _ = await _world(cluster, kubeapi)
    await cluster.record(_target(), reason="SpotInterruption", message="i-1 interrupted at 12:00", warning=True)
    core = k8s.CoreV1Api(api)
    on_node = await core.list_namespaced_event(
        "default", field_selector=f"involvedObject.kind=Node,involvedObject.name=n1,involvedObject.uid={n1['metadata']['uid']}")
    on_job = await core.list_namespaced_event(
        "ml", field_selector=f"involvedObject.kind=RayJob,involvedObject.uid={job['metadata']['uid']}")
    assert len(on_node.items) == 0 and len(on_job.items) == 1
    event = on_job.items[0]
    assert (event.reason, event.message, event.type, event.count) == (
        "SpotInterruption", f"i-1 interrupted at 12:00 [instances: {instance(1)} on Node n1]", "Warning", 1)
    assert event.reporting_component == "resilienced.io/resilienced"
    assert event.reporting_instance == "replica-a"
    assert event.involved_object.api_version == "ray.io/v1" and event.involved_object.namespace == "ml"
    assert event.source.component == "resilienced"


async def test_a_cluster_without_job_gets_the_event(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    _, _, rc = await _world(cluster, kubeapi)
    await cluster.record(_target(ray_job=None), reason="Drained", message="m")
    kinds = sorted((e["involvedObject"]["kind"], e["involvedObject"]["uid"]) for e in kubeapi.list("events"))
    assert kinds == [("RayCluster", rc["metadata"]["uid"])]


async def test_a_gangs_event_names_every_instance_and_its_node(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    """A wave's merged target (issue #45): the other instances' Nodes from the Node cache."""
    await _world(cluster, kubeapi)
    kubeapi.create(node("n2", instance(2)))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n2") is not None, timeout=LOCAL_BOUND_S)
    target = _target()
    gang = replace(target, facts=replace(target.facts, instance_ids=(instance(1), instance(2), instance(3))))
    await cluster.record(gang, reason="Requeued", message="requeued")
    (event,) = kubeapi.list("events")
    assert event["involvedObject"]["kind"] == "RayJob"
    assert event["message"] == (f"requeued [instances: {instance(1)} on Node n1, {instance(2)} on Node n2, "
                                f"{instance(3)} (no Node)]")


async def test_a_target_without_a_run_object_gets_its_event_on_the_node(cluster: KubeCluster,
                                                                       kubeapi: KubeApiServer) -> None:
    n1, _, _ = await _world(cluster, kubeapi)
    await cluster.record(_target(ray_job=None, ray_cluster=None), reason="Drained", message="m")
    (event,) = kubeapi.list("events")
    assert (event["involvedObject"]["kind"], event["involvedObject"]["uid"], event["message"]) == (
        "Node", n1["metadata"]["uid"], "m")


async def test_a_repeat_counts_instead_of_adding(cluster: KubeCluster, kubeapi: KubeApiServer) -> None:
    await _world(cluster, kubeapi)
    for _ in range(3):
        await cluster.record(_target(), reason="SpotInterruption", message="same notice", warning=True)
    await cluster.record(_target(), reason="SpotInterruption", message="another notice", warning=True)
    events = kubeapi.list("events")
    where = f" [instances: {instance(1)} on Node n1]"
    assert sorted((e["involvedObject"]["kind"], e["message"], e["count"]) for e in events) == [
        ("RayJob", "another notice" + where, 1), ("RayJob", "same notice" + where, 3)]
    assert kubeapi.counts()[("create", "events")] == 2 and kubeapi.counts()[("patch", "events")] == 2
    assert kubeapi.counts()[("get", "events")] == 0


async def test_a_restarted_replica_finds_its_event(kubeapi: KubeApiServer, api) -> None:
    ref = ObjectRef(api_version="v1", kind="Node", name="n1", uid="u1")
    first = EventRecorder(api, replica="replica-a")
    name = await first.emit(ref, reason="SpotInterruption", message="m")
    restarted = EventRecorder(api, replica="replica-a")
    assert await restarted.emit(ref, reason="SpotInterruption", message="m") == name
    (event,) = kubeapi.list("events")
    assert event["count"] == 2
    assert [(r.verb, r.status) for r in kubeapi.requests] == [("create", 201), ("create", 409), ("get", 200), ("patch", 200)]


async def test_each_replica_reports_as_itself(kubeapi: KubeApiServer, api) -> None:
    ref = ObjectRef(api_version="v1", kind="Node", name="n1", uid="u1")
    await EventRecorder(api, replica="replica-a").emit(ref, reason="R", message="m")
    await EventRecorder(api, replica="replica-b").emit(ref, reason="R", message="m")
    assert sorted(e["reportingInstance"] for e in kubeapi.list("events")) == ["replica-a", "replica-b"]


async def test_an_expired_event_is_written_again(kubeapi: KubeApiServer, api) -> None:
    ref = ObjectRef(api_version="v1", kind="Node", name="n1", uid="u1")
    recorder = EventRecorder(api, replica="replica-a")
    name = await recorder.emit(ref, reason="R", message="m")
    kubeapi.delete("events", name, namespace="default")  # the API server's event TTL ran out
    await recorder.emit(ref, reason="R", message="m")
    (event,) = kubeapi.list("events")
    assert event["count"] == 1


async def test_long_messages_are_cut(kubeapi: KubeApiServer, api) -> None:
    ref = ObjectRef(api_version="v1", kind="Node", name="n1", uid="u1")
    await EventRecorder(api, replica="r").emit(ref, reason="R", message="x" * 5000)
    (event,) = kubeapi.list("events")
    assert len(event["message"]) == 1024


async def test_a_burst_of_the_same_event_is_counted_once_each_and_never_lost(kubeapi: KubeApiServer, api) -> None:
    import asyncio

    job = kubeapi.create(rayjob("train"))
    recorder = EventRecorder(api, replica="replica-a")
    ref = ObjectRef(api_version="ray.io/v1", kind="RayJob", name="train", uid=job["metadata"]["uid"], namespace="ml")

    await asyncio.gather(*(recorder.emit(ref, reason="Draining", message="same") for _ in range(10)))

    (event,) = [e for e in kubeapi.list("events", namespace="ml") if e["reason"] == "Draining"]
    assert event["count"] == 10
    assert kubeapi.counts().get(("create", "events"), 0) == 1  # one create, then patches: no 409 race


async def test_an_event_recorded_once_per_key_is_one_event_across_replicas_and_retries(
    kubeapi: KubeApiServer, api
) -> None:
    """A replica taking a run over (or a retry) does not record the same work again (issue #14:
    the campaign counted repeated Draining / CheckpointDurable Events after a takeover)."""
    ref = ObjectRef(api_version="ray.io/v1", kind="RayJob", name="train", uid="u1", namespace="ml")
    a, b = EventRecorder(api, replica="replica-a"), EventRecorder(api, replica="replica-b")
    name = await a.emit(ref, reason="Draining", message="drained at 12:00:01", once="ev-1")
    await a.emit(ref, reason="Draining", message="drained at 12:00:01", once="ev-1")  # a retry
    assert await b.emit(ref, reason="Draining", message="drained at 12:00:09", once="ev-1") == name  # a takeover
    assert await EventRecorder(api, replica="replica-a").emit(  # a restart
        ref, reason="Draining", message="drained at 12:00:20", once="ev-1") == name
    await b.emit(ref, reason="Draining", message="drained at 12:05:00", once="ev-2")  # another notice
    await b.emit(ref, reason="CheckpointDurable", message="step 5", once="ev-1")  # another reason
    events = sorted((e["reason"], e["message"], e["count"], e["reportingInstance"]) for e in kubeapi.list("events"))
    assert events == [("CheckpointDurable", "step 5", 1, "replica-b"),
                      ("Draining", "drained at 12:00:01", 1, "replica-a"),
                      ("Draining", "drained at 12:05:00", 1, "replica-b")]
    assert kubeapi.counts()[("patch", "events")] == 0 and kubeapi.counts()[("get", "events")] == 0
