"""Ray inside a Volcano Job: locate finds the Job from its pods, and the notice restarts the Job.

The pods are built as Volcano's job controller builds them (volcano-sh/volcano
pkg/controllers/job/job_controller_util.go ``createJobPod``, v1.10 to v1.13): the labels
``volcano.sh/job-name`` / ``volcano.sh/job-namespace`` and the annotation ``volcano.sh/job-name``
(volcano-sh/apis pkg/apis/batch/v1alpha1/labels.go at 0d90235), a controller ownerReference to
the Job; the Ray labels come from the task templates.  Everything runs against the emulated API
server through the real kubernetes_asyncio client; only the GCS is a stand-in (StaticGcs).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.cluster_caches import VOLCANO_JOBS
from resilienced.kube.locate import volcano_job_of
from resilienced.model import Event, Kind
from resilienced.requeue.router import RequeueRouter
from resilienced.requeue.volcano import command_name
from tests.support.kubeapi import KubeApiServer

from .conftest import FAST, GcsFactory, instance, node, ray_node

pytestmark = pytest.mark.integration

NS = "ml"
P5_SPOT = {"node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": "us-east-1a",
           "karpenter.sh/capacity-type": "spot"}


def volcano_job() -> dict[str, Any]:
    def task(name: str, node_type: str, replicas: int) -> dict[str, Any]:
        return {"name": name, "replicas": replicas, "template": {
            "metadata": {"labels": {"ray.io/cluster": "vc-ray", "ray.io/node-type": node_type}},
            "spec": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                     "containers": [{"name": "ray", "image": "rayproject/ray:2.60.0"}]}}}
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
            "metadata": {"name": "vcjob", "namespace": NS,
                         "annotations": {"resilienced.io/checkpoint-uri": "s3://ckpt/vcjob"}},
            "spec": {"minAvailable": 3, "schedulerName": "volcano", "queue": "default", "maxRetry": 3,
                     "tasks": [task("head", "head", 1), task("worker", "worker", 2)]},
            "status": {"state": {"phase": "Running"}, "retryCount": 0}}


def volcano_pod(job: dict[str, Any], *, task: str, index: int, node_name: str, ip: str,
                owner: bool = True) -> dict[str, Any]:
    """A pod as Volcano's createJobPod makes it from ``task``'s template."""
    name = job["metadata"]["name"]
    template = next(t for t in job["spec"]["tasks"] if t["name"] == task)["template"]
    meta: dict[str, Any] = {
        "name": f"{name}-{task}-{index}", "namespace": NS,
        "labels": {**template["metadata"]["labels"], "volcano.sh/job-name": name,
                   "volcano.sh/job-namespace": NS, "volcano.sh/task-spec": task,
                   "volcano.sh/queue-name": "default", "volcano.sh/task-index": str(index)},
        "annotations": {"volcano.sh/job-name": name, "volcano.sh/task-spec": task, "volcano.sh/job-version": "0"},
    }
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": name,
                                    "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": node_name, **template["spec"]}, "status": {"phase": "Running", "podIP": ip}}


@pytest.fixture
async def world(kubeapi: KubeApiServer, gcs: GcsFactory) -> dict[str, Any]:
    job = kubeapi.create(volcano_job())
    kubeapi.seed(node("n0", instance(100), labels=P5_SPOT), node("n1", instance(1), labels=P5_SPOT),
                 node("n2", instance(2), labels=P5_SPOT),
                 volcano_pod(job, task="head", index=0, node_name="n0", ip="10.8.0.1"),
                 volcano_pod(job, task="worker", index=0, node_name="n1", ip="10.8.0.2"),
                 volcano_pod(job, task="worker", index=1, node_name="n2", ip="10.8.0.3"))
    gcs.nodes["10.8.0.1:6379"] = [ray_node(0x10, "10.8.0.1", head=True), ray_node(0x11, "10.8.0.2"),
                                  ray_node(0x12, "10.8.0.3")]
    return job


async def test_a_notice_for_a_node_of_a_volcano_jobs_ray_pods_restarts_the_job_with_a_command(
    api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory, world: dict[str, Any]
) -> None:
    event = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-vc", instance_ids=(instance(1),))
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=FAST) as kube:
        location = await kube.locate(instance_ids=[instance(1)])
        assert kube.caches.cache_of(VOLCANO_JOBS) is not None  # the emulator serves batch.volcano.sh
        assert location.unresolved == {}
        (target,) = location.targets
        assert target.facts.volcano_job == f"{NS}/vcjob"
        assert (target.ray_cluster, target.ray_job) == (f"{NS}/vc-ray", None)
        assert target.ray_node_ids == ("11" * 28,)  # the worker's Ray node, found through the head's GCS
        assert target.ray_address == "10.8.0.1:6379" and target.checkpoint_uri == "s3://ckpt/vcjob"
        assert target.facts.instance_count == 2
        control = await kube.ray_control(target)  # the signal step reaches the same GCS
        assert control.address == "10.8.0.1:6379"

        planner = CapacityPlanner(source=StaticCapacity(), policy=CapacityPolicy(interruption_threshold=1))
        _, decision = await planner.plan_for(target, event=event)
        result = await RequeueRouter(api).requeue(target, decision=decision, event=event)
        await kube.record(target, reason="Requeued", message="restarted")

    assert result.kind == "volcano" and result.changed
    (command,) = kubeapi.list("commands", namespace=NS)
    assert command["metadata"]["name"] == command_name("vcjob", "ev-vc")
    assert command["action"] == "RestartJob"
    assert (command["target"]["kind"], command["target"]["name"], command["target"]["uid"]) == (
        "Job", "vcjob", world["metadata"]["uid"])
    regarding = {(e["involvedObject"]["kind"], e["involvedObject"]["name"]) for e in kubeapi.list("events", namespace=NS)}
    assert ("Job", "vcjob") in regarding  # the Event goes on the Volcano Job, not a RayCluster that is not there


@pytest.mark.parametrize("pod, expected", [
    ({"metadata": {"namespace": "ml", "labels": {"volcano.sh/job-name": "a"},
                   "ownerReferences": [{"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "b",
                                        "uid": "u1", "controller": True}]}}, ("ml/b", "u1")),
    ({"metadata": {"namespace": "ml", "labels": {"volcano.sh/job-name": "a", "volcano.sh/job-namespace": "ml"}}},
     ("ml/a", "")),
    ({"metadata": {"namespace": "ml", "ownerReferences": [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "k8s-job", "uid": "u2", "controller": True}]}}, None),
    ({"metadata": {"namespace": "ml", "labels": {"ray.io/cluster": "rc"}}}, None),
], ids=["owner-reference-first", "volcano-label", "a-kubernetes-job-is-not-volcano", "no-volcano"])
def test_the_volcano_job_of_a_pod(pod: dict[str, Any], expected: tuple[str, str] | None) -> None:
    assert volcano_job_of(pod) == expected


async def test_ray_pods_with_no_raycluster_and_no_volcano_job_stay_unresolved(
    api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory, world: dict[str, Any]
) -> None:
    kubeapi.delete("jobs", "vcjob", namespace=NS)  # the pods remain, their Job is gone
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=FAST) as kube:
        location = await kube.locate(instance_ids=[instance(1)])
    assert location.targets == ()
    assert location.unresolved == {instance(1): "Ray pods with ray.io/cluster=vc-ray were created by "
                                                f"Volcano Job {NS}/vcjob, which is not known"}
