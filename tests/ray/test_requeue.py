"""Ray mode against a real local Ray cluster: replacement nodes from the decided pool, all or nothing.

``RayModeRequeuer`` only applies (launches the decided pool or raises ``NoCapacity``); deciding again
when a pool has no room is ``recovery.move.Mover``'s, as in kubernetes mode."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.capacity.request import CapacityRequest
from resilienced.model import Capacity, CapacityDecision
from resilienced.local.capacity import StaticCapacity
from resilienced.local.provider import LocalNodeProvider
from resilienced.local.raycluster import LocalRayCluster
from resilienced.model import Event, Kind, RunFacts, Target
from resilienced.ports import CapacityReservation
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL, RESERVATION_LABEL, RayModeCluster
from resilienced.ray.gcs import RayGcs
from resilienced.ports import NoCapacity
from resilienced.ray.requeue import REPLACES_LABEL, RayModeRequeuer
from resilienced.recovery.move import Mover
from tests.support.kubeoptions import LOCAL_BOUND_S

from .conftest import local_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    """A head (no CPUs); every node the tests start is stopped at the end, also on failure."""
    with local_cluster("rq") as local:
        yield local


def block(available: int) -> CapacityReservation:
    now = datetime.now(timezone.utc)
    return CapacityReservation(reservation_id="cr-0local", instance_type="local.cpu", availability_zone="local-1a",
                               reservation_type="capacity-block", state="active", available_instances=available,
                               total_instances=2, start=now - timedelta(hours=1), end=now + timedelta(days=1))


def target(*lost: str) -> Target:
    return Target(instance_id=lost[0], node="127.0.0.1", ray_cluster=None, ray_job=None, ray_node_ids=(),
                  checkpoint_uri=None, ray_address="127.0.0.1:0",
                  facts=RunFacts(instance_type="local.cpu", availability_zone="local-1a",
                                 capacity_type="spot", lost_instance_ids=lost))


def alive_with(cluster: LocalRayCluster, key: str, value: str) -> list:
    return [n for n in cluster.nodes() if n.alive and n.labels.get(key) == value]


async def test_spot_with_no_room_gets_a_capacity_block_node(cluster: LocalRayCluster) -> None:
    # The Spot instance i-...dead was taken back (its node is gone); the run needs one node again.
    provider = LocalNodeProvider(cluster, capacity={"spot": 0, "capacity-block": 2})
    planner = CapacityPlanner(source=StaticCapacity([block(2)]), policy=CapacityPolicy())
    event = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-ray-1", time=datetime.now(timezone.utc),
                  instance_ids=("i-0000000000000dead",))
    _, decision = await planner.plan_for(target("i-0000000000000dead"), event=event)
    assert decision.capacity is Capacity.SPOT  # one interruption: Spot still looks healthy...

    requeuer = Mover(planner=planner, requeue=RayModeRequeuer(provider))
    result = await requeuer.apply(target("i-0000000000000dead"), decision=decision, event=event)
    # ...but the provider has no Spot: the pool is marked out and the block is chosen instead.
    assert result.capacity is Capacity.CAPACITY_BLOCK and result.reservation_id == "cr-0local", result.reason
    assert "spot gave 0 of 1" in result.reason
    [replacement] = alive_with(cluster, REPLACES_LABEL, "i-0000000000000dead")
    assert replacement.labels[CAPACITY_TYPE_LABEL] == "capacity-block"
    assert replacement.labels[RESERVATION_LABEL] == "cr-0local"
    assert replacement.labels[INSTANCE_ID_LABEL].startswith("i-0") and len(replacement.labels[INSTANCE_ID_LABEL]) == 19
    assert await provider.available(Capacity.CAPACITY_BLOCK) == 1

    again = await requeuer.apply(target("i-0000000000000dead"), decision=decision, event=event)
    assert again.changes == () and "already replaced" in again.reason
    assert len(alive_with(cluster, REPLACES_LABEL, "i-0000000000000dead")) == 1
    await provider.release(await provider.nodes())


async def test_a_gang_that_does_not_fit_holds_nothing_and_waits(cluster: LocalRayCluster) -> None:
    provider = LocalNodeProvider(cluster, capacity={"capacity-block": 1})
    planner = CapacityPlanner(source=StaticCapacity([block(2)]), policy=CapacityPolicy(allow_on_demand=False))
    event = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-ray-2", time=datetime.now(timezone.utc),
                  instance_ids=("i-0000000000000aaa", "i-0000000000000bbb"))
    decision = await planner.plan(
        CapacityRequest.from_target(target("i-0000000000000aaa", "i-0000000000000bbb"), event=event))
    assert decision.capacity is Capacity.SPOT
    result = await Mover(planner=planner, requeue=RayModeRequeuer(provider)).apply(
        target("i-0000000000000aaa", "i-0000000000000bbb"), decision=decision, event=event)
    assert result.capacity is Capacity.WAIT and result.retry_after is not None, result.reason
    assert result.details["tried"] == ["spot gave 0 of 2", "capacity-block gave 1 of 2"]
    # The one block node it got was given back: no partial gang is left waiting.
    cluster.wait_for(lambda nodes: not any(n.alive and n.labels.get(REPLACES_LABEL, "").startswith("i-0000000000000")
                                           and n.labels[REPLACES_LABEL] != "i-0000000000000dead" for n in nodes),
                     timeout_s=60, what="the released node to leave the cluster")
    assert await provider.available(Capacity.CAPACITY_BLOCK) == 1
    assert await provider.nodes() == []


async def test_the_local_provider_refuses_an_empty_pool(cluster: LocalRayCluster) -> None:
    provider = LocalNodeProvider(cluster, capacity={"spot": 0})
    with pytest.raises(NoCapacity, match="no spot capacity"):
        await provider.launch(capacity=Capacity.SPOT, node_labels=[{}])
    with pytest.raises(NoCapacity):
        await provider.launch(capacity=Capacity.ON_DEMAND, node_labels=[{}])  # not listed: none


def elastic_target(*lost: str) -> Target:
    base = target(*lost)
    return replace(base, facts=replace(base.facts, elastic=True))


async def test_elastic_second_notice_adds_nothing_for_the_same_worker_and_one_for_another(
        cluster: LocalRayCluster) -> None:
    provider = LocalNodeProvider(cluster, capacity={"capacity-block": 2})
    planner = CapacityPlanner(source=StaticCapacity([block(2)]), policy=CapacityPolicy())
    requeuer = Mover(planner=planner, requeue=RayModeRequeuer(provider))
    first, second = "i-00000000000e1a01", "i-00000000000e1a02"
    decision = CapacityDecision(Capacity.CAPACITY_BLOCK, "block", reservation_id="cr-0local")
    try:
        result = await requeuer.apply(elastic_target(first), decision=decision,
                                        event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-e1", instance_ids=(first,)))
        assert result.capacity is Capacity.CAPACITY_BLOCK and result.details["elastic"], result.reason
        [node] = alive_with(cluster, REPLACES_LABEL, first)
        assert node.labels["resilienced.io/elastic"] == "true"  # losing the replacement is elastic too

        again = await requeuer.apply(elastic_target(first), decision=decision,
                                       event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-e2", instance_ids=(first,)))
        assert again.changes == () and "already replaced" in again.reason
        assert len(await provider.nodes()) == 1 and await provider.available(Capacity.CAPACITY_BLOCK) == 1

        other = await requeuer.apply(elastic_target(second), decision=decision,
                                       event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-e3", instance_ids=(second,)))
        assert other.changed, other.reason
        assert sorted(n.labels[REPLACES_LABEL] for n in await provider.nodes()) == [first, second]
    finally:
        await provider.release(await provider.nodes())


async def test_elastic_keeps_what_it_got_and_waits_for_the_rest(cluster: LocalRayCluster) -> None:
    provider = LocalNodeProvider(cluster, capacity={"capacity-block": 1})
    planner = CapacityPlanner(source=StaticCapacity([block(2)]), policy=CapacityPolicy(allow_on_demand=False))
    lost = ("i-00000000000e1b01", "i-00000000000e1b02")
    event = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-e4", instance_ids=lost)
    try:
        decision = await planner.plan(CapacityRequest.from_target(elastic_target(*lost), event=event))
        result = await Mover(planner=planner, requeue=RayModeRequeuer(provider)).apply(
            elastic_target(*lost), decision=decision, event=event)
        # Unlike a gang (test above), the one block node is kept: the run grows by what there is.
        assert result.capacity is Capacity.WAIT and result.retry_after is not None, result.reason
        assert "smaller size" in result.reason and result.details["missing"] == [lost[1]]
        assert [n.labels[REPLACES_LABEL] for n in await provider.nodes()] == [lost[0]]
        assert result.changes and "launched capacity-block nodes" in result.changes[0]
    finally:
        await provider.release(await provider.nodes())


async def test_elastic_with_no_capacity_launches_nothing_and_says_why(cluster: LocalRayCluster) -> None:
    provider = LocalNodeProvider(cluster, capacity={"spot": 0})
    planner = CapacityPlanner(source=StaticCapacity([]), policy=CapacityPolicy(allow_on_demand=False))
    lost = "i-00000000000e1c01"
    event = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-e5", instance_ids=(lost,))
    decision = await planner.plan(CapacityRequest.from_target(elastic_target(lost), event=event))
    result = await Mover(planner=planner, requeue=RayModeRequeuer(provider)).apply(
        elastic_target(lost), decision=decision, event=event)
    assert result.capacity is Capacity.WAIT and result.changes == () and "smaller size" in result.reason
    assert await provider.nodes() == []


async def test_the_elastic_node_label_makes_the_located_run_elastic(cluster: LocalRayCluster) -> None:
    elastic_iid, gang_iid = "i-00000000000e1d01", "i-00000000000e1d02"
    nodes = [cluster.add_node(labels={INSTANCE_ID_LABEL: elastic_iid, "resilienced.io/elastic": "true"}, num_cpus=1),
             cluster.add_node(labels={INSTANCE_ID_LABEL: gang_iid}, num_cpus=1)]
    try:
        located = await RayModeCluster(ray=RayGcs(cluster.address, token=cluster.auth_token, timeout=LOCAL_BOUND_S),
                                       checkpoint_uri=None).locate(instance_ids=[elastic_iid, gang_iid])
        by_instance = {t.instance_id: t for t in located.targets}
        assert by_instance[elastic_iid].facts.elastic is True
        assert by_instance[gang_iid].facts.elastic is False
    finally:
        for node in nodes:
            cluster.kill_node(node)
