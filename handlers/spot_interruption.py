"""Spot Instance interruption warning: the two-minute notice.

A real payload (aws/aws-node-termination-handler, ``pkg/monitor/sqsevent`` fixture)::

    {
      "version": "0",
      "id": "1e5527d7-bb36-4607-3370-4164db56a40e",
      "detail-type": "EC2 Spot Instance Interruption Warning",
      "source": "aws.ec2",
      "account": "123456789012",
      "time": "1970-01-01T00:00:00Z",
      "region": "us-east-1",
      "resources": ["arn:aws:ec2:us-east-1b:instance/i-0b662ef9931388ba0"],
      "detail": {"instance-id": "i-0b662ef9931388ba0", "instance-action": "terminate"}
    }

EC2 sends it about two minutes before it stops, hibernates or terminates a Spot Instance
(best effort).  Deadline: the event's ``time`` + 120 s.  Plan: signal, durable, requeue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from resilienced.intake import validate
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.ec2"
DETAIL_TYPES = ("EC2 Spot Instance Interruption Warning",)
KIND = Kind.SPOT_INTERRUPTION
ACTIONS = ("terminate", "stop", "hibernate")
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)


@dataclass(frozen=True)
class SpotInterruption(EventDetail):
    """``detail.instance-action``: what EC2 does at the deadline (terminate, stop, hibernate)."""

    instance_action: str

    def as_json(self) -> dict[str, JsonValue]:
        return {"instance_action": self.instance_action}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    instance = validate.instance_id(detail.get("instance-id"), field="detail.instance-id")
    action = validate.text(detail.get("instance-action"), field="detail.instance-action")
    if action not in ACTIONS:
        raise validate.invalid("detail.instance-action",
                               f"{validate.show(action)} is not one of {', '.join(ACTIONS)}")
    return replace(base, kind=KIND, instance_ids=(instance,),
                   deadline=validate.shift(base.time, settings.notice, field="time"),
                   detail=SpotInterruption(instance_action=action))


def plan(event: Event, settings: IntakeSettings) -> Plan:
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids,
                deadline=event.deadline)
