"""Who manages a run's Nodes decides how its capacity is read and how it is steered (docs/requeue.md
"Node shapes"): Karpenter's NodePools, EKS managed node groups, or neither.

The emulated API server serves the Nodes, Ray pods, the RayCluster and (where a test registers
them) Karpenter's NodePool and EC2NodeClass; ``KubeCluster.locate`` reads them through its caches,
the capacity planner decides from the target it returns (Capacity Blocks from ``StaticCapacity``),
and the KubeRay requeuer writes the placement back through the real client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.capacity.request import CapacityRequest
from resilienced.model import Capacity
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.kube.cluster import KubeCluster
from resilienced.model import Event, Kind, Target
from resilienced.ports import CapacityReservation
from resilienced.requeue.kuberay import KubeRayRequeuer
from resilienced.requeue.elastic import current_capacity
from tests.support.kubeapi import KubeApiServer

from .conftest import FAST, KARPENTER_RESOURCES, GcsFactory, instance, node, ray_node, ray_pod, raycluster, worker_group

pytestmark = pytest.mark.integration

P5 = {"node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": "us-east-1a"}
BLOCK, OTHER = "cr-0123456789abcdef0", "cr-0fedcba9876543210"
HEAD_IP = "10.0.9.1"
#: EKS managed node groups label their nodes so (docs.aws.amazon.com/eks managed node groups;
#: the capacity type SPOT | ON_DEMAND | CAPACITY_BLOCK, the group's name); no Karpenter label.
EKS_SPOT = {**P5, "eks.amazonaws.com/capacityType": "SPOT", "eks.amazonaws.com/nodegroup": "gpu-spot"}
EKS_ON_DEMAND = {**P5, "eks.amazonaws.com/capacityType": "ON_DEMAND", "eks.amazonaws.com/nodegroup": "gpu-od"}
ON_BLOCK = {**P5, "karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK,
            "karpenter.k8s.aws/capacity-reservation-type": "capacity-block", "karpenter.sh/nodepool": "blocks"}
NOW = datetime.now(timezone.utc).replace(microsecond=0)


def seed_run(kubeapi: KubeApiServer, gcs: GcsFactory, *, worker_labels: Mapping[str, str]) -> None:
    """A RayCluster: head on n0 (On-Demand), one worker on each of n1, n2 (``worker_labels``)."""
    cluster = raycluster("train", head_ip=HEAD_IP)
    cluster["spec"]["workerGroupSpecs"] = [worker_group("gpu", replicas=2)]
    kubeapi.seed(node("n0", instance(100), labels={**P5, "karpenter.sh/capacity-type": "on-demand"}),
                 node("n1", instance(1), labels=worker_labels), node("n2", instance(2), labels=worker_labels),
                 cluster,
                 ray_pod("train-head", cluster="train", node_name="n0", ip=HEAD_IP, node_type="head"),
                 ray_pod("train-w1", cluster="train", node_name="n1", ip="10.0.1.1", group="gpu"),
                 ray_pod("train-w2", cluster="train", node_name="n2", ip="10.0.1.2", group="gpu"))
    gcs.nodes[f"{HEAD_IP}:6379"] = [ray_node(0x91, HEAD_IP, head=True), ray_node(0x11, "10.0.1.1"),
                                    ray_node(0x12, "10.0.1.2")]


def karpenter_serving(kubeapi: KubeApiServer, *, selected: tuple[str, ...] = ()) -> None:
    """Karpenter's CRDs served: a Spot NodePool whose EC2NodeClass selects nothing, and a reserved
    NodePool whose EC2NodeClass lists ``selected`` (status shape of aws/karpenter-provider-aws v1.14.1
    pkg/apis/v1/ec2nodeclass_status.go)."""
    for rtype in KARPENTER_RESOURCES:
        kubeapi.register(rtype)

    def pool(name: str, capacity: str, nodeclass: str) -> dict:
        return {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": name}, "spec": {
            "template": {"spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": nodeclass},
                "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity]}]}}}}

    def nodeclass(name: str, ids: tuple[str, ...]) -> dict:
        return {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": name},
                "spec": {"capacityReservationSelectorTerms": [{"tags": {"karpenter.sh/discovery": "train"}}]},
                "status": {"capacityReservations": [
                    {"id": i, "instanceType": "p5.48xlarge", "availabilityZone": "us-east-1a",
                     "ownerID": "123456789012", "instanceMatchCriteria": "targeted",
                     "reservationType": "capacity-block", "state": "active"} for i in ids]}}

    kubeapi.seed(pool("spot", "spot", "spot-class"), pool("blocks", "reserved", "block-class"),
                 nodeclass("spot-class", ()), nodeclass("block-class", selected))


def block(reservation_id: str, *, ends_in: timedelta = timedelta(days=2)) -> CapacityReservation:
    return CapacityReservation(reservation_id=reservation_id, instance_type="p5.48xlarge",
                               availability_zone="us-east-1a", reservation_type="capacity-block", state="active",
                               available_instances=4, total_instances=4, start=NOW - timedelta(hours=1),
                               end=NOW + ends_in)


@asynccontextmanager
async def located(api: k8s.ApiClient, gcs: GcsFactory, instance_id: str) -> AsyncIterator[Target]:
    """The target of ``instance_id`` as kubernetes mode locates it (caches started after the seeding)."""
    async with KubeCluster(api, ray_control_factory=gcs, replica="replica-a", options=FAST) as cluster:
        location = await cluster.locate(instance_ids=[instance_id])
        assert location.unresolved == {}, location.unresolved
        (target,) = location.targets
        yield target


def spot_notice(instance_id: str) -> Event:
    return Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", instance_ids=(instance_id,), time=NOW)


# --------------------------------------------------------------------------- reserved is not always a block
@pytest.mark.parametrize(("reservation_type", "capacity", "reservation"), [
    ("default", Capacity.ON_DEMAND, None), ("capacity-block", Capacity.CAPACITY_BLOCK, BLOCK)],
    ids=["an On-Demand Capacity Reservation", "a Capacity Block"])
async def test_a_reserved_node_is_a_block_only_when_its_reservation_type_says_so(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory, reservation_type: str,
        capacity: Capacity, reservation: str | None) -> None:
    # Karpenter (aws/karpenter-provider-aws v1.6+, pkg/apis/v1/labels.go) labels every reserved node
    # with karpenter.k8s.aws/capacity-reservation-type: default (an ODCR) or capacity-block.
    seed_run(kubeapi, gcs, worker_labels={**ON_BLOCK, "karpenter.k8s.aws/capacity-reservation-type": reservation_type})
    async with located(api, gcs, instance(1)) as target:
        request = CapacityRequest.from_target(target, event=spot_notice(instance(1)))
    assert (request.current_capacity, request.current_reservation_id) == (capacity, reservation)
    assert current_capacity(target) is capacity


# --------------------------------------------------------------------------- nodes Karpenter does not manage
async def test_a_run_on_an_eks_node_group_may_use_any_block_and_reads_its_capacity_from_eks_labels(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    # The cluster serves Karpenter's CRDs, but no NodePool manages the run's nodes: the
    # EC2NodeClass rule is not the run's, any active block with room is.
    seed_run(kubeapi, gcs, worker_labels=EKS_SPOT)
    karpenter_serving(kubeapi)
    planner = CapacityPlanner(source=StaticCapacity([block(BLOCK)]), policy=CapacityPolicy(interruption_threshold=1),
                              clock=lambda: NOW)
    async with located(api, gcs, instance(1)) as target:
        request, decision = await planner.plan_for(target, event=spot_notice(instance(1)))
    assert (decision.capacity, decision.reservation_id) == (Capacity.CAPACITY_BLOCK, BLOCK), decision.reason
    assert "EC2NodeClass" not in decision.reason
    assert request.current_capacity is Capacity.SPOT and target.facts.node_shape == "eks-nodegroup"


async def test_prefer_blocks_moves_a_run_leaving_an_expiring_block_to_another_block(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    seed_run(kubeapi, gcs, worker_labels={**P5, "eks.amazonaws.com/capacityType": "CAPACITY_BLOCK",
                                          "eks.amazonaws.com/nodegroup": "gpu-block"})
    karpenter_serving(kubeapi)
    planner = CapacityPlanner(source=StaticCapacity([block(BLOCK, ends_in=timedelta(minutes=40)), block(OTHER)]),
                              policy=CapacityPolicy(prefer_blocks=True), clock=lambda: NOW)
    expiry = Event(kind=Kind.CAPACITY_BLOCK_EXPIRY, event_id="ev-2", capacity_reservation_id=BLOCK, time=NOW)
    async with located(api, gcs, instance(1)) as target:
        request, decision = await planner.plan_for(target, event=expiry)
    assert (decision.capacity, decision.reservation_id) == (Capacity.CAPACITY_BLOCK, OTHER), decision.reason
    assert request.current_capacity is Capacity.CAPACITY_BLOCK


async def test_a_run_on_an_eks_node_group_is_steered_with_the_node_groups_capacity_label(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    # The cluster autoscaler scales the managed node group whose nodes fit a pending pod: the
    # worker templates ask for eks.amazonaws.com/capacityType, which only those nodes carry.
    seed_run(kubeapi, gcs, worker_labels=EKS_SPOT)
    kubeapi.seed(node("n3", instance(3), labels=EKS_ON_DEMAND))
    w2 = kubeapi.get("pods", "train-w2", namespace="ml")
    w2["spec"]["nodeName"] = "n3"  # this worker already runs in the On-Demand group
    kubeapi.put(w2)
    planner = CapacityPlanner(source=StaticCapacity([]), policy=CapacityPolicy(interruption_threshold=1),
                              clock=lambda: NOW)
    async with located(api, gcs, instance(1)) as target:
        _, decision = await planner.plan_for(target, event=spot_notice(instance(1)))
    assert decision.capacity is Capacity.ON_DEMAND, decision.reason
    result = await KubeRayRequeuer(api).requeue(target, decision=decision, event=spot_notice(instance(1)))
    assert result.changed, result.reason
    [group] = kubeapi.get("rayclusters", "train", namespace="ml")["spec"]["workerGroupSpecs"]
    assert group["template"]["spec"]["nodeSelector"] == {"eks.amazonaws.com/capacityType": "ON_DEMAND"}
    assert {p["metadata"]["name"] for p in kubeapi.list("pods", namespace="ml")} == {"train-head", "train-w2"}


# --------------------------------------------------------------------------- Karpenter's expiry window
async def test_on_karpenters_nodes_a_block_inside_its_expiry_window_is_not_chosen(
        api: k8s.ApiClient, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    # Karpenter (aws/karpenter-provider-aws v1.6+, v1.14.1 pkg/apis/v1/ec2nodeclass_status.go
    # capacityReservationExpirationPeriod; pkg/controllers/capacityreservation/expiration) deletes a
    # block's NodeClaims 40 min before its end.  A 30 min --block-end-margin would leave the run 10
    # minutes it does not have: this block ends in 1 h 35 min and the run needs 1 h.
    seed_run(kubeapi, gcs, worker_labels={**P5, "karpenter.sh/capacity-type": "spot", "karpenter.sh/nodepool": "spot"})
    karpenter_serving(kubeapi, selected=(BLOCK,))
    policy = CapacityPolicy(interruption_threshold=1, block_end_margin=timedelta(minutes=30))
    planner = CapacityPlanner(source=StaticCapacity([block(BLOCK, ends_in=timedelta(minutes=95))]), policy=policy,
                              clock=lambda: NOW)
    async with located(api, gcs, instance(1)) as target:
        _, decision = await planner.plan_for(target, event=spot_notice(instance(1)))
    assert decision.capacity is Capacity.ON_DEMAND, decision.reason
    assert f"{BLOCK} ends" in decision.reason and "40m" in decision.reason
