"""Capacity Block expiration warning: the reservation ends soon, with every instance in it.

The payload as the EC2 User Guide documents it (its sample writes ``detail_type`` and
``customer_event_id``; a real EventBridge envelope has ``detail-type`` and ``id``)::

    {
      "version": "0",
      "id": "cr-0123456789abcdef0-approaching-expiry",
      "detail-type": "Capacity Block Reservation Expiration Warning",
      "source": "aws.ec2",
      "account": "123456789012",
      "time": "2024-05-01T10:50:00Z",
      "region": "us-east-2",
      "resources": ["arn:aws:ec2:us-east-2:123456789012:capacity-reservation/cr-0123456789abcdef0"],
      "detail": {"capacity-reservation-id": "cr-0123456789abcdef0",
                 "end-date": "2024-05-01T11:30:00Z"}
    }

Sent 40 minutes before the block ends; EC2 starts terminating its instances 30 minutes before
the end.  Deadline: ``end-date`` - 30 min.  Where Karpenter manages a run's nodes (the node's
``karpenter.sh/nodepool`` label) they go earlier: Karpenter deletes the NodeClaims of a block that
is ``expiring``, 40 minutes before its end, polled every minute, and drains the nodes then
(aws/karpenter-provider-aws v1.6+, v1.14.1 ``pkg/controllers/capacityreservation/expiration/
controller.go``, ``capacityReservationExpirationPeriod`` in ``pkg/apis/v1/ec2nodeclass_status.go``):
:func:`run_deadline` gives those runs ``end-date`` - 40 min.  The instances are not in the event: they are found
through the reservation when the plan is carried out, so ``instance_ids`` is empty and the plan
names the reservation.  Plan: signal, durable, requeue, for every instance of the reservation.
(Stored copies of the guide disagree on the detail-type; both spellings are accepted.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from resilienced.intake import validate
from resilienced.capacity.decision import KARPENTER_BLOCK_DRAIN
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, NodeShape, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.ec2"
DETAIL_TYPES = ("Capacity Block Reservation Expiration Warning", "Capacity Block Expiration Warning")
KIND = Kind.CAPACITY_BLOCK_EXPIRY
#: EC2 begins terminating the block's instances this long before its end.
TERMINATION_LEAD = timedelta(minutes=30)
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)


@dataclass(frozen=True)
class BlockExpiry(EventDetail):
    """``detail.end-date``: when the Capacity Block ends (UTC)."""

    end_date: datetime

    def as_json(self) -> dict[str, JsonValue]:
        return {"end_date": validate.isoformat(self.end_date)}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    reservation = validate.reservation_id(detail.get("capacity-reservation-id"),
                                          field="detail.capacity-reservation-id")
    end = validate.iso_time(detail.get("end-date"), field="detail.end-date")
    deadline = validate.shift(end, -TERMINATION_LEAD, field="detail.end-date")
    return replace(base, kind=KIND, capacity_reservation_id=reservation, deadline=deadline,
                   detail=BlockExpiry(end_date=end))


def plan(event: Event, settings: IntakeSettings) -> Plan:
    return Plan(event=event, actionable=True, steps=STEPS,
                capacity_reservation_id=event.capacity_reservation_id, deadline=event.deadline)


def run_deadline(plan: Plan, *, node_shape: str | None) -> datetime | None:
    """When one run's nodes go: the plan's deadline, or for an expiring block on Karpenter's nodes
    ``end-date`` - 40 min (Karpenter drains them then, ten minutes before EC2 would)."""
    event = plan.event
    if not isinstance(event.detail, BlockExpiry) or node_shape != NodeShape.KARPENTER.value:
        return plan.deadline
    return event.detail.end_date - KARPENTER_BLOCK_DRAIN
