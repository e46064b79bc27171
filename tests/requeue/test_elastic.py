"""Elastic runs on the emulated API: capacity for the lost workers only, the survivors never stopped.

KubeRay's worker reconciliation is played by ``KubeRaySim.scale_workers`` (v1.7.0 rules, cited
there); Kueue's Workload objects are built as ``kueue_sim.workload_for`` builds them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone

from kubernetes_asyncio import client as k8s

from resilienced.capacity.request import CapacityRequest
from resilienced.model import Capacity, CapacityDecision
from resilienced.kube.locate import instance_id_of
from resilienced.model import Event, Kind, RunFacts, Target
from resilienced.requeue.kuberay import KubeRayRequeuer
from resilienced.requeue.kueue import KueueRequeuer
from resilienced.requeue.router import ReportingRequeuer, RequeueRouter
from resilienced.requeue.elastic import LostWorker, plan_groups
from resilienced.requeue.placement import Placement
from tests.requeue.kuberay_sim import KubeRaySim
from tests.requeue.kueue_sim import workload_for
from tests.requeue.objects import NS, node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer
import pytest

pytestmark = pytest.mark.integration

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "spot interrupted twice", reservation_id="cr-0block")
SPOT = CapacityDecision(Capacity.SPOT, "spot healthy")
WAIT = CapacityDecision(Capacity.WAIT, "no capacity anywhere")
RESERVED = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
            "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
SPOT_SELECTOR = {"karpenter.sh/capacity-type": "spot"}
WRITES = {"patch", "delete", "create", "update"}
QUEUED = {"kueue.x-k8s.io/queue-name": "training"}


def event(event_id: str, instance: str) -> Event:
    return Event(kind=Kind.SPOT_INTERRUPTION, event_id=event_id, instance_ids=(instance,))


def iid(kubeapi: KubeApiServer, node_name: str) -> str:
    found = instance_id_of(kubeapi.get("nodes", node_name))
    assert found
    return found


def target(instance: str, *, job: bool = True, elastic: bool = True, **facts) -> Target:
    return Target(instance_id=instance, node=None, ray_cluster=f"{NS}/train", ray_job=f"{NS}/job" if job else None,
                  ray_node_ids=(), checkpoint_uri=None,
                  facts=RunFacts(elastic=elastic, lost_instance_ids=(instance,), capacity_type="spot", **facts))


def seed(kubeapi: KubeApiServer, *, job: bool = True, cluster_labels: dict | None = None, **spec) -> None:
    """gpu: 2 workers on spot-1 / spot-2, cpu: 1 worker on spot-3; the head on On-Demand."""
    cluster = raycluster(selector=SPOT_SELECTOR, labels=cluster_labels)
    cluster["spec"].update(spec)
    kubeapi.seed(
        node("spot-1", capacity="spot"), node("spot-2", capacity="spot"), node("spot-3", capacity="spot"),
        node("od-head", capacity="on-demand"), cluster,
        ray_pod("train-head", node_type="head", group="headgroup", node_name="od-head"),
        ray_pod("train-gpu-a", node_name="spot-1", selector=SPOT_SELECTOR),
        ray_pod("train-gpu-b", node_name="spot-2", selector=SPOT_SELECTOR),
        ray_pod("train-cpu-a", group="cpu", node_name="spot-3", selector=SPOT_SELECTOR))
    if job:
        kubeapi.seed(rayjob(selector=SPOT_SELECTOR))


def writes(kubeapi: KubeApiServer) -> list[tuple[str, str, str | None]]:
    return [(r.verb, r.resource, r.name) for r in kubeapi.requests if r.verb in WRITES]


def groups(kubeapi: KubeApiServer) -> dict[str, dict]:
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def pods(kubeapi: KubeApiServer) -> set[str]:
    return {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)}


async def test_a_lost_worker_moves_alone_to_a_block_group_and_the_survivors_stay(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi)
    lost = iid(kubeapi, "spot-1")
    job_before = kubeapi.get("rayjobs", "job", namespace=NS)["spec"]
    result = await KubeRayRequeuer(api, clock=lambda: NOW).requeue(target(lost), decision=BLOCK, event=event("ev-1", lost))

    assert result.changed and result.capacity is Capacity.CAPACITY_BLOCK and result.details["elastic"], result.reason
    assert result.details["replaced"] == {lost: "gpu-block-0block"}
    assert writes(kubeapi) == [("patch", "rayclusters.ray.io", "train")], writes(kubeapi)
    now = groups(kubeapi)
    assert (now["gpu"]["replicas"], now["gpu"]["minReplicas"]) == (1, 1)  # else KubeRay clamps back to 2
    assert now["gpu"]["scaleStrategy"]["workersToDelete"] == ["train-gpu-a"]
    assert now["gpu"]["template"]["spec"]["nodeSelector"] == SPOT_SELECTOR  # the survivors' group is as it was
    block = now["gpu-block-0block"]
    assert (block["replicas"], block["minReplicas"], block["maxReplicas"]) == (1, 0, 1)
    assert block["template"]["spec"]["nodeSelector"] == RESERVED
    assert block["template"]["metadata"]["labels"]["resilienced.io/elastic-of"] == "gpu"
    assert now["cpu"]["replicas"] == 1 and "scaleStrategy" not in now["cpu"]
    annotations = kubeapi.get("rayclusters", "train", namespace=NS)["metadata"]["annotations"]
    assert json.loads(annotations["resilienced.io/elastic-replaced"]) == {lost: "gpu-block-0block"}
    assert kubeapi.get("rayjobs", "job", namespace=NS)["spec"] == job_before  # a retry starts at full size

    # What KubeRay then does: deletes exactly the lost pod, keeps both survivors, adds a block worker.
    sim = KubeRaySim(kubeapi, namespace=NS)
    sim.scale_workers("train")
    assert pods(kubeapi) == {"train-head", "train-gpu-b", "train-cpu-a", "train-gpu-block-0block-worker-00001"}
    new = kubeapi.get("pods", "train-gpu-block-0block-worker-00001", namespace=NS)
    assert new["spec"]["nodeSelector"] == RESERVED
    sim.scale_workers("train")  # steady: nothing more is created or deleted
    assert sim.created == 1 and "train-gpu-b" in pods(kubeapi)


def terminate(kubeapi: KubeApiServer, name: str) -> None:
    """The pod as Karpenter's drain leaves it at the notice: deleted, still terminating (a finalizer
    holds it here as the kubelet's graceful shutdown does on a real node)."""
    pod = kubeapi.get("pods", name, namespace=NS)
    pod["metadata"]["finalizers"] = ["test.resilienced.io/terminating"]
    kubeapi.put(pod)
    kubeapi.delete("pods", name, namespace=NS)
    assert kubeapi.get("pods", name, namespace=NS)["metadata"]["deletionTimestamp"]


