"""Ray mode against a real local Ray cluster: replacement nodes from the decided pool, all or nothing."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from resilienced.capacity import Capacity, CapacityPlanner, CapacityPolicy, CapacityRequest
from resilienced.capacity.static import StaticCapacity
from resilienced.localray import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL, LocalRayCluster
from resilienced.model import Event, Kind, Target
from resilienced.ports import CapacityReservation
from resilienced.requeue.raymode import (
    REPLACES_LABEL,
    RESERVATION_LABEL,
    LocalNodeProvider,
    NoCapacity,
    RayModeRequeuer,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    """A head (no CPUs); every node the tests start is stopped at the end, also on failure."""
    workdir = Path(tempfile.mkdtemp(prefix="rq", dir="/tmp"))
    local = LocalRayCluster(workdir=workdir)
    try:
        local.start()
        yield local
    finally:
        local.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def block(available: int) -> CapacityReservation:
    now = datetime.now(timezone.utc)
    return CapacityReservation(reservation_id="cr-0local", instance_type="local.cpu", availability_zone="local-1a",
                               reservation_type="capacity-block", state="active", available_instances=available,
                               total_instances=2, start=now - timedelta(hours=1), end=now + timedelta(days=1))


def target(*lost: str) -> Target:
    return Target(instance_id=lost[0], node="127.0.0.1", ray_cluster=None, ray_job=None, ray_node_ids=(),
                  checkpoint_uri=None, ray_address="127.0.0.1:0",
                  attributes={"instance_type": "local.cpu", "availability_zone": "local-1a",
                              "capacity_type": "spot", "lost_instance_ids": list(lost)})


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

    requeuer = RayModeRequeuer(provider, planner=planner)
    result = await requeuer.requeue(target("i-0000000000000dead"), decision=decision, event=event)
    # ...but the provider has no Spot: the pool is marked out and the block is chosen instead.
    assert result.capacity is Capacity.CAPACITY_BLOCK and result.reservation_id == "cr-0local", result.reason
    assert "spot gave 0 of 1" in result.reason
    [replacement] = alive_with(cluster, REPLACES_LABEL, "i-0000000000000dead")
    assert replacement.labels[CAPACITY_TYPE_LABEL] == "capacity-block"
    assert replacement.labels[RESERVATION_LABEL] == "cr-0local"
    assert replacement.labels[INSTANCE_ID_LABEL].startswith("i-0") and len(replacement.labels[INSTANCE_ID_LABEL]) == 19
    assert await provider.available(Capacity.CAPACITY_BLOCK) == 1

    again = await requeuer.requeue(target("i-0000000000000dead"), decision=decision, event=event)
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
    result = await RayModeRequeuer(provider, planner=planner).requeue(
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
