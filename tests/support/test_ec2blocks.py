"""The fault proxy's Capacity Block answers (tests/support/ec2blocks.py) through the real client.

The daemon's own adapter (:class:`~resilienced.capacity.ec2.Ec2Capacity`) on an aiobotocore client
made as the daemon makes it (:func:`resilienced.aws.clients.open_client`: standard retries, 3
attempts) talks to the proxy over HTTP: botocore parses each answer against its ec2 model, so an
answer out of the API reference's shape fails here, and what the adapter returns is what the
capacity decision reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from resilienced.aws.clients import open_client
from resilienced.capacity.ec2 import PURCHASE_KEY_TAG, Ec2Capacity
from resilienced.errors import BackendUnavailable
from resilienced.local.aws import FAKE_CREDENTIALS
from tests.support.ec2blocks import Ec2Blocks, Offering
from tests.support.faultproxy import FaultProxy, aws_action

pytestmark = pytest.mark.integration

TYPE, AZ = "p5.48xlarge", "us-east-1a"


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[FaultProxy, Ec2Blocks, Ec2Capacity]]:
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    # nothing behind the proxy: the three calls are answered by the stand-in, anything else fails
    proxy = await FaultProxy("http://127.0.0.1:9").start()
    blocks = Ec2Blocks()
    blocks.install(proxy)
    try:
        async with open_client("ec2", region="us-east-1", endpoint_url=proxy.url) as client:
            yield proxy, blocks, Ec2Capacity(client)
    finally:
        await proxy.stop()


async def test_reservations_parse_into_what_the_decision_reads(world) -> None:
    _, blocks, ec2 = world
    block = blocks.add_block(instance_type=TYPE, availability_zone=AZ, total=4, available=3,
                             tags={"team": "ml"})
    blocks.add_block(instance_type="p4d.24xlarge", availability_zone=AZ, total=2)
    got = await ec2.reservations(instance_type=TYPE)
    assert [r.reservation_id for r in got] == [block.reservation_id]
    (r,) = got
    assert (r.instance_type, r.availability_zone, r.reservation_type, r.state) == (TYPE, AZ, "capacity-block", "active")
    assert (r.available_instances, r.total_instances) == (3, 4)
    assert r.start is not None and r.start.tzinfo is not None and r.start < datetime.now(timezone.utc)
    assert r.end is not None and r.end - datetime.now(timezone.utc) > timedelta(hours=23)
    assert blocks.calls["DescribeCapacityReservations"] == 1


async def test_the_instances_of_a_block_parse_and_other_instance_queries_go_to_the_backend(world) -> None:
    proxy, blocks, ec2 = world
    block = blocks.add_block(instance_type=TYPE, availability_zone=AZ, total=2, available=0,
                             instances=["i-0000000000000000a", "i-0000000000000000b"])
    blocks.add_block(instance_type=TYPE, availability_zone=AZ, total=1, instances=["i-0000000000000000c"])
    got = await ec2.reservation_instances(reservation_id=block.reservation_id)
    assert got == ["i-0000000000000000a", "i-0000000000000000b"]
    assert blocks.calls["DescribeInstances"] == 1
    before = proxy.requests
    # no capacity-reservation-id filter: forwarded to the backend (none here: the proxy's own 500)
    with pytest.raises(Exception):  # noqa: B017 - which parse error botocore raises is not the point
        await ec2._client.describe_instances(InstanceIds=["i-0000000000000000a"])
    assert proxy.requests > before and blocks.calls["DescribeInstances"] == 1


async def test_offerings_and_a_purchase_parse_and_the_purchase_key_finds_the_block(world) -> None:
    _, blocks, ec2 = world
    blocks.offerings.append(Offering("cb-0123456789abcdef0", TYPE, AZ, "3120.00"))
    now = datetime.now(timezone.utc)
    offers = await ec2.offerings(instance_type=TYPE, instance_count=2, duration=timedelta(hours=2),
                                 start_after=now, start_before=now + timedelta(minutes=30))
    (offer,) = offers
    assert (offer.offering_id, offer.instance_type, offer.availability_zone, offer.instance_count) == \
        ("cb-0123456789abcdef0", TYPE, AZ, 2)
    assert offer.upfront_fee == Decimal("3120.00") and offer.currency == "USD"
    assert offer.end - offer.start == timedelta(hours=24)  # 2 h rounds up to a 1-day block

    dry = await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="ev-1/ns/run", dry_run=True,
                             price_cap=Decimal(5000))
    assert dry.dry_run and dry.reservation is None and blocks.dry_runs == 1 and blocks.purchases == []

    bought = await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="ev-1/ns/run", dry_run=False,
                                price_cap=Decimal(5000), tags={"resilienced.io/pool": "gpu"})
    assert bought.reservation is not None and bought.reservation.state == "payment-pending"
    assert len(blocks.purchases) == 1
    assert blocks.purchases[0]["tags"] == {PURCHASE_KEY_TAG: "ev-1/ns/run", "resilienced.io/pool": "gpu"}
    found = await ec2.purchased(purchase_key="ev-1/ns/run")
    assert found is not None and found.reservation_id == bought.reservation.reservation_id
    assert found.state == "active"  # paid: the next describe sees it active
    assert await ec2.purchased(purchase_key="ev-2/ns/run") is None
    again = await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="ev-1/ns/run", dry_run=False,
                               price_cap=Decimal(5000))
    assert "already bought" in again.message and len(blocks.purchases) == 1


async def test_a_lost_purchase_answer_buys_one_block_not_one_per_sdk_retry(world) -> None:
    """PurchaseCapacityBlock takes no client token: a retry of it is a second purchase. The SDK's
    own retries (standard mode, 3 retries) resent it after a lost answer, buying up to three
    blocks (the reliability campaign's purchase-answer-lost trial); the adapter makes the call
    once, and its caller's retry finds the block by its purchase key."""
    proxy, blocks, ec2 = world
    blocks.offerings.append(Offering("cb-0123456789abcdef0", TYPE, AZ, "3120.00"))
    now = datetime.now(timezone.utc)
    (offer,) = await ec2.offerings(instance_type=TYPE, instance_count=1, duration=timedelta(hours=1),
                                   start_after=now, start_before=now + timedelta(minutes=30))
    lost = proxy.lose(match=aws_action("PurchaseCapacityBlock"), times=3)
    with pytest.raises(BackendUnavailable):
        await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="ev-1/ns/run", dry_run=False,
                           price_cap=Decimal(5000))
    assert lost.hits == 1 and len(blocks.purchases) == 1
    again = await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="ev-1/ns/run", dry_run=False,
                               price_cap=Decimal(5000))
    assert again.reservation is not None and again.reservation.reservation_id == blocks.purchases[0]["reservation_id"]
    assert len(blocks.purchases) == 1


@pytest.mark.parametrize("status,code", [(503, "RequestLimitExceeded"), (500, "InternalError")])
async def test_a_refused_purchase_is_not_resent_by_the_sdk(world, status: int, code: str) -> None:
    proxy, blocks, ec2 = world
    blocks.offerings.append(Offering("cb-0123456789abcdef0", TYPE, AZ, "3120.00"))
    now = datetime.now(timezone.utc)
    (offer,) = await ec2.offerings(instance_type=TYPE, instance_count=1, duration=timedelta(hours=1),
                                   start_after=now, start_before=now + timedelta(minutes=30))
    fault = proxy.fail(status, code=code, style="ec2", match=aws_action("PurchaseCapacityBlock"), times=3)
    with pytest.raises(BackendUnavailable, match=code):
        await ec2.purchase(offer, platform="Linux/UNIX", purchase_key="k", dry_run=False, price_cap=Decimal(5000))
    assert fault.hits == 1 and blocks.purchases == []
