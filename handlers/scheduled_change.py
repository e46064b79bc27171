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
``h-...``) are kept in ``attributes["other_entities"]``, while a malformed ``i-`` value is
invalid.  Deadline: ``startTime`` (RFC 1123, as Health writes it, or ISO-8601).
Plan: signal, durable, requeue, ahead of the window.
"""

from __future__ import annotations

from dataclasses import replace

from resilienced import validate
from resilienced.model import Envelope, Event, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.health"
DETAIL_TYPES = ("AWS Health Event",)
KIND = Kind.SCHEDULED_CHANGE
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)
MAX_ENTITIES = 1000


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    service = validate.text(detail.get("service"), field="detail.service", required=False)
    category = validate.text(detail.get("eventTypeCategory"), field="detail.eventTypeCategory",
                             required=False)
    attributes = {"service": service, "event_type_category": category,
                  "event_type_code": _optional_text(detail, "eventTypeCode"),
                  "event_arn": _optional_text(detail, "eventArn")}
    if service != "EC2" or category != "scheduledChange":
        return replace(base, kind=KIND, attributes=attributes)
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
    attributes["start_time"] = validate.isoformat(start)
    attributes["end_time"] = (validate.isoformat(validate.health_time(end, field="detail.endTime"))
                              if end not in (None, "") else None)
    attributes["other_entities"] = others
    return replace(base, kind=KIND, instance_ids=tuple(instances), deadline=start,
                   attributes=attributes)


def _optional_text(detail, name: str) -> str | None:
    value = detail.get(name)
    return value if isinstance(value, str) and len(value) <= validate.MAX_TEXT else None


def plan(event: Event, settings: IntakeSettings) -> Plan:
    service = event.attributes.get("service")
    category = event.attributes.get("event_type_category")
    if service != "EC2" or category != "scheduledChange":
        return Plan(event=event, actionable=False, reason=(
            f"Health event for service {service!r}, category {category!r}: only EC2 "
            "scheduledChange events are acted on"))
    if not event.instance_ids:
        return Plan(event=event, actionable=False,
                    reason="no EC2 instance in detail.affectedEntities")
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids,
                deadline=event.deadline)
