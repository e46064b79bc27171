"""The fallback of a stalled recovery and the chain replay shows: decided again with the stalled
capacity passed over, nothing counted again (``CapacityPlanner.fallback`` / ``chain``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from resilienced.capacity.decision import Pool
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.model import Capacity
from resilienced.local.capacity import StaticCapacity
from resilienced.model import Event, Kind, RunFacts, Target
from resilienced.ports import CapacityReservation
from resilienced.app.replay import target_cell

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
POOL = Pool("p5.48xlarge", "us-east-1a")
TARGET = Target(instance_id="i-0aaa", node=None, ray_cluster="ml/rc", ray_job="ml/job", ray_node_ids=(),
                checkpoint_uri=None, facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                                    capacity_type="spot", instance_count=2))


def blocks(*ids: str) -> StaticCapacity:
    return StaticCapacity([CapacityReservation(
        reservation_id=rid, instance_type="p5.48xlarge", availability_zone="us-east-1a",
        reservation_type="capacity-block", state="active", available_instances=2, total_instances=2,
        start=NOW - timedelta(days=1), end=NOW + timedelta(days=3 + n)) for n, rid in enumerate(ids)])


def itn(event_id: str) -> Event:
    return Event(kind=Kind.SPOT_INTERRUPTION, event_id=event_id, time=NOW - timedelta(minutes=1),
                 instance_ids=("i-0aaa",))


async def stormy_planner(source: StaticCapacity, **policy) -> CapacityPlanner:
    planner = CapacityPlanner(source=source, policy=CapacityPolicy(**policy), clock=lambda: NOW)
    await planner.plan_for(TARGET, event=itn("e1"))  # two interruptions: Spot is unreliable
    return planner


async def test_a_fallback_passes_over_the_stalled_block_and_counts_nothing_again() -> None:
    planner = await stormy_planner(blocks("cr-a", "cr-b"))
    _, first = await planner.plan_for(TARGET, event=itn("e2"))
    assert (first.capacity, first.reservation_id) == (Capacity.CAPACITY_BLOCK, "cr-b")  # the latest end
    counted = planner.history.recent(POOL, now=NOW)
    stalled = replace(TARGET, facts=replace(TARGET.facts, exclude=("cr-b",)))
    second = await planner.fallback(stalled, event=itn("e2"))
    assert (second.capacity, second.reservation_id) == (Capacity.CAPACITY_BLOCK, "cr-a")
    assert planner.history.recent(POOL, now=NOW) == counted  # the notice was counted once, by plan_for
    third = await planner.fallback(replace(TARGET, facts=replace(TARGET.facts, exclude=("cr-b", "cr-a"))),
                                   event=itn("e2"))
    assert third.capacity is Capacity.ON_DEMAND


async def test_a_replica_that_never_saw_the_notice_counts_it_before_it_falls_back() -> None:
    """The history is per replica: the replica that takes a follow-up over counts its notice, so its
    fallback does not go back to the pool just interrupted (issue #40, two daemon processes)."""
    source = blocks("cr-a")
    first_replica = CapacityPlanner(source=source, policy=CapacityPolicy(interruption_threshold=1), clock=lambda: NOW)
    _, first = await first_replica.plan_for(TARGET, event=itn("e1"))
    assert first.capacity is Capacity.CAPACITY_BLOCK
    other = CapacityPlanner(source=source, policy=CapacityPolicy(interruption_threshold=1), clock=lambda: NOW)
    stalled = replace(TARGET, facts=replace(TARGET.facts, exclude=("cr-a",)))
    fallback = await other.fallback(stalled, event=itn("e1"))
    assert fallback.capacity is Capacity.ON_DEMAND, fallback.reason
    assert len(other.history.recent(POOL, now=NOW)) == 1
    assert (await other.fallback(stalled, event=itn("e1"))).capacity is Capacity.ON_DEMAND
    assert len(other.history.recent(POOL, now=NOW)) == 1  # once per event id


async def test_the_chain_is_the_ranking_after_the_first_decision() -> None:
    planner = await stormy_planner(blocks("cr-a"))
    row = await planner.target_plan(TARGET, event=itn("e2"))
    assert (row["capacity"], row["reservation_id"]) == ("capacity-block", "cr-a")
    assert [f["capacity"] for f in row["fallbacks"]] == ["on-demand", "wait"]
    assert "On-Demand is not allowed" not in row["fallbacks"][0]["reason"]
    assert target_cell({**row, "ray_job": "ml/job"}) == "i-0aaa>ml/job:capacity-block[then on-demand>wait]"

    no_on_demand = await stormy_planner(blocks(), allow_on_demand=False)
    row = await no_on_demand.target_plan(TARGET, event=itn("e2"))
    assert row["capacity"] == "wait" and row["fallbacks"] == []  # nothing to fall back from
