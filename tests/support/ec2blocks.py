"""EC2 Capacity Blocks for the fault proxy: the calls moto 5.2.5 lacks, answered from data.

moto 5.2.5 implements none of ``DescribeCapacityReservations``, ``DescribeCapacityBlockOfferings``
and ``PurchaseCapacityBlock`` (NotImplementedError, HTTP 500). :class:`Ec2Blocks` answers them in
the EC2 query protocol's XML, in the shape of the EC2 API reference:

* ``DescribeCapacityReservations``
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeCapacityReservations.html):
  ``capacityReservationSet`` of ``CapacityReservation`` items
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CapacityReservation.html), filtered
  by ``CapacityReservationId.N`` and by ``Filter.N`` (the filters the daemon uses: ``state``,
  ``instance-type``, ``availability-zone``, ``reservation-type`` and ``tag:<key>``; several values
  of one filter match any, several filters must all match). One page: no ``nextToken``.
* ``DescribeCapacityBlockOfferings``
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeCapacityBlockOfferings.html):
  ``capacityBlockOfferingSet`` of ``CapacityBlockOffering`` items
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CapacityBlockOffering.html), one per
  offering of the data for the requested ``InstanceType``, with the requested ``InstanceCount`` and
  ``CapacityDurationHours``, starting at ``StartDateRange`` (or now) plus the offering's delay.
* ``PurchaseCapacityBlock``
  (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_PurchaseCapacityBlock.html):
  ``CapacityBlockOfferingId``, ``InstancePlatform``, ``DryRun`` and ``TagSpecification.N`` are its
  only parameters: it takes **no client token**, so EC2 documents no idempotency for it, and this
  stand-in buys once per request that reaches it (every one recorded in :attr:`purchases`, so a test
  counts them). ``DryRun`` answers 412 ``DryRunOperation`` (the API reference's DryRun parameter).
  An offering this stand-in never answered is 400 ``InvalidParameterValue``. The block bought is
  ``payment-pending`` in the answer and ``active`` from the next ``DescribeCapacityReservations``
  on (states: "View Capacity Blocks" in the EC2 User Guide,
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-view.html:
  payment-pending -> scheduled -> active; its offerings here start now, so ``scheduled`` is
  skipped), carrying the request's tags (``TagSpecification`` of resource type
  ``capacity-reservation``), so a ``tag:`` filter finds it.

* ``DescribeInstances`` with a ``capacity-reservation-id`` filter (the instances in a block;
  https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_DescribeInstances.html, its filter
  list names ``capacity-reservation-id`` and ``instance-state-name``): ``reservationSet`` of
  ``Reservation`` items with an ``instancesSet``, from the blocks' :attr:`Block.instances` (all
  ``running``); moto holds no instance of these blocks. Any other DescribeInstances goes to moto.

Install with :meth:`Ec2Blocks.install` on a :class:`~tests.support.faultproxy.FaultProxy`; the
answers are standing rules, and faults armed later on the proxy win over them (and a ``lose``
rule lets the purchase happen and drops its answer).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

from aiohttp import web

XMLNS = "http://ec2.amazonaws.com/doc/2016-11-15/"
ACCOUNT = "123456789012"
ACTIONS = ("DescribeCapacityReservations", "DescribeCapacityBlockOfferings", "PurchaseCapacityBlock")


def utc(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def ec2_error(code: str, message: str) -> str:
    """An EC2 error body (``Response/Errors/Error``, ``RequestID``: botocore's EC2QueryParser)."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{escape(code)}</Code>'
            f"<Message>{escape(message)}</Message></Error></Errors>"
            f"<RequestID>{uuid.uuid4()}</RequestID></Response>")


@dataclass
class Block:
    """A Capacity Reservation of type ``capacity-block`` (the fields the daemon reads, API names)."""

    reservation_id: str
    instance_type: str
    availability_zone: str
    total: int
    available: int
    start: datetime
    end: datetime
    state: str = "active"
    tags: dict[str, str] = field(default_factory=dict)
    next_state: str | None = None  # the state from the next DescribeCapacityReservations on
    instances: list[str] = field(default_factory=list)  # ids of the instances running in it

    def xml(self) -> str:
        tags = "".join(f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>"
                       for k, v in sorted(self.tags.items()))
        return (f"<capacityReservationId>{self.reservation_id}</capacityReservationId>"
                f"<ownerId>{ACCOUNT}</ownerId>"
                f"<capacityReservationArn>arn:aws:ec2:us-east-1:{ACCOUNT}:capacity-reservation/"
                f"{self.reservation_id}</capacityReservationArn>"
                f"<instanceType>{self.instance_type}</instanceType><instancePlatform>Linux/UNIX</instancePlatform>"
                f"<availabilityZone>{self.availability_zone}</availabilityZone><tenancy>default</tenancy>"
                f"<totalInstanceCount>{self.total}</totalInstanceCount>"
                f"<availableInstanceCount>{self.available}</availableInstanceCount>"
                f"<ebsOptimized>true</ebsOptimized><ephemeralStorage>false</ephemeralStorage>"
                f"<state>{self.state}</state><startDate>{utc(self.start)}</startDate>"
                f"<endDate>{utc(self.end)}</endDate><endDateType>limited</endDateType>"
                f"<instanceMatchCriteria>targeted</instanceMatchCriteria>"
                f"<createDate>{utc(self.start)}</createDate><tagSet>{tags}</tagSet>"
                f"<reservationType>capacity-block</reservationType>")

    def matches(self, name: str, values: list[str]) -> bool:
        if name.startswith("tag:"):
            return self.tags.get(name[4:]) in values
        have = {"state": self.state, "instance-type": self.instance_type,
                "availability-zone": self.availability_zone, "reservation-type": "capacity-block",
                "owner-id": ACCOUNT}.get(name)
        if have is None:  # a filter this stand-in does not model: refuse rather than ignore it
            raise ValueError(f"filter {name!r} is not modelled by tests/support/ec2blocks.py")
        return have in values


