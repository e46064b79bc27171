"""A Kueue-managed run is not steered into a flavor whose ClusterQueue quota is short.

On the emulated API server, with Kueue's LocalQueue, ClusterQueue and ResourceFlavor served:
``KubeCluster.locate`` reads the run's queue, the capacity planner decides, the Kueue requeuer
moves the run and ``KueueSim`` plays Kueue (now with the ClusterQueue's quota: rule 5 of its
docstring, ``flavorassigner.go`` ``fitsResourceQuota`` at v0.19.2).  The shapes are the deploy
example's (deploy/examples/kueue.yaml: a 64-GPU block flavor).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.model import Capacity, CapacityDecision
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.kueue import QueueCheck, closed_capacities, quantity, worker_needs
from resilienced.model import Event, Kind, Target
from resilienced.ports import CapacityReservation
from resilienced.requeue.kueue import KueueRequeuer
from tests.requeue.kueue_sim import KueueSim, workload_for
from tests.requeue.objects import cluster_spec
from tests.support.kubeapi import KubeApiServer

from .conftest import FAST, KUEUE_QUEUE_RESOURCES, GcsFactory, instance, node, ray_node, ray_pod, raycluster

pytestmark = pytest.mark.integration

NS = "ml"
BLOCK = "cr-0123456789abcdef0"
NOW = datetime.now(timezone.utc).replace(microsecond=0)
SPOT = {"karpenter.sh/capacity-type": "spot"}
P5 = {"node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": "us-east-1a"}
FLAVOR_LABELS = {"spot": SPOT,
                 "capacity-block": {"karpenter.sh/capacity-type": "reserved",
                                    "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"},
                 "on-demand": {"karpenter.sh/capacity-type": "on-demand"}}


def clusterqueue(*, block_reserved: int, cohort: str | None = None, borrowing: int | None = None) -> dict:
    """spot 64, capacity-block 64, on-demand 32 GPUs; the run holds 16 on spot, others ``block_reserved``."""
    def flavor(name: str, quota: int) -> dict:
        resource: dict = {"name": "nvidia.com/gpu", "nominalQuota": str(quota)}
        if borrowing is not None:
            resource["borrowingLimit"] = str(borrowing)
        return {"name": name, "resources": [resource]}

    spec: dict = {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
        flavor("spot", 64), flavor("capacity-block", 64), flavor("on-demand", 32)]}]}
    if cohort:
        spec["cohortName"] = cohort
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "cq"}, "spec": spec,
            "status": {"flavorsReservation": [
                {"name": "spot", "resources": [{"name": "nvidia.com/gpu", "total": "16", "borrowed": "0"}]},
                {"name": "capacity-block", "resources": [
                    {"name": "nvidia.com/gpu", "total": str(block_reserved), "borrowed": "0"}]}]}}


def gpu_job() -> dict:
    """A RayJob Kueue admitted on spot: 2 workers of 8 GPUs each (16 in all)."""
    spec = cluster_spec()
    spec["workerGroupSpecs"] = [spec["workerGroupSpecs"][0]]
    spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    spec["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"] = dict(SPOT)  # what admission merged in
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": "train", "namespace": NS, "labels": {"kueue.x-k8s.io/queue-name": "training"}},
            "spec": {"entrypoint": "python train.py", "suspend": False, "rayClusterSpec": spec},
            "status": {"jobDeploymentStatus": "Running", "rayClusterName": "train-rc"}}


def seed(kubeapi: KubeApiServer, gcs: GcsFactory, *, block_reserved: int, **queue) -> None:
    for rtype in KUEUE_QUEUE_RESOURCES:
        kubeapi.register(rtype)
    kubeapi.seed(*({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
                    "spec": {"nodeLabels": labels}} for name, labels in FLAVOR_LABELS.items()),
                 clusterqueue(block_reserved=block_reserved, **queue),
                 {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                  "metadata": {"name": "training", "namespace": NS}, "spec": {"clusterQueue": "cq"}})
    job = kubeapi.create(gpu_job())
    kubeapi.create(workload_for(job, flavor="spot"))
    cluster = raycluster("train-rc", owner_job=job, head_ip="10.0.9.1")
    cluster["spec"]["workerGroupSpecs"] = copy.deepcopy(job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    kubeapi.seed(node("n0", instance(100), labels={**P5, "karpenter.sh/capacity-type": "on-demand"}),
                 node("n1", instance(1), labels={**P5, **SPOT}), node("n2", instance(2), labels={**P5, **SPOT}),
                 cluster, ray_pod("train-head", cluster="train-rc", node_name="n0", ip="10.0.9.1", node_type="head"),
                 ray_pod("train-w1", cluster="train-rc", node_name="n1", ip="10.0.1.1", group="gpu"),
                 ray_pod("train-w2", cluster="train-rc", node_name="n2", ip="10.0.1.2", group="gpu"))
    gcs.nodes["10.0.9.1:6379"] = [ray_node(0x91, "10.0.9.1", head=True), ray_node(0x11, "10.0.1.1"),
                                  ray_node(0x12, "10.0.1.2")]


def block_with_room() -> CapacityReservation:
    return CapacityReservation(reservation_id=BLOCK, instance_type="p5.48xlarge", availability_zone="us-east-1a",
                               reservation_type="capacity-block", state="active", available_instances=4,
                               total_instances=4, start=NOW - timedelta(hours=1), end=NOW + timedelta(days=2))


NOTICE = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", instance_ids=(instance(1),), time=NOW)


async def decide(api: k8s.ApiClient, gcs: GcsFactory) -> tuple[Target, CapacityDecision]:
    planner = CapacityPlanner(source=StaticCapacity([block_with_room()]),
                              policy=CapacityPolicy(interruption_threshold=1), clock=lambda: NOW)
    async with KubeCluster(api, ray_control_factory=gcs, replica="replica-a", options=FAST) as cluster:
        (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    _, decision = await planner.plan_for(target, event=NOTICE)
    return target, decision


async def eventually(check: Callable[[], bool], *, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_a_block_flavor_short_of_quota_is_passed_over_and_the_run_lands_on_on_demand(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    seed(kubeapi, gcs, block_reserved=56)  # another run holds 56 of the block flavor's 64 GPUs
    target, decision = await decide(api, gcs)
    assert decision.capacity is Capacity.ON_DEMAND, decision.reason
    assert ("Kueue ClusterQueue cq has too little free quota: flavor capacity-block has 8 nvidia.com/gpu free of 64, "
            "the run needs 16") in decision.reason

    async with KueueSim(kubeapi, namespace=NS) as kueue:
        await KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10).requeue(
            target, decision=decision, event=NOTICE)
        await eventually(lambda: kueue.admitted == ["on-demand"]
                         and not kubeapi.get("rayjobs", "train", namespace=NS)["spec"]["suspend"])
    assert kueue.no_quota == []


async def test_with_room_in_the_block_flavor_the_block_is_chosen(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    seed(kubeapi, gcs, block_reserved=48)  # 16 free: exactly enough
    target, decision = await decide(api, gcs)
    assert (decision.capacity, decision.reservation_id) == (Capacity.CAPACITY_BLOCK, BLOCK), decision.reason
    assert target.facts.closed_capacity == ()


async def test_the_stand_in_leaves_a_workload_short_of_quota_pending(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    # What the check prevents: steered into the short block flavor, the Workload stays pending and
    # the job suspended, while the requeue itself reports success.
    seed(kubeapi, gcs, block_reserved=56)
    forced = CapacityDecision(Capacity.CAPACITY_BLOCK, "forced", reservation_id=BLOCK)
    target = Target(instance_id=instance(1), node="n1", ray_cluster=f"{NS}/train-rc", ray_job=f"{NS}/train",
                    ray_node_ids=(), checkpoint_uri=None)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        result = await KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10).requeue(
            target, decision=forced, event=NOTICE)
        await eventually(lambda: bool(kueue.no_quota))
    assert result.changed and kueue.admitted == []
    assert kubeapi.get("rayjobs", "train", namespace=NS)["spec"]["suspend"] is True


# --------------------------------------------------------------------------- the rule as a table
NEEDS = {"nvidia.com/gpu": Decimal(16)}
SELECTORS = {c: dict(FLAVOR_LABELS[c]) for c in FLAVOR_LABELS}


def flavors(name: str) -> dict | None:
    return FLAVOR_LABELS.get(name)


@pytest.mark.parametrize(("queue", "own", "closed"), [
    ({"block_reserved": 56}, None, ["capacity-block"]),
    ({"block_reserved": 56}, FLAVOR_LABELS["capacity-block"], []),  # its own 16 on the block flavor come back
    ({"block_reserved": 56, "cohort": "gpus", "borrowing": 8}, None, []),  # 8 free + 8 it may borrow
    ({"block_reserved": 64, "cohort": "gpus", "borrowing": 8}, None, ["capacity-block"]),
    ({"block_reserved": 64, "cohort": "gpus"}, None, []),  # no borrowing limit in a cohort: cannot tell
], ids=["short", "own-reservation", "cohort-borrowing", "cohort-borrowing-short", "cohort-unlimited"])
def test_which_capacities_are_closed(queue: dict, own: dict | None, closed: list[str]) -> None:
    check = QueueCheck(clusterqueue(**queue), flavor_labels=flavors, needs=NEEDS, own_selector=own)
    assert [c for c, _ in closed_capacities(check, SELECTORS)] == closed


def test_a_capacity_no_flavor_matches_is_closed_with_the_reason() -> None:
    check = QueueCheck(clusterqueue(block_reserved=0), flavor_labels=flavors, needs=NEEDS, own_selector=None)
    [(capacity, why)] = closed_capacities(check, {"on-demand": {"karpenter.sh/capacity-type": "on-demand"},
                                                  "capacity-block": {"eks.amazonaws.com/capacityType": "X",
                                                                     "karpenter.sh/capacity-type": "spot-ish"}})
    assert capacity == "capacity-block" and "has no flavor for nvidia.com/gpu whose nodeLabels match" in why


@pytest.mark.parametrize(("value", "expected"), [
    ("64", Decimal(64)), (8, Decimal(8)), ("500m", Decimal("0.5")), ("16Ti", Decimal(16 * 2**40)),
    ("2G", Decimal(2 * 10**9)), ("1e3", Decimal(1000))])
def test_quantities(value: object, expected: Decimal) -> None:
    assert quantity(value) == expected


def test_a_malformed_quantity_names_itself() -> None:
    with pytest.raises(ValueError, match="'lots'"):
        quantity("lots")


def test_worker_needs_count_hosts_and_take_limits_for_missing_requests() -> None:
    group = {"replicas": 2, "numOfHosts": 2, "template": {"spec": {"containers": [
        {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "8"}, "requests": {"cpu": "2"}}},
        {"name": "b", "resources": {"requests": {"cpu": "500m"}}}]}}}
    assert worker_needs([group]) == {"nvidia.com/gpu": Decimal(16), "cpu": Decimal(10)}
