"""Routing a target to its requeuer; the requeue metric and the Kubernetes Events next to the run."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.model import Capacity, CapacityDecision
from resilienced.kube.events import EventRecorder, ObjectRef
from resilienced.kube.rbac import RBAC_RULES as KUBE_RULES
from resilienced.ops.metrics import Metrics
from resilienced.model import Event, Kind, RunFacts, Target
from resilienced.requeue.router import ReportingRequeuer, RequeueMetrics, RequeueRouter
from tests.requeue.conftest import rbac_of_requeue
from tests.requeue.objects import NS, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer, RbacRule

pytestmark = pytest.mark.integration

BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "spot interrupted twice", reservation_id="cr-0block")
EVENT = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-3", instance_ids=("i-0aaa",))


def target(**facts) -> Target:
    return Target(instance_id="i-0aaa", node=None, ray_cluster=f"{NS}/train", ray_job=f"{NS}/job",
                  ray_node_ids=(), checkpoint_uri=None, facts=RunFacts(**facts))


class EventsOnTheRun:
    """``Cluster.record`` as kubernetes mode does it: a core/v1 Event on the RayJob (real recorder)."""

    mode = "kubernetes"

    def __init__(self, api: k8s.ApiClient, server: KubeApiServer) -> None:
        self.recorder = EventRecorder(api, replica="test")
        self.server = server

    async def record(self, target: Target, *, reason: str, message: str, warning: bool = False,
                     once: str | None = None) -> None:
        ns, name = target.ray_job.split("/")
        job = self.server.get("rayjobs", name, namespace=ns)
        await self.recorder.emit(ObjectRef("ray.io/v1", "RayJob", name, job["metadata"]["uid"], ns),
                                 reason=reason, message=message, warning=warning)


@pytest.fixture
async def kubeapi() -> AsyncIterator[KubeApiServer]:
    events = [RbacRule(verbs=frozenset(r.verbs), api_groups=frozenset(r.api_groups), resources=frozenset(r.resources))
              for r in KUBE_RULES if "events" in r.resources]
    server = KubeApiServer(rbac=rbac_of_requeue() + events)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("labels", "facts", "expected"),
    [({}, {}, "kuberay"), ({"kueue.x-k8s.io/queue-name": "training"}, {}, "kueue"),
     ({}, {"volcano_job": f"{NS}/vcjob"}, "volcano")],
    ids=["plain RayJob -> kuberay", "queue-name label -> kueue", "volcano_job fact -> volcano"],
)
async def test_each_target_goes_to_its_requeuer(api: k8s.ApiClient, kubeapi: KubeApiServer, labels: dict,
                                                facts: dict, expected: str) -> None:
    kubeapi.create(rayjob(labels=labels))
    applier, _ = await RequeueRouter(api).resolve(target(**facts))
    assert applier.kind == expected


async def test_a_cluster_of_a_kueue_rayjob_goes_through_the_rayjob(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    job = kubeapi.create(rayjob(labels={"kueue.x-k8s.io/queue-name": "training"}))
    kubeapi.create(raycluster(owner={"apiVersion": "ray.io/v1", "kind": "RayJob", "name": "job",
                                     "uid": job["metadata"]["uid"], "controller": True}))
    only_cluster = Target(instance_id="i-0aaa", node=None, ray_cluster=f"{NS}/train", ray_job=None,
                          ray_node_ids=(), checkpoint_uri=None)
    applier, resolved = await RequeueRouter(api).resolve(only_cluster)
    assert applier.kind == "kueue" and resolved.ray_job == f"{NS}/job"


async def test_a_requeue_is_counted_and_recorded_once(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(rayjob(), raycluster(), ray_pod("train-gpu-a"))
    metrics = Metrics()
    requeue = ReportingRequeuer(RequeueRouter(api), cluster=EventsOnTheRun(api, kubeapi),
                      metrics=RequeueMetrics(metrics.registry))
    first = await requeue.requeue(target(), decision=BLOCK, event=EVENT)
    assert first.changed
    assert metrics.value("resilienced_requeues_total", capacity="capacity-block") == 1
    assert b'resilienced_requeues_total{capacity="spot"} 0.0' in metrics.render()
    events = kubeapi.list("events", namespace=NS)
    assert [(e["reason"], e["type"], e["involvedObject"]["kind"]) for e in events] == [("Requeued", "Normal", "RayJob")]
    assert "on capacity-block cr-0block after event ev-3" in events[0]["message"]

    second = await requeue.requeue(target(), decision=BLOCK, event=EVENT)  # the same decision again
    assert not second.changed
    assert metrics.value("resilienced_requeues_total", capacity="capacity-block") == 1
    assert len(kubeapi.list("events", namespace=NS)) == 1 and kubeapi.list("events", namespace=NS)[0]["count"] == 1


async def test_a_wait_is_counted_and_warned_about(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(rayjob(), raycluster())
    metrics = Metrics()
    requeue = ReportingRequeuer(RequeueRouter(api), cluster=EventsOnTheRun(api, kubeapi),
                      metrics=RequeueMetrics(metrics.registry))
    wait = CapacityDecision(Capacity.WAIT, "On-Demand is not allowed")
    result = await requeue.requeue(target(), decision=wait, event=EVENT)
    assert result.capacity is Capacity.WAIT
    assert metrics.value("resilienced_requeues_total", capacity="wait") == 1
    [event] = kubeapi.list("events", namespace=NS)
    assert event["reason"] == "RequeueWaiting" and event["type"] == "Warning"


async def test_a_dry_run_is_neither_counted_nor_recorded(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(rayjob(), raycluster(), ray_pod("train-gpu-a"))
    metrics = Metrics()
    requeue = ReportingRequeuer(RequeueRouter(api), cluster=EventsOnTheRun(api, kubeapi),
                      metrics=RequeueMetrics(metrics.registry))
    result = await requeue.requeue(target(), decision=BLOCK, event=EVENT, dry_run=True)
    assert result.changes and result.dry_run
    assert metrics.value("resilienced_requeues_total", capacity="capacity-block") == 0
    assert kubeapi.list("events", namespace=NS) == []


async def test_a_refused_requeue_is_warned_about_and_not_counted(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """A RayCluster with upgradeStrategy Recreate outside Kueue: nothing moves, a Warning Event says why."""
    cluster = raycluster()
    cluster["spec"]["upgradeStrategy"] = {"type": "Recreate"}
    kubeapi.seed(rayjob(), cluster, ray_pod("train-gpu-a"))
    metrics = Metrics()
    requeue = ReportingRequeuer(RequeueRouter(api), cluster=EventsOnTheRun(api, kubeapi),
                      metrics=RequeueMetrics(metrics.registry))
    result = await requeue.requeue(target(), decision=BLOCK, event=EVENT)
    assert result.refused and result.kind == "kuberay"
    assert metrics.value("resilienced_requeues_total", capacity="capacity-block") == 0
    [event] = kubeapi.list("events", namespace=NS)
    assert event["reason"] == "RequeueRefused" and event["type"] == "Warning" and "Recreate" in event["message"]


async def test_a_recreate_rayjob_under_kueue_goes_through_kueue(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    job = rayjob(labels={"kueue.x-k8s.io/queue-name": "training"})
    job["spec"]["rayClusterSpec"]["upgradeStrategy"] = {"type": "Recreate"}
    kubeapi.seed(job, raycluster())
    applier, _ = await RequeueRouter(api).resolve(target())
    # templates change only while Kueue holds the RayJob suspended.  (KubeRay v1.6+ would refuse this
    # spec, ValidateRayClusterUpgradeOptions: upgradeStrategy is not for a RayJob's cluster; the
    # routing holds whatever the spec says.)
    assert applier.kind == "kueue"


def cluster_selector_job() -> dict:
    """A RayJob that runs on an existing RayCluster (``spec.clusterSelector``), labelled for Kueue."""
    job = rayjob(labels={"kueue.x-k8s.io/queue-name": "training"})
    del job["spec"]["rayClusterSpec"]
    job["spec"]["clusterSelector"] = {"ray.io/cluster": "train"}
    return job


async def test_a_rayjob_with_a_cluster_selector_is_not_kueues_and_its_cluster_moves(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    # Kueue skips such a RayJob (kubernetes-sigs/kueue v0.19.2 pkg/controller/jobs/rayjob/rayjob_controller.go
    # Skip(): len(spec.clusterSelector) > 0; v0.14 refuses the label in its webhook): no Workload ever exists.
    kubeapi.seed(cluster_selector_job(), raycluster(), ray_pod("train-gpu-a"))
    result = await RequeueRouter(api).requeue(target(), decision=BLOCK, event=EVENT)
    assert result.kind == "kuberay" and result.changed, result.reason
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    assert all(g["template"]["spec"]["nodeSelector"]["karpenter.k8s.aws/capacity-reservation-id"] == "cr-0block"
               for g in cluster["spec"]["workerGroupSpecs"])
    assert kubeapi.list("pods", namespace=NS) == []  # the worker replaced for KubeRay to recreate


async def test_a_rayjob_with_a_cluster_selector_on_a_queued_cluster_goes_through_the_cluster(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(cluster_selector_job(), raycluster(labels={"kueue.x-k8s.io/queue-name": "training"}))
    applier, resolved = await RequeueRouter(api).resolve(target())
    assert applier.kind == "kueue" and resolved.ray_job is None and resolved.ray_cluster == f"{NS}/train"
