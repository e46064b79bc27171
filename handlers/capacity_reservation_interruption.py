"""Interruptible Capacity Reservation: an instance is being taken back.

A real payload (aws/karpenter-provider-aws, interruption controller test fixture)::

    {
      "version": "0",
      "id": "22222222-2222-2222-2222-222222222222",
      "detail-type": "EC2 Capacity Reservation Instance Interruption Warning",
      "source": "aws.ec2",
      "account": "000000000000",
      "time": "2024-01-01T00:00:00Z",
      "region": "us-west-2",
      "resources": ["arn:aws:ec2:us-west-2:instance/i-0123456789abcdef0"],
      "detail": {"instance-id": "i-0123456789abcdef0", "instance-action": "terminate"}
    }

The EC2 User Guide documents two more detail fields, ``instance-termination-time`` and
``azId``, and an interruption "2 minutes before your instances are terminated".
Deadline: ``instance-termination-time`` when present, else ``time`` + 120 s.
Plan: signal, durable, requeue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from resilienced.intake import validate
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.ec2"
DETAIL_TYPES = ("EC2 Capacity Reservation Instance Interruption Warning",)
KIND = Kind.CAPACITY_RESERVATION_INTERRUPTION
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)


@dataclass(frozen=True)
class ReservationInterruption(EventDetail):
    """``detail.instance-action`` and ``detail.azId`` when given, and where the deadline came from
    (``instance-termination-time``, else the event's time plus the notice)."""

    instance_action: str | None
    az_id: str | None
    deadline_from: str

    def as_json(self) -> dict[str, JsonValue]:
        return {"instance_action": self.instance_action, "az_id": self.az_id,
                "deadline_from": self.deadline_from}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    instance = validate.instance_id(detail.get("instance-id"), field="detail.instance-id")
    action = validate.text(detail.get("instance-action"), field="detail.instance-action",
                           required=False)
    az_id = validate.text(detail.get("azId"), field="detail.azId", required=False)
    termination = detail.get("instance-termination-time")
    if termination is not None:
        deadline = validate.iso_time(termination, field="detail.instance-termination-time")
    else:
        deadline = validate.shift(base.time, settings.notice, field="time")
    return replace(base, kind=KIND, instance_ids=(instance,), deadline=deadline, detail=ReservationInterruption(
        instance_action=action, az_id=az_id,
        deadline_from=("instance-termination-time" if termination is not None
                       else f"time+{settings.notice_seconds:g}s")))


def plan(event: Event, settings: IntakeSettings) -> Plan:
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids,
                deadline=event.deadline)
