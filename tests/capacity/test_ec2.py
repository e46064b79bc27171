"""Ec2Capacity against botocore's Stubber: requests and responses checked against the ec2 model."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

import resilienced.capacity.ec2 as ec2_module
from resilienced.capacity.ec2 import Ec2Capacity
from resilienced.model import CapacityOffering
from resilienced.capacity.ec2 import IAM_ACTIONS, PURCHASE_KEY_TAG, block_duration_hours
from resilienced.errors import BackendUnavailable, PermanentError
from resilienced.ports import CapacitySource

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
ACTIVE = [{"Name": "state", "Values": ["active"]}]


def cr(rid: str, *, rtype: str = "capacity-block", state: str = "active", available: int = 2) -> dict:
    return {
        "CapacityReservationId": rid, "InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1a",
        "ReservationType": rtype, "State": state, "AvailableInstanceCount": available,
        "TotalInstanceCount": 4, "StartDate": NOW - timedelta(days=1), "EndDate": NOW + timedelta(days=2),
        "InstancePlatform": "Linux/UNIX", "Tenancy": "default", "InstanceMatchCriteria": "targeted",
    }


async def test_reservations_paginates_and_keeps_only_active_capacity_blocks(ec2) -> None:
    client, stub = ec2
    filters = [*ACTIVE, {"Name": "instance-type", "Values": ["p5.48xlarge"]}]
    stub.add_response("describe_capacity_reservations",
                      {"CapacityReservations": [cr("cr-block1"), cr("cr-odcr", rtype="default")], "NextToken": "p2"},
                      {"Filters": filters, "MaxResults": 100})
    stub.add_response("describe_capacity_reservations",
                      {"CapacityReservations": [cr("cr-block2", available=0)]},
                      {"Filters": filters, "MaxResults": 100, "NextToken": "p2"})
    source = Ec2Capacity(client)
    assert isinstance(source, CapacitySource)
    got = await source.reservations(instance_type="p5.48xlarge")
    assert [r.reservation_id for r in got] == ["cr-block1", "cr-block2"]
    assert got[0].reservation_type == "capacity-block" and got[0].available_instances == 2
    assert got[0].end == NOW + timedelta(days=2) and got[0].end.tzinfo is not None


async def test_reservation_instances_uses_the_reservation_filter(ec2) -> None:
    client, stub = ec2
    stub.add_response(
        "describe_instances",
        {"Reservations": [{"Instances": [{"InstanceId": "i-0aaa"}, {"InstanceId": "i-0bbb"}]}]},
        {"Filters": [{"Name": "capacity-reservation-id", "Values": ["cr-block1"]},
                     {"Name": "instance-state-name", "Values": ["pending", "running"]}],
         "MaxResults": 100})
    assert await Ec2Capacity(client).reservation_instances(reservation_id="cr-block1") == ["i-0aaa", "i-0bbb"]
    with pytest.raises(ValueError, match="reservation_id"):
        await Ec2Capacity(client).reservation_instances(reservation_id="block1")


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("RequestLimitExceeded", 503, BackendUnavailable),
        ("InternalError", 500, BackendUnavailable),
        ("UnauthorizedOperation", 403, PermanentError),
        ("InvalidParameterValue", 400, PermanentError),
    ],
    ids=["throttled", "5xx", "no permission", "bad parameter"],
)
async def test_errors_are_translated_at_the_boundary(ec2, code: str, status: int, expected: type) -> None:
    client, stub = ec2
    stub.add_client_error("describe_capacity_reservations", service_error_code=code,
                          service_message="nope", http_status_code=status)
    with pytest.raises(expected) as info:
        await Ec2Capacity(client).reservations()
    assert code in str(info.value) and "DescribeCapacityReservations" in str(info.value)


def offering_item(oid: str = "cb-0123", fee: str = "2000.00") -> dict:
    return {
        "CapacityBlockOfferingId": oid, "InstanceType": "p5.48xlarge", "AvailabilityZone": "us-east-1a",
        "InstanceCount": 2, "StartDate": NOW + timedelta(minutes=10),
        "EndDate": NOW + timedelta(minutes=10, hours=48), "CapacityBlockDurationHours": 48,
        "UpfrontFee": fee, "CurrencyCode": "USD", "Tenancy": "default",
    }


async def test_offerings_ask_for_a_purchasable_duration(ec2) -> None:
    client, stub = ec2
    stub.add_response(
        "describe_capacity_block_offerings",
        {"CapacityBlockOfferings": [offering_item()]},
        {"InstanceType": "p5.48xlarge", "InstanceCount": 2, "CapacityDurationHours": 48,
         "StartDateRange": NOW, "EndDateRange": NOW + timedelta(minutes=30, hours=48)})
    got = await Ec2Capacity(client).offerings(
        instance_type="p5.48xlarge", instance_count=2, duration=timedelta(hours=25),
        start_after=NOW, start_before=NOW + timedelta(minutes=30))
    assert got == [CapacityOffering("cb-0123", "p5.48xlarge", "us-east-1a", 2, NOW + timedelta(minutes=10),
                                    NOW + timedelta(minutes=10, hours=48), Decimal("2000.00"))]


@pytest.mark.parametrize(
    ("needed", "hours"),
    [(timedelta(hours=1), 24), (timedelta(days=14), 336), (timedelta(days=15), 504),
     (timedelta(days=182), 4368)],
    ids=["an hour is a day", "14 days", "15 days round to 3 weeks", "26 weeks"],
)
def test_block_durations(needed: timedelta, hours: int) -> None:
    assert block_duration_hours(needed) == hours


def test_block_duration_too_long() -> None:
    with pytest.raises(ValueError, match="182 days"):
        block_duration_hours(timedelta(days=183))


OFFER = CapacityOffering("cb-0123", "p5.48xlarge", "us-east-1a", 2, NOW + timedelta(minutes=10),
                         NOW + timedelta(hours=48), Decimal("2000.00"))
TAGS = [{"ResourceType": "capacity-reservation", "Tags": [{"Key": PURCHASE_KEY_TAG, "Value": "ev-1/ml/job"}]}]


async def test_purchase_dry_run_buys_nothing(ec2) -> None:
    client, stub = ec2
    stub.add_client_error(
        "purchase_capacity_block", service_error_code="DryRunOperation",
        service_message="Request would have succeeded, but DryRun flag is set.", http_status_code=412,
        expected_params={"CapacityBlockOfferingId": "cb-0123", "InstancePlatform": "Linux/UNIX",
                         "DryRun": True, "TagSpecifications": TAGS})
    result = await Ec2Capacity(client).purchase(OFFER, platform="Linux/UNIX", purchase_key="ev-1/ml/job",
                                                dry_run=True, price_cap=Decimal("5000"))
    assert result.dry_run and result.reservation is None and "would buy" in result.message


async def test_purchase_buys_once_per_key(ec2) -> None:
    client, stub = ec2
    by_tag = {"Filters": [{"Name": f"tag:{PURCHASE_KEY_TAG}", "Values": ["ev-1/ml/job"]}]}
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": []}, by_tag)
    bought = cr("cr-new", state="scheduled", available=0)
    stub.add_response(
        "purchase_capacity_block", {"CapacityReservation": bought},
        {"CapacityBlockOfferingId": "cb-0123", "InstancePlatform": "Linux/UNIX", "DryRun": False,
         "TagSpecifications": TAGS})
    source = Ec2Capacity(client)
    first = await source.purchase(OFFER, platform="Linux/UNIX", purchase_key="ev-1/ml/job",
                                  dry_run=False, price_cap=Decimal("5000"))
    assert first.reservation.reservation_id == "cr-new" and not first.dry_run
    # A redelivered event finds the block it bought: no second PurchaseCapacityBlock call.
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": [bought]}, by_tag)
    again = await source.purchase(OFFER, platform="Linux/UNIX", purchase_key="ev-1/ml/job",
                                  dry_run=False, price_cap=Decimal("5000"))
    assert again.reservation.reservation_id == "cr-new" and "already bought" in again.message


async def test_purchase_refuses_above_the_cap_without_calling_ec2(ec2) -> None:
    client, _ = ec2
    with pytest.raises(PermanentError, match="above the price cap"):
        await Ec2Capacity(client).purchase(OFFER, platform="Linux/UNIX", purchase_key="k",
                                           dry_run=False, price_cap=Decimal("1999.99"))


def test_iam_actions_are_the_calls_made() -> None:
    source = Path(ec2_module.__file__).read_text()
    calls = {"describe_capacity_reservations": "ec2:DescribeCapacityReservations",
             "describe_instances": "ec2:DescribeInstances",
             "describe_capacity_block_offerings": "ec2:DescribeCapacityBlockOfferings",
             "purchase_capacity_block": "ec2:PurchaseCapacityBlock"}
    for call, action in calls.items():
        assert call in source and action in IAM_ACTIONS
    assert "ec2:CreateTags" in IAM_ACTIONS  # tag-on-create of the purchased block