def gone(kubeapi: KubeApiServer, name: str) -> None:
    """The terminating pod finishes: its finalizer goes and the API server removes it."""
    kubeapi.patch("pods", name, {"metadata": {"finalizers": None}}, namespace=NS)
    assert kubeapi.get("pods", name, namespace=NS) is None


async def test_a_lost_worker_still_terminating_is_named_in_workers_to_delete_and_moves(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    # Karpenter drains the node at the notice, so at requeue time the lost pod is usually still
    # terminating.  KubeRay (v1.7.0 reconcilePods) counts it as present and recreates the worker in
    # its own (Spot) group once it is gone: the requeue must scale that group down now.
    seed(kubeapi, job=False)
    lost = iid(kubeapi, "spot-1")
    terminate(kubeapi, "train-gpu-a")
    result = await KubeRayRequeuer(api, clock=lambda: NOW).requeue(
        target(lost, job=False), decision=BLOCK, event=event("ev-1", lost))

    assert result.details["replaced"] == {lost: "gpu-block-0block"}, result.reason
    now = groups(kubeapi)
    assert (now["gpu"]["replicas"], now["gpu-block-0block"]["replicas"]) == (1, 1)
    assert now["gpu"]["scaleStrategy"]["workersToDelete"] == ["train-gpu-a"]

    sim = KubeRaySim(kubeapi, namespace=NS)
    sim.scale_workers("train")  # the terminating pod counts; the block worker is created
    gone(kubeapi, "train-gpu-a")
    sim.scale_workers("train")  # gone: nothing is recreated in the Spot group
    assert pods(kubeapi) == {"train-head", "train-gpu-b", "train-cpu-a", "train-gpu-block-0block-worker-00001"}
    assert sim.created == 1


async def test_workers_to_delete_keeps_only_pods_that_still_exist(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    # KubeRay never clears scaleStrategy.workersToDelete and deletes every listed name on each
    # reconcile (v1.7.0 reconcilePods): a name whose pod is gone only grows the list.
    seed(kubeapi, job=False)
    first, second = iid(kubeapi, "spot-1"), iid(kubeapi, "spot-2")
    requeuer = KubeRayRequeuer(api, clock=lambda: NOW)
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    cluster["spec"]["workerGroupSpecs"][0]["scaleStrategy"] = {"workersToDelete": ["train-gpu-old"]}
    kubeapi.put(cluster)  # a name left by an earlier move, its pod long gone
    await requeuer.requeue(target(first, job=False), decision=BLOCK, event=event("ev-1", first))
    assert groups(kubeapi)["gpu"]["scaleStrategy"]["workersToDelete"] == ["train-gpu-a"]
    terminate(kubeapi, "train-gpu-b")  # still there (terminating) when the next notice comes
    KubeRaySim(kubeapi, namespace=NS).scale_workers("train")  # train-gpu-a is deleted and gone
    await requeuer.requeue(target(second, job=False), decision=BLOCK, event=event("ev-2", second))
    assert groups(kubeapi)["gpu"]["scaleStrategy"]["workersToDelete"] == ["train-gpu-b"]


async def test_without_workers_to_delete_kuberay_would_kill_a_survivor(kubeapi: KubeApiServer) -> None:
    # Why the lost pod is named: a group over its replicas loses pods in list order, healthy or not.
    seed(kubeapi, job=False)
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    cluster["spec"]["workerGroupSpecs"][0].update(replicas=1, minReplicas=1)
    kubeapi.put(cluster)
    pods_before = sorted(p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)
                         if p["metadata"]["labels"]["ray.io/group"] == "gpu")
    KubeRaySim(kubeapi, namespace=NS).scale_workers("train")
    assert pods_before[0] not in pods(kubeapi) and pods_before == ["train-gpu-a", "train-gpu-b"]


async def test_a_second_notice_for_the_same_worker_adds_nothing_another_worker_adds_one(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi)
    first, second = iid(kubeapi, "spot-1"), iid(kubeapi, "spot-2")
    requeuer = KubeRayRequeuer(api, clock=lambda: NOW)
    await requeuer.requeue(target(first), decision=BLOCK, event=event("ev-1", first))
    KubeRaySim(kubeapi, namespace=NS).scale_workers("train")  # the block worker is Pending: still short

    kubeapi.reset_log()
    again = await requeuer.requeue(target(first), decision=BLOCK, event=event("ev-2", first))  # rebalance, then notice
    assert again.changes == () and "already replaced" in again.reason and writes(kubeapi) == []
    assert groups(kubeapi)["gpu-block-0block"]["replicas"] == 1

    other = await requeuer.requeue(target(second), decision=BLOCK, event=event("ev-3", second))
    assert other.changed, other.reason
    now = groups(kubeapi)
    assert (now["gpu"]["replicas"], now["gpu-block-0block"]["replicas"], now["gpu-block-0block"]["maxReplicas"]) == (0, 2, 2)
    # train-gpu-a is gone (KubeRay deleted it): only the pod that still exists stays listed
    assert now["gpu"]["scaleStrategy"]["workersToDelete"] == ["train-gpu-b"]
    annotations = kubeapi.get("rayclusters", "train", namespace=NS)["metadata"]["annotations"]
    assert json.loads(annotations["resilienced.io/elastic-replaced"]) == {first: "gpu-block-0block",
                                                                         second: "gpu-block-0block"}


class Recorder:
    """``Cluster.record``, kept in a list (the Event itself is tested in test_router.py)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, bool]] = []

    async def record(self, target: Target, *, reason: str, message: str, warning: bool = False,
                     once: str | None = None) -> None:
        self.events.append((reason, message, warning))


async def test_no_capacity_the_run_goes_on_smaller_and_the_decision_is_recorded(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi)
    lost = iid(kubeapi, "spot-1")
    recorder = Recorder()
    recorded = recorder.events
    requeue = ReportingRequeuer(RequeueRouter(api), cluster=recorder)
    result = await requeue.requeue(target(lost), decision=WAIT, event=event("ev-1", lost))
    assert result.capacity is Capacity.WAIT and "smaller size" in result.reason and "nothing evicted" in result.reason
    assert writes(kubeapi) == []  # no group scaled, no pod deleted
    assert recorded == [("RequeueWaiting", f"run {NS}/job waits for capacity: {result.reason}", True)]
    assert pods(kubeapi) == {"train-head", "train-gpu-a", "train-gpu-b", "train-cpu-a"}


async def test_the_decided_capacity_is_the_groups_own_kuberay_recreates_in_place(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi, job=False)
    lost = iid(kubeapi, "spot-1")
    result = await KubeRayRequeuer(api).requeue(target(lost, job=False), decision=SPOT, event=event("ev-1", lost))
    assert result.details["replaced"] == {lost: "gpu"} and "recreates its worker in group gpu" in result.changes[0]
    now = groups(kubeapi)
    assert set(now) == {"gpu", "cpu"} and now["gpu"]["replicas"] == 2 and "scaleStrategy" not in now["gpu"]


async def test_an_autoscaled_elastic_cluster_is_requeued_as_a_gang_with_the_reason(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi, job=False, enableInTreeAutoscaling=True)
    lost = iid(kubeapi, "spot-1")
    result = await KubeRayRequeuer(api).requeue(target(lost, job=False), decision=BLOCK, event=event("ev-1", lost))
    assert "enableInTreeAutoscaling" in result.details["elastic_fallback"]
    assert pods(kubeapi) == {"train-head"}  # the gang path: every worker replaced


async def test_a_non_elastic_run_is_requeued_as_a_gang(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi)
    lost = iid(kubeapi, "spot-1")
    result = await KubeRayRequeuer(api).requeue(target(lost, elastic=False), decision=BLOCK, event=event("ev-1", lost))
    assert "elastic" not in result.details and "elastic_fallback" not in result.details
    assert set(groups(kubeapi)) == {"gpu", "cpu"}
    assert all(g["template"]["spec"]["nodeSelector"] == RESERVED for g in groups(kubeapi).values())
    assert pods(kubeapi) == {"train-head"}


# ---------------------------------------------------------------------- Kueue


def seed_kueue(kubeapi: KubeApiServer, *, elastic_workload: bool) -> None:
    """A RayCluster Kueue admitted on spot, elastic to Kueue (``kueue.x-k8s.io/elastic-job``) or not."""
    seed(kubeapi, job=False, cluster_labels=QUEUED)
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    cluster["metadata"]["annotations"] = {"kueue.x-k8s.io/elastic-job": "true", "resilienced.io/elastic": "true"}
    cluster = kubeapi.put(cluster)
    wl = workload_for({**cluster, "spec": {"rayClusterSpec": cluster["spec"]}}, flavor="spot")
    wl["metadata"]["ownerReferences"][0]["kind"] = "RayCluster"
    if elastic_workload:  # what prepareWorkloadSlice does with the feature gate on
        wl["metadata"]["annotations"] = {"kueue.x-k8s.io/elastic-job": "true"}
    kubeapi.create(wl)


async def test_kueue_elastic_cluster_is_not_evicted(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_kueue(kubeapi, elastic_workload=True)
    lost = iid(kubeapi, "spot-1")
    kubeapi.reset_log()
    result = await RequeueRouter(api).requeue(target(lost, job=False), decision=BLOCK, event=event("ev-1", lost))

    assert result.kind == "kueue" and result.changed and result.details["elastic"], result.reason
    assert result.details["groups_elsewhere"] == ["gpu"] and "new PodSet" in result.reason
    assert writes(kubeapi) == [("patch", "rayclusters.ray.io", "train")]  # the bookkeeping only
    [wl] = kubeapi.list("workloads", namespace=NS)
    assert wl["spec"]["active"] is True  # never deactivated
    assert set(groups(kubeapi)) == {"gpu", "cpu"} and groups(kubeapi)["gpu"]["replicas"] == 2
    kubeapi.reset_log()
    again = await RequeueRouter(api).requeue(target(lost, job=False), decision=BLOCK, event=event("ev-2", lost))
    assert again.changes == () and writes(kubeapi) == []


async def test_kueue_without_workload_slices_falls_back_to_the_gang(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_kueue(kubeapi, elastic_workload=False)
    lost = iid(kubeapi, "spot-1")
    result = await KueueRequeuer(api).requeue(target(lost, job=False), decision=BLOCK, event=event("ev-1", lost),
                                              dry_run=True)
    assert "ElasticJobsViaWorkloadSlices" in result.details["elastic_fallback"]
    assert any("would deactivate" in c for c in result.changes)  # the gang requeue through Kueue


async def test_a_kueue_rayjob_marked_elastic_is_a_gang_with_the_reason(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi, job=False)
    job = kubeapi.create(rayjob(labels=QUEUED))
    kubeapi.create(workload_for(job, flavor="spot"))
    lost = iid(kubeapi, "spot-1")
    result = await KueueRequeuer(api).requeue(target(lost), decision=BLOCK, event=event("ev-1", lost), dry_run=True)
    assert "RayJob" in result.details["elastic_fallback"] and "autoscaler" in result.details["elastic_fallback"]
    assert any("would deactivate" in c for c in result.changes)


def test_the_decision_for_an_elastic_run_is_sized_for_the_lost_workers_only() -> None:
    facts = RunFacts(instance_type="p5.48xlarge", instance_count=8, lost_instance_ids=("i-0aaa",))
    gang = Target(instance_id="i-0aaa", node=None, ray_cluster=f"{NS}/train", ray_job=None, ray_node_ids=(),
                  checkpoint_uri=None, facts=facts)
    elastic = replace(gang, facts=replace(facts, elastic=True))
    assert CapacityRequest.from_target(gang, event=event("ev-1", "i-0aaa")).instance_count == 8
    assert CapacityRequest.from_target(elastic, event=event("ev-1", "i-0aaa")).instance_count == 1


async def test_a_malformed_elastic_annotation_is_a_gang_and_the_event_says_why(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed(kubeapi)
    lost = iid(kubeapi, "spot-1")
    problem = "annotation resilienced.io/elastic='yes' on RayJob ml/job must be \"true\" or \"false\""
    recorder = Recorder()
    result = await ReportingRequeuer(RequeueRouter(api), cluster=recorder).requeue(
        target(lost, elastic=False, elastic_error=problem), decision=BLOCK, event=event("ev-1", lost))
    assert result.details["elastic_fallback"] == problem and pods(kubeapi) == {"train-head"}
    [(reason, message, _warning)] = recorder.events
    assert reason == "Requeued" and message.endswith(f"(elastic run requeued as a gang: {problem})")


def test_a_worker_lost_from_a_block_group_goes_back_to_its_spot_group() -> None:
    spot = {"groupName": "gpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
            "template": {"spec": {"nodeSelector": dict(SPOT_SELECTOR)}}}
    block = {"groupName": "gpu-block-0block", "replicas": 1, "minReplicas": 0, "maxReplicas": 1,
             "template": {"metadata": {"labels": {"resilienced.io/elastic-of": "gpu"}},
                          "spec": {"nodeSelector": dict(RESERVED)}}}
    groups, replaced, _ = plan_groups([spot, block], [LostWorker("i-0bbb", "gpu-block-0block", ("w-1",))],
                                      Placement.for_decision(SPOT), SPOT)
    assert replaced == {"i-0bbb": "gpu"}
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("gpu", 2), ("gpu-block-0block", 0)]
    assert groups[1]["scaleStrategy"]["workersToDelete"] == ["w-1"]
