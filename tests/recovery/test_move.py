"""The one owner of moving a run (``recovery.move.Mover``, issue #41): it decides again when an
applier of either mode finds no capacity, and withdraws before a fallback is applied.

The applier here is a stand-in of the ``Requeuer`` port that has no room in the pools it is told
to refuse (as a node provider or a cloud with insufficient capacity would); the planner is the
real one over static blocks.  Ray mode's applier on a real Ray cluster: tests/ray/test_requeue.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.model import Capacity, CapacityDecision, Event, Kind, RequeueResult, RunFacts, Target
from resilienced.ports import CapacityReservation, NoCapacity, Requeuer, Withdraws
from resilienced.recovery.move import Mover
from resilienced.recovery.steps import RequeueStep

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
TARGET = Target(instance_id="i-0aaa", node=None, ray_cluster="ml/rc", ray_job=None, ray_node_ids=(),
                checkpoint_uri=None, facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                                    capacity_type="spot", instance_count=2))
EVENT = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-move", time=NOW, instance_ids=("i-0aaa",))


def block(rid: str = "cr-a") -> StaticCapacity:
    return StaticCapacity([CapacityReservation(
        reservation_id=rid, instance_type="p5.48xlarge", availability_zone="us-east-1a",
        reservation_type="capacity-block", state="active", available_instances=2, total_instances=2,
        start=NOW - timedelta(days=1), end=NOW + timedelta(days=3))])


class FullPools:
    """A ``Requeuer`` (and ``Withdraws``) whose listed pools have no room; it records what it was asked."""

    kind = "kubernetes"

    def __init__(self, *full: str) -> None:
        self.full = set(full)
        self.asked: list[str] = []
        self.withdrawn: list[tuple[Capacity, str | None]] = []

    async def requeue(self, target: Target, *, decision: CapacityDecision, event: Event,
                      dry_run: bool = False) -> RequeueResult:
        where = decision.reservation_id or decision.capacity.value
        self.asked.append(where)
        if not decision.places:
            return RequeueResult.waiting(target, kind=self.kind, decision=decision, dry_run=dry_run)
        if where in self.full:
            raise NoCapacity(decision.capacity, "full", asked=2, given=0)
        return RequeueResult(run_key=target.run_key, kind=self.kind, capacity=decision.capacity,
                             reservation_id=decision.reservation_id, reason="placed", changes=("patched",),
                             decision=decision)

    async def withdraw(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> list[str]:
        self.withdrawn.append((capacity, reservation_id))
        return []


def test_the_stand_in_is_a_requeuer_that_withdraws() -> None:
    assert isinstance(FullPools(), Requeuer) and isinstance(FullPools(), Withdraws)


async def test_no_capacity_in_the_decided_pool_is_decided_again_in_kubernetes_mode_too() -> None:
    applier = FullPools("spot")
    mover = Mover(planner=CapacityPlanner(source=block(), policy=CapacityPolicy(), clock=lambda: NOW),
                  requeue=applier)
    moved = await mover.move(TARGET, event=EVENT)
    assert applier.asked == ["spot", "cr-a"]  # one interruption: Spot first; it was full: the block
    assert (moved.result.capacity, moved.result.reservation_id) == (Capacity.CAPACITY_BLOCK, "cr-a")
    assert moved.result.details["tried"] == ["spot gave 0 of 2"]
    assert moved.result.reason.startswith("spot gave 0 of 2; then placed")
    assert moved.replacement is None
    assert "replacement" not in RequeueStep.of(moved.result, replacement=moved.replacement).as_json()


async def test_when_every_pool_is_full_the_run_waits_with_each_pool_named() -> None:
    applier = FullPools("spot", "cr-a")
    mover = Mover(planner=CapacityPlanner(source=block(), policy=CapacityPolicy(allow_on_demand=False),
                                          clock=lambda: NOW), requeue=applier)
    result = await mover.apply(TARGET, decision=CapacityDecision(Capacity.SPOT, "first"), event=EVENT)
    assert result.capacity is Capacity.WAIT and result.retry_after is not None, result.reason
    assert result.details["tried"] == ["spot gave 0 of 2", "capacity-block gave 0 of 2"]
    assert applier.asked == ["spot", "cr-a", "wait"]


async def test_a_fallback_withdraws_from_the_stalled_capacity_before_it_is_applied() -> None:
    applier = FullPools()
    planner = CapacityPlanner(source=block(), policy=CapacityPolicy(), clock=lambda: NOW)
    mover = Mover(planner=planner, requeue=applier)
    stalled = replace(TARGET, facts=replace(TARGET.facts, exclude=("spot",)))
    decision = await mover.fallback(stalled, event=EVENT)
    assert decision.reservation_id == "cr-a"
    result = await mover.apply(stalled, decision=decision, event=EVENT, withdraw=(Capacity.SPOT, None))
    assert applier.withdrawn == [(Capacity.SPOT, None)] and applier.asked == ["cr-a"] and result.changed
