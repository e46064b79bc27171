"""EC2 instance state change: the instance is stopping or gone (no notice left).

A real payload (aws/aws-node-termination-handler fixture)::

    {
      "version": "0",
      "id": "7bf73129-1428-4cd3-a780-95db273d1602",
      "detail-type": "EC2 Instance State-change Notification",
      "source": "aws.ec2",
      "account": "123456789012",
      "time": "2015-11-11T21:29:54Z",
      "region": "us-east-1",
      "resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-abcd1111"],
      "detail": {"instance-id": "i-abcd1111", "state": "stopping"}
    }

``stopping``, ``stopped``, ``shutting-down`` and ``terminated`` mean the instance is going or
gone: the run is requeued from its newest checkpoint (the steps since are lost; the responder
counts them).  There is no deadline: it has passed.  ``pending``, ``running`` and anything else
are not interruptions: valid, not actionable.  Plan: requeue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from resilienced.intake import validate
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.ec2"
DETAIL_TYPES = ("EC2 Instance State-change Notification",)
KIND = Kind.STATE_CHANGE
GOING = ("stopping", "stopped", "shutting-down", "terminated")
STEPS = (Step.REQUEUE,)


@dataclass(frozen=True)
class StateChange(EventDetail):
    """``detail.state``: the instance's new state (acted on when it is one of :data:`GOING`)."""

    state: str

    def as_json(self) -> dict[str, JsonValue]:
        return {"state": self.state}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    instance = validate.instance_id(detail.get("instance-id"), field="detail.instance-id")
    state = validate.text(detail.get("state"), field="detail.state")
    return replace(base, kind=KIND, instance_ids=(instance,), detail=StateChange(state=state))


def plan(event: Event, settings: IntakeSettings) -> Plan:
    state = event.detail.state if isinstance(event.detail, StateChange) else None
    if state not in GOING:
        return Plan(event=event, actionable=False, instance_ids=event.instance_ids, reason=(
            f"state {state!r} is not an interruption (acted on: {', '.join(GOING)})"))
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids)