@dataclass
class Offering:
    """What DescribeCapacityBlockOfferings offers for one instance type (count and duration are
    the request's, as EC2 answers them)."""

    offering_id: str
    instance_type: str
    availability_zone: str
    upfront_fee: str
    delay: timedelta = timedelta(0)  # start after StartDateRange (or now)


class Ec2Blocks:
    """The Capacity Block calls of one EC2 account, answered from :attr:`blocks` and
    :attr:`offerings`; :attr:`purchases` records every PurchaseCapacityBlock that bought.

    ``on_active(block)`` is called when a block becomes ``active`` (Karpenter's EC2NodeClass
    status can follow it: see tests/chaos/world.py). ``clock`` gives the current time.
    """

    def __init__(self, *, clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 on_active: Callable[[Block], None] | None = None) -> None:
        self.blocks: list[Block] = []
        self.offerings: list[Offering] = []
        self.purchases: list[dict[str, Any]] = []
        self.dry_runs = 0
        self.calls: dict[str, int] = dict.fromkeys((*ACTIONS, "DescribeInstances"), 0)
        self.clock = clock
        self.on_active = on_active
        self._ids = itertools.count(1)
        self._offered: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ data
    def add_block(self, *, instance_type: str, availability_zone: str, total: int, available: int | None = None,
                  hours: float = 24, tags: Mapping[str, str] | None = None,
                  instances: list[str] | None = None) -> Block:
        now = self.clock()
        block = Block(self._new_id(), instance_type, availability_zone, total,
                      total if available is None else available, now - timedelta(hours=1),
                      now + timedelta(hours=hours), tags=dict(tags or {}), instances=list(instances or []))
        self.blocks.append(block)
        if self.on_active is not None:
            self.on_active(block)
        return block

    def _new_id(self) -> str:
        return f"cr-{0x0b10c000000000 + next(self._ids):017x}"

    # ------------------------------------------------------------------ proxy
    def install(self, proxy: Any) -> None:
        """Answer the three calls on ``proxy`` (a FaultProxy) from now on."""
        proxy.handle(self.respond, match=lambda request, body: self.action(request, body) is not None)

    @staticmethod
    def action(request: web.Request, body: bytes) -> str | None:
        if request.method != "POST" or body[:1] in (b"{", b"<"):
            return None
        params = parse_qs(body.decode("utf-8", "replace"))
        action = params.get("Action", [""])[0]
        if action == "DescribeInstances":  # only the instances of a block; moto has the rest
            names = {k for k, v in params.items() if k.startswith("Filter.") and k.endswith(".Name")
                     and v[0] == "capacity-reservation-id"}
            return action if names else None
        return action if action in ACTIONS else None

    def respond(self, request: web.Request, body: bytes) -> tuple[int, str]:
        params = {k: v[0] for k, v in parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True).items()}
        action = params["Action"]
        self.calls[action] += 1
        try:
            if action == "DescribeCapacityReservations":
                return 200, self._describe_reservations(params)
            if action == "DescribeCapacityBlockOfferings":
                return 200, self._describe_offerings(params)
            if action == "DescribeInstances":
                return 200, self._describe_instances(params)
            return self._purchase(params)
        except ValueError as e:
            return 400, ec2_error("InvalidParameterValue", str(e))

    # ------------------------------------------------------------------ the calls
    def _describe_reservations(self, params: Mapping[str, str]) -> str:
        for block in self.blocks:  # payment processed since the purchase answer
            if block.next_state is not None:
                block.state, block.next_state = block.next_state, None
                if block.state == "active" and self.on_active is not None:
                    self.on_active(block)
        ids = _indexed(params, "CapacityReservationId")
        filters = _filters(params)
        items = [b for b in self.blocks if (not ids or b.reservation_id in ids)
                 and all(b.matches(name, values) for name, values in filters)]
        return _response("DescribeCapacityReservations",
                         "<capacityReservationSet>" + "".join(f"<item>{b.xml()}</item>" for b in items)
                         + "</capacityReservationSet>")

    def _describe_instances(self, params: Mapping[str, str]) -> str:
        filters = dict(_filters(params))
        unknown = set(filters) - {"capacity-reservation-id", "instance-state-name"}
        if unknown:
            raise ValueError(f"filters {sorted(unknown)} are not modelled by tests/support/ec2blocks.py")
        states = filters.get("instance-state-name")
        items = []
        for block in self.blocks:
            if block.reservation_id not in filters["capacity-reservation-id"] or not block.instances:
                continue
            if states is not None and "running" not in states:
                continue
            instances = "".join(
                f"<item><instanceId>{i}</instanceId><instanceType>{block.instance_type}</instanceType>"
                f"<instanceState><code>16</code><name>running</name></instanceState>"
                f"<placement><availabilityZone>{block.availability_zone}</availabilityZone><tenancy>default"
                f"</tenancy></placement><capacityReservationId>{block.reservation_id}</capacityReservationId>"
                f"</item>" for i in block.instances)
            items.append(f"<item><reservationId>r-{block.reservation_id[3:]}</reservationId><ownerId>{ACCOUNT}"
                         f"</ownerId><groupSet/><instancesSet>{instances}</instancesSet></item>")
        return _response("DescribeInstances", "<reservationSet>" + "".join(items) + "</reservationSet>")

    def _describe_offerings(self, params: Mapping[str, str]) -> str:
        instance_type = params.get("InstanceType")
        count = int(params.get("InstanceCount", "1"))
        hours = int(params["CapacityDurationHours"])
        after = _time(params["StartDateRange"]) if "StartDateRange" in params else self.clock()
        items = []
        for o in self.offerings:
            if instance_type and o.instance_type != instance_type:
                continue
            start = max(after, self.clock()) + o.delay
            offered = {"id": o.offering_id, "instance_type": o.instance_type, "az": o.availability_zone,
                       "count": count, "start": start, "end": start + timedelta(hours=hours), "hours": hours,
                       "fee": o.upfront_fee}
            if "EndDateRange" in params and offered["end"] > _time(params["EndDateRange"]):
                continue
            self._offered[o.offering_id] = offered
            items.append(
                f"<item><capacityBlockOfferingId>{o.offering_id}</capacityBlockOfferingId>"
                f"<instanceType>{o.instance_type}</instanceType><availabilityZone>{o.availability_zone}"
                f"</availabilityZone><instanceCount>{count}</instanceCount><startDate>{utc(start)}</startDate>"
                f"<endDate>{utc(offered['end'])}</endDate><capacityBlockDurationHours>{hours}"
                f"</capacityBlockDurationHours><upfrontFee>{o.upfront_fee}</upfrontFee>"
                f"<currencyCode>USD</currencyCode><tenancy>default</tenancy></item>")
        return _response("DescribeCapacityBlockOfferings",
                         "<capacityBlockOfferingSet>" + "".join(items) + "</capacityBlockOfferingSet>")

    def _purchase(self, params: Mapping[str, str]) -> tuple[int, str]:
        offering_id = params.get("CapacityBlockOfferingId", "")
        if not params.get("InstancePlatform"):
            raise ValueError("InstancePlatform is required")
        offered = self._offered.get(offering_id)
        if offered is None:
            raise ValueError(f"the Capacity Block offering {offering_id!r} does not exist")
        if params.get("DryRun", "false").lower() == "true":
            self.dry_runs += 1
            return 412, ec2_error("DryRunOperation", "Request would have succeeded, but DryRun flag is set.")
        tags: dict[str, str] = {}
        for n in itertools.count(1):
            kind = params.get(f"TagSpecification.{n}.ResourceType")
            if kind is None:
                break
            if kind != "capacity-reservation":
                raise ValueError(f"TagSpecification.{n}.ResourceType {kind!r}: a Capacity Block is a "
                                 "capacity-reservation")
            tags.update({params[f"TagSpecification.{n}.Tag.{k}.Key"]: params.get(f"TagSpecification.{n}.Tag.{k}.Value", "")
                         for k in itertools.takewhile(lambda k: f"TagSpecification.{n}.Tag.{k}.Key" in params,
                                                      itertools.count(1))})
        block = Block(self._new_id(), offered["instance_type"], offered["az"], offered["count"], offered["count"],
                      offered["start"], offered["end"], state="payment-pending", tags=tags, next_state="active")
        self.blocks.append(block)
        self.purchases.append({"offering_id": offering_id, "reservation_id": block.reservation_id,
                               "platform": params["InstancePlatform"], "tags": tags,
                               "at": self.clock().isoformat()})
        return 200, _response("PurchaseCapacityBlock", f"<capacityReservation>{block.xml()}</capacityReservation>")


def _response(action: str, inner: str) -> str:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<{action}Response xmlns="{XMLNS}">'
            f"<requestId>{uuid.uuid4()}</requestId>{inner}</{action}Response>")


def _indexed(params: Mapping[str, str], prefix: str) -> list[str]:
    return [params[f"{prefix}.{n}"] for n in itertools.takewhile(lambda n: f"{prefix}.{n}" in params,
                                                                  itertools.count(1))]


def _filters(params: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    out = []
    for n in itertools.takewhile(lambda n: f"Filter.{n}.Name" in params, itertools.count(1)):
        out.append((params[f"Filter.{n}.Name"], _indexed(params, f"Filter.{n}.Value")))
    return out


def _time(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
