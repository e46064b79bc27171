"""AWS Health scheduled change: EC2 maintenance or retirement planned for a window.

A real payload (aws/aws-node-termination-handler fixture, with the account made valid)::

    {
      "version": "0",
      "id": "7fb65329-1628-4cf3-a740-95fg457h1402",
      "detail-type": "AWS Health Event",
      "source": "aws.health",
      "account": "123456789012",
      "time": "2016-06-05T06:27:57Z",
      "region": "us-east-1",
      "resources": ["i-12345678"],
      "detail": {
        "eventArn": "arn:aws:health:region::event/id",
        "service": "EC2",
        "eventTypeCode": "AWS_EC2_DEDICATED_HOST_NETWORK_MAINTENANCE_SCHEDULED",
        "eventTypeCategory": "scheduledChange",
        "startTime": "Sat, 05 Jun 2016 15:10:09 GMT",
        "affectedEntities": [{"entityValue": "i-12345678", "tags": {"stage": "prod"}}]
      }
    }

Only ``service == "EC2"`` with ``eventTypeCategory == "scheduledChange"`` is acted on (as NTH
and Karpenter do); other Health events are valid but not actionable.  Instances come from
``detail.affectedEntities[].entityValue``; entities that are not instances (a Dedicated Host
``h-...``) are kept in ``ScheduledChange.other_entities``, while a malformed ``i-`` value is
invalid.  Deadline: ``startTime`` (RFC 1123, as Health writes it, or ISO-8601).
Plan: signal, durable, requeue, ahead of the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from resilienced.intake import validate
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.health"
DETAIL_TYPES = ("AWS Health Event",)
KIND = Kind.SCHEDULED_CHANGE
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)
MAX_ENTITIES = 1000


@dataclass(frozen=True)
class ScheduledChange(EventDetail):
    """The Health event's service, category, code and ARN; for an EC2 scheduled change, also its
    window (``startTime``, ``endTime``) and the affected entities that are not instances."""

    service: str | None
    event_type_category: str | None
    event_type_code: str | None
    event_arn: str | None
    start_time: datetime | None = None  # set for an EC2 scheduledChange only
    end_time: datetime | None = None
    other_entities: tuple[str, ...] = ()

    @property
    def acted_on(self) -> bool:
        """Only EC2 ``scheduledChange`` events are acted on (as NTH and Karpenter do)."""
        return self.service == "EC2" and self.event_type_category == "scheduledChange"

    def as_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {
            "service": self.service, "event_type_category": self.event_type_category,
            "event_type_code": self.event_type_code, "event_arn": self.event_arn}
        if self.start_time is not None:
            out.update(start_time=validate.isoformat(self.start_time),
                       end_time=validate.isoformat(self.end_time), other_entities=list(self.other_entities))
        return out


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    service = validate.text(detail.get("service"), field="detail.service", required=False)
    category = validate.text(detail.get("eventTypeCategory"), field="detail.eventTypeCategory",
                             required=False)
    model = ScheduledChange(service=service, event_type_category=category,
                            event_type_code=_optional_text(detail, "eventTypeCode"),
                            event_arn=_optional_text(detail, "eventArn"))
    if not model.acted_on:
        return replace(base, kind=KIND, detail=model)
    entities = detail.get("affectedEntities")
    if not isinstance(entities, list):
        raise validate.invalid("detail.affectedEntities",
                               f"expected a list, got {validate.show(entities)}")
    if len(entities) > MAX_ENTITIES:
        raise validate.invalid("detail.affectedEntities", f"more than {MAX_ENTITIES} entities")
    instances: list[str] = []
    others: list[str] = []
    for index, entity in enumerate(entities):
        where = f"detail.affectedEntities[{index}].entityValue"
        value = validate.text(validate.mapping(entity, field=f"detail.affectedEntities[{index}]")
                              .get("entityValue"), field=where)
        if value.startswith("i-"):
            if validate.instance_id(value, field=where) not in instances:
                instances.append(value)
        else:
            others.append(value)
    start = validate.health_time(detail.get("startTime"), field="detail.startTime")
    end = detail.get("endTime")
    model = replace(model, start_time=start, other_entities=tuple(others),
                    end_time=validate.health_time(end, field="detail.endTime") if end not in (None, "") else None)
    return replace(base, kind=KIND, instance_ids=tuple(instances), deadline=start, detail=model)


def _optional_text(detail: Mapping[str, JsonValue], name: str) -> str | None:
    value = detail.get(name)
    return value if isinstance(value, str) and len(value) <= validate.MAX_TEXT else None


def plan(event: Event, settings: IntakeSettings) -> Plan:
    model = event.detail if isinstance(event.detail, ScheduledChange) else None
    service, category = (model.service, model.event_type_category) if model else (None, None)
    if model is None or not model.acted_on:
        return Plan(event=event, actionable=False, reason=(
            f"Health event for service {service!r}, category {category!r}: only EC2 "
            "scheduledChange events are acted on"))
    if not event.instance_ids:
        return Plan(event=event, actionable=False,
                    reason="no EC2 instance in detail.affectedEntities")
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids,
                deadline=event.deadline)
