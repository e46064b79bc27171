"""Event payloads built as dicts, one builder per kind (raw strings only for malformed input).

Every builder returns a valid event of its kind; keyword arguments override envelope fields
(``time=...``) and ``detail`` fields are given as ``detail={...}`` (merged).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

INSTANCE = "i-0123456789abcdef0"
OTHER_INSTANCE = "i-0fedcba9876543210"
RESERVATION = "cr-0123456789abcdef0"
ACCOUNT = "123456789012"
TIME = "2024-01-01T00:00:00Z"


def envelope(detail_type: str, detail: dict[str, Any], *, source: str = "aws.ec2",
             **fields: Any) -> dict[str, Any]:
    event = {
        "version": "0", "id": str(uuid.uuid4()), "detail-type": detail_type, "source": source,
        "account": ACCOUNT, "time": TIME, "region": "us-east-1", "resources": [], "detail": detail,
    }
    event.update(fields)
    return {k: v for k, v in event.items() if v is not _DROP}


_DROP = object()
DROP = _DROP  # pass DROP as a field value to leave the field out


def _merge(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    merged = dict(base)
    for key, value in (extra or {}).items():
        if value is DROP:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def spot(instance: str = INSTANCE, *, detail: dict | None = None, **fields: Any) -> dict:
    return envelope("EC2 Spot Instance Interruption Warning",
                    _merge({"instance-id": instance, "instance-action": "terminate"}, detail), **fields)


def reservation_interruption(instance: str = INSTANCE, *, detail: dict | None = None, **fields: Any) -> dict:
    return envelope("EC2 Capacity Reservation Instance Interruption Warning",
                    _merge({"instance-id": instance, "instance-action": "terminate"}, detail), **fields)


def block_expiry(reservation: str = RESERVATION, *, end: str = "2024-01-01T01:00:00Z",
                 detail_type: str = "Capacity Block Reservation Expiration Warning",
                 detail: dict | None = None, **fields: Any) -> dict:
    return envelope(detail_type, _merge({"capacity-reservation-id": reservation, "end-date": end}, detail),
                    **fields)


def health(instances: tuple[str, ...] = (INSTANCE,), *, start: str = "Sat, 05 Jun 2016 15:10:09 GMT",
           service: str = "EC2", category: str = "scheduledChange", detail: dict | None = None,
           **fields: Any) -> dict:
    return envelope("AWS Health Event", _merge({
        "eventArn": "arn:aws:health:us-east-1::event/EC2/x", "service": service,
        "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED", "eventTypeCategory": category,
        "startTime": start, "affectedEntities": [{"entityValue": i} for i in instances],
    }, detail), source="aws.health", **fields)


def state_change(state: str = "stopping", instance: str = INSTANCE, *, detail: dict | None = None,
                 **fields: Any) -> dict:
    return envelope("EC2 Instance State-change Notification",
                    _merge({"instance-id": instance, "state": state}, detail), **fields)


def rebalance(instance: str = INSTANCE, *, detail: dict | None = None, **fields: Any) -> dict:
    return envelope("EC2 Instance Rebalance Recommendation", _merge({"instance-id": instance}, detail),
                    **fields)


def asg_detail(instance: str = INSTANCE, transition: str = "autoscaling:EC2_INSTANCE_TERMINATING",
               **extra: Any) -> dict:
    return _merge({"LifecycleActionToken": "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6",
                   "AutoScalingGroupName": "gpu-workers", "LifecycleHookName": "resilienced",
                   "EC2InstanceId": instance, "LifecycleTransition": transition}, extra)


def asg(instance: str = INSTANCE, *, transition: str = "autoscaling:EC2_INSTANCE_TERMINATING",
        detail: dict | None = None, **fields: Any) -> dict:
    detail_type = ("EC2 Instance-launch Lifecycle Action" if transition.endswith("LAUNCHING")
                   else "EC2 Instance-terminate Lifecycle Action")
    return envelope(detail_type, _merge(asg_detail(instance, transition), detail),
                    source="aws.autoscaling", **fields)


def asg_direct(instance: str = INSTANCE, *, transition: str = "autoscaling:EC2_INSTANCE_TERMINATING",
               **extra: Any) -> dict:
    return _merge({**asg_detail(instance, transition), "Origin": "EC2", "Destination": "AutoScalingGroup",
                   "AccountId": ACCOUNT, "RequestId": str(uuid.uuid4()), "Service": "AWS Auto Scaling",
                   "Time": "2022-01-31T23:07:47.872Z", "Event": ""}, extra)


def sns(event: dict[str, Any]) -> dict[str, Any]:
    """The SQS body when EventBridge -> SNS -> SQS (raw delivery off)."""
    return {"Type": "Notification", "MessageId": str(uuid.uuid4()),
            "TopicArn": "arn:aws:sns:us-east-1:123456789012:interruptions",
            "Message": json.dumps(event), "Timestamp": "2024-01-01T00:00:01.000Z",
            "SignatureVersion": "1", "Signature": "x", "SigningCertURL": "https://x",
            "UnsubscribeURL": "https://x"}


def body(event: dict[str, Any]) -> str:
    return json.dumps(event)
