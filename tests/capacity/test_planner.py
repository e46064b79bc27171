"""CapacityPlanner: live inputs (EC2 through the Stubber, history, ICE cache) -> decision, and buying."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from resilienced.capacity.decision import Pool
from resilienced.capacity.ec2 import Ec2Capacity
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.model import Capacity
from resilienced.capacity.ec2 import PURCHASE_KEY_TAG
from resilienced.local.capacity import StaticCapacity
from resilienced.model import Event, Kind, RunFacts, Target
import pytest

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
POOL = Pool("p5.48xlarge", "us-east-1a")
FILTERS = {"Filters": [{"Name": "state", "Values": ["active"]},
                       {"Name": "instance-type", "Values": ["p5.48xlarge"]}], "MaxResults": 100}


def target(instance: str = "i-0aaa") -> Target:
    return Target(instance_id=instance, node=None, ray_cluster="ml/rc", ray_job="ml/job", ray_node_ids=(),
                  checkpoint_uri=None,
                  facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                 capacity_type="spot", instance_count=2))


def itn(event_id: str, minutes_ago: int) -> Event:
    return Event(kind=Kind.SPOT_INTERRUPTION, event_id=event_id, time=NOW - timedelta(minutes=minutes_ago),
                 instance_ids=("i-0aaa",))


def block(rid: str = "cr-block1", available: int = 2) -> dict:
    return {"CapacityReservationId": rid, "InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1a",
            "ReservationType": "capacity-block", "State": "active", "AvailableInstanceCount": available,
            "TotalInstanceCount": 4, "StartDate": NOW - timedelta(days=1), "EndDate": NOW + timedelta(days=3)}


async def test_second_interruption_moves_the_run_to_a_block(ec2) -> None:
    client, stub = ec2
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=CapacityPolicy(), clock=lambda: NOW)
    for _ in range(3):
        stub.add_response("describe_capacity_reservations", {"CapacityReservations": [block()]}, FILTERS)
    _, first = await planner.plan_for(target(), event=itn("e1", 20))
    assert first.capacity is Capacity.SPOT
    _, duplicate = await planner.plan_for(target(), event=itn("e1", 20))  # redelivery: counted once
    assert duplicate.capacity is Capacity.SPOT
    _, second = await planner.plan_for(target(), event=itn("e2", 1))
    assert second.capacity is Capacity.CAPACITY_BLOCK and second.reservation_id == "cr-block1"


async def test_ice_on_spot_falls_back_to_the_block(ec2) -> None:
    client, stub = ec2
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=CapacityPolicy(), clock=lambda: NOW)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": [block()]}, FILTERS)
    planner.mark_unavailable(POOL, Capacity.SPOT)
    _, decision = await planner.plan_for(target(), event=itn("e1", 1))
    assert decision.capacity is Capacity.CAPACITY_BLOCK and "ICE" in decision.reason


def offering_item(start: datetime) -> dict:
    return {"CapacityBlockOfferingId": "cb-0123", "InstanceType": "p5.48xlarge",
            "AvailabilityZone": "us-east-1a", "InstanceCount": 2, "StartDate": start,
            "EndDate": start + timedelta(hours=24), "CapacityBlockDurationHours": 24,
            "UpfrontFee": "2000.00", "CurrencyCode": "USD"}


OFFERINGS = {"InstanceType": "p5.48xlarge", "InstanceCount": 2, "CapacityDurationHours": 24,
             "StartDateRange": NOW, "EndDateRange": NOW + timedelta(minutes=30, hours=24)}
TAGS = [{"ResourceType": "capacity-reservation",
         "Tags": [{"Key": PURCHASE_KEY_TAG, "Value": "e2/ml/job"}]}]


def stormy(planner: CapacityPlanner) -> None:
    planner.history.record(POOL, NOW - timedelta(minutes=30), event_id="e0")


async def test_purchase_dry_run_keeps_the_run_on_on_demand(ec2) -> None:
    client, stub = ec2
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"))
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=policy, clock=lambda: NOW)
    stormy(planner)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []}, FILTERS)
    stub.add_response("describe_capacity_block_offerings",
                      {"CapacityBlockOfferings": [offering_item(NOW + timedelta(minutes=5))]}, OFFERINGS)
    stub.add_client_error("purchase_capacity_block", service_error_code="DryRunOperation",
                          http_status_code=412,
                          expected_params={"CapacityBlockOfferingId": "cb-0123", "InstancePlatform": "Linux/UNIX",
                                           "DryRun": True, "TagSpecifications": TAGS})
    _, decision = await planner.plan_for(target(), event=itn("e2", 1))
    assert decision.capacity is Capacity.ON_DEMAND
    assert "would buy cb-0123" in decision.reason and decision.details["purchase_dry_run"] == "cb-0123"


async def test_purchase_for_real_waits_for_the_block_to_start(ec2) -> None:
    client, stub = ec2
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"), purchase_dry_run=False,
                            allow_on_demand=False)
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=policy, clock=lambda: NOW)
    stormy(planner)
    start = NOW + timedelta(minutes=5)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []}, FILTERS)
    stub.add_response("describe_capacity_block_offerings", {"CapacityBlockOfferings": [offering_item(start)]},
                      OFFERINGS)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []},
                      {"Filters": [{"Name": f"tag:{PURCHASE_KEY_TAG}", "Values": ["e2/ml/job"]}]})
    bought = {**block("cr-bought", available=0), "State": "scheduled", "StartDate": start}
    stub.add_response("purchase_capacity_block", {"CapacityReservation": bought},
                      {"CapacityBlockOfferingId": "cb-0123", "InstancePlatform": "Linux/UNIX", "DryRun": False,
                       "TagSpecifications": TAGS})
    _, decision = await planner.plan_for(target(), event=itn("e2", 1))
    assert decision.capacity is Capacity.WAIT
    assert decision.retry_after == timedelta(minutes=5)
    assert decision.details["bought_reservation_id"] == "cr-bought"


async def test_a_dry_run_plan_never_buys(ec2) -> None:
    client, stub = ec2
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"), purchase_dry_run=False)
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=policy, clock=lambda: NOW)
    stormy(planner)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []}, FILTERS)
    stub.add_response("describe_capacity_block_offerings",
                      {"CapacityBlockOfferings": [offering_item(NOW + timedelta(minutes=5))]}, OFFERINGS)
    # No purchase_capacity_block response is queued: a call would fail the Stubber.
    _, decision = await planner.plan_for(target(), event=itn("e2", 1), dry_run=True)
    assert decision.capacity is Capacity.CAPACITY_BLOCK and decision.offering.offering_id == "cb-0123"
    assert "plan only" in decision.reason
    # ... and a dry run does not count the interruption either.
    assert len(planner.history.recent(POOL, now=NOW)) == 1


async def test_a_run_on_an_expiring_block_moves_to_another_block(ec2) -> None:
    client, stub = ec2
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=CapacityPolicy(), clock=lambda: NOW)
    expiring = {**block("cr-old"), "EndDate": NOW + timedelta(minutes=40)}
    stub.add_response("describe_capacity_reservations",
                      {"CapacityReservations": [expiring, block("cr-new")]}, FILTERS)
    on_block = Target(instance_id="i-0aaa", node=None, ray_cluster="ml/rc", ray_job="ml/job", ray_node_ids=(),
                      checkpoint_uri=None,
                      facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                     capacity_type="reserved", reservation_id="cr-old",
                                     moved_at=(NOW - timedelta(minutes=30)).isoformat(), instance_count=2))
    expiry = Event(kind=Kind.CAPACITY_BLOCK_EXPIRY, event_id="x1", capacity_reservation_id="cr-old",
                   time=NOW)
    request, decision = await planner.plan_for(on_block, event=expiry)
    assert request.exclude == {"cr-old"}
    assert decision.capacity is Capacity.CAPACITY_BLOCK and decision.reservation_id == "cr-new"


async def test_a_run_on_an_expiring_block_goes_to_on_demand_when_no_block_is_left(ec2) -> None:
    client, stub = ec2
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=CapacityPolicy(), clock=lambda: NOW)
    expiring = {**block("cr-old"), "EndDate": NOW + timedelta(minutes=40)}
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": [expiring]}, FILTERS)
    on_block = Target(instance_id="i-0aaa", node=None, ray_cluster="ml/rc", ray_job="ml/job", ray_node_ids=(),
                      checkpoint_uri=None,
                      facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                     capacity_type="capacity-block", reservation_id="cr-old",
                                     moved_at=(NOW - timedelta(minutes=30)).isoformat()))
    row = await planner.target_plan(on_block, event=Event(kind=Kind.CAPACITY_BLOCK_EXPIRY, event_id="x2",
                                                          capacity_reservation_id="cr-old", time=NOW))
    assert row["capacity"] == "on-demand" and "cool-down" in row["reason"]
    assert row["instance_id"] == "i-0aaa"  # the target's own fields stay


async def test_buying_with_a_source_that_cannot_buy_says_so() -> None:
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"))
    planner = CapacityPlanner(source=StaticCapacity(), policy=policy, clock=lambda: NOW)
    stormy(planner)
    _, decision = await planner.plan_for(target(), event=itn("e2", 1))
    assert decision.capacity is Capacity.ON_DEMAND and "cannot buy" in decision.reason


async def test_interruptions_are_counted_per_pool_once_per_event() -> None:
    from prometheus_client import CollectorRegistry

    from resilienced.capacity.planner import interruption_counter

    registry = CollectorRegistry()
    planner = CapacityPlanner(source=StaticCapacity([]), policy=CapacityPolicy(), clock=lambda: NOW,
                              interruptions=interruption_counter(registry))
    await planner.plan_for(target(), event=itn("e1", 20))
    await planner.plan_for(target(), event=itn("e1", 20))  # redelivery: counted once
    await planner.plan_for(target(), event=itn("e2", 1))
    await planner.plan_for(target(), event=itn("e3", 1), dry_run=True)  # a dry run counts nothing
    labels = {"instance_type": "p5.48xlarge", "availability_zone": "us-east-1a"}
    assert registry.get_sample_value("resilienced_interruptions_total", labels) == 2


async def test_a_bought_block_carries_the_tags_the_ec2nodeclass_selects_on(ec2) -> None:
    """--purchase-tags go on the block with the purchase key, so Karpenter's
    capacityReservationSelectorTerms (tags) select it and Karpenter can launch into it."""
    client, stub = ec2
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"), purchase_dry_run=False,
                            allow_on_demand=False,
                            purchase_tags=("karpenter.sh/discovery=train", "team=ml"))
    planner = CapacityPlanner(source=Ec2Capacity(client), policy=policy, clock=lambda: NOW)
    stormy(planner)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []}, FILTERS)
    stub.add_response("describe_capacity_block_offerings",
                      {"CapacityBlockOfferings": [offering_item(NOW + timedelta(minutes=5))]}, OFFERINGS)
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []},
                      {"Filters": [{"Name": f"tag:{PURCHASE_KEY_TAG}", "Values": ["e3/ml/job"]}]})
    bought = {**block("cr-bought", available=0), "State": "scheduled", "StartDate": NOW + timedelta(minutes=5)}
    stub.add_response("purchase_capacity_block", {"CapacityReservation": bought}, {
        "CapacityBlockOfferingId": "cb-0123", "InstancePlatform": "Linux/UNIX", "DryRun": False,
        "TagSpecifications": [{"ResourceType": "capacity-reservation", "Tags": [
            {"Key": PURCHASE_KEY_TAG, "Value": "e3/ml/job"},
            {"Key": "karpenter.sh/discovery", "Value": "train"}, {"Key": "team", "Value": "ml"}]}]})
    _, decision = await planner.plan_for(target(), event=itn("e3", 1))
    assert decision.details["bought_reservation_id"] == "cr-bought"
    stub.assert_no_pending_responses()


def requeued(event_id: str, capacity: str, reservation: str | None = None, **extra) -> Target:
    """A target whose run records a requeue already applied (resilienced.io/requeued-for ...)."""
    t = target()
    return Target(instance_id=t.instance_id, node=None, ray_cluster=t.ray_cluster, ray_job=t.ray_job,
                  ray_node_ids=(), checkpoint_uri=None,
                  facts=replace(t.facts, requeued_for=event_id, requeued_capacity=capacity,
                                requeued_reservation_id=reservation, **extra))


async def test_a_requeue_applied_for_this_event_is_kept_not_decided_again() -> None:
    """A replica killed after its requeue and before its run claim was done leaves the event to
    another, whose interruption history differs: it keeps the applied move instead of moving the
    gang a second time (the reliability campaign's finding, docs/reliability.md)."""
    planner = CapacityPlanner(source=StaticCapacity([]), policy=CapacityPolicy(), clock=lambda: NOW)
    _, fresh = await planner.plan_for(target(), event=itn("e1", 1))
    assert fresh.capacity is Capacity.SPOT  # this replica alone would stay on Spot

    _, kept = await planner.plan_for(requeued("e2", "on-demand"), event=itn("e2", 1))
    assert kept.capacity is Capacity.ON_DEMAND and "kept" in kept.reason and kept.details["kept"] is True
    _, block_kept = await planner.plan_for(requeued("e3", "capacity-block", "cr-gone"), event=itn("e3", 1))
    assert (block_kept.capacity, block_kept.reservation_id) == (Capacity.CAPACITY_BLOCK, "cr-gone")


async def test_a_requeue_for_another_event_or_an_elastic_run_is_decided_again() -> None:
    def planner() -> CapacityPlanner:  # one interruption each: a fresh decision stays on Spot
        return CapacityPlanner(source=StaticCapacity([]), policy=CapacityPolicy(), clock=lambda: NOW)

    _, other = await planner().plan_for(requeued("e-old", "on-demand"), event=itn("e1", 1))
    assert other.capacity is Capacity.SPOT and "kept" not in other.details
    _, elastic = await planner().plan_for(requeued("e2", "on-demand", elastic=True), event=itn("e2", 1))
    assert elastic.capacity is Capacity.SPOT
    _, no_block = await planner().plan_for(requeued("e3", "capacity-block"), event=itn("e3", 1))  # no id
    assert no_block.capacity is Capacity.SPOT
