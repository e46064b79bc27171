"""ASG lifecycle action: an Auto Scaling group holds an instance in Terminating:Wait.

A real payload (aws/aws-node-termination-handler fixture), through EventBridge::

    {
      "version": "0",
      "id": "782d5b4c-0f6f-1fd6-9d62-ecf6aed0a470",
      "detail-type": "EC2 Instance-terminate Lifecycle Action",
      "source": "aws.autoscaling",
      "account": "123456789012",
      "time": "2020-07-01T22:19:58Z",
      "region": "us-east-1",
      "resources": ["arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:..."],
      "detail": {
        "LifecycleActionToken": "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6",
        "AutoScalingGroupName": "testt1.demo-0a20f32c.kops.sh",
        "LifecycleHookName": "cluster-termination-handler",
        "EC2InstanceId": "i-0633ac2b0d9769723",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING"
      }
    }

The hook may also notify SQS directly: then the body is the detail alone (with ``RequestId``,
``Time`` and ``AccountId``); ``resilienced.intake.pipeline`` turns it into an envelope with this
detail-type.  ``autoscaling:TEST_NOTIFICATION`` and launch transitions are valid, not
actionable.  Deadline: ``time`` + ``--asg-deadline-seconds`` (the hook's heartbeat timeout is
not in the event).  The hook fields are kept in :class:`LifecycleAction` (``lifecycle_action_token``,
``auto_scaling_group_name``, ``lifecycle_hook_name``) for CompleteLifecycleAction
(``resilienced.aws.autoscaling``).
Plan: signal, durable, requeue, complete the lifecycle action.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import timedelta

from resilienced.intake import validate
from resilienced.model import Envelope, Event, EventDetail, JsonValue, Kind, Plan, Step
from resilienced.settings import IntakeSettings

SOURCE = "aws.autoscaling"
DETAIL_TYPES = ("EC2 Instance-terminate Lifecycle Action", "EC2 Instance-launch Lifecycle Action")
KIND = Kind.ASG_LIFECYCLE
TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
STEPS = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE, Step.COMPLETE_LIFECYCLE)


@dataclass(frozen=True)
class LifecycleAction(EventDetail):
    """The lifecycle transition; for a terminate action, the hook's fields that
    CompleteLifecycleAction needs, and where the deadline came from."""

    lifecycle_transition: str
    lifecycle_action_token: str | None = None
    auto_scaling_group_name: str | None = None
    lifecycle_hook_name: str | None = None
    deadline_from: str | None = None

    def as_json(self) -> dict[str, JsonValue]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    detail = envelope.detail
    prefix = "" if envelope.detail is envelope.raw else "detail."
    transition = validate.text(detail.get("LifecycleTransition", detail.get("Event")),
                               field=prefix + "LifecycleTransition")
    if transition != TERMINATING:
        instance = detail.get("EC2InstanceId")
        ids = () if instance is None else (
            validate.instance_id(instance, field=prefix + "EC2InstanceId"),)
        return replace(base, kind=KIND, instance_ids=ids,
                       detail=LifecycleAction(lifecycle_transition=transition))
    instance = validate.instance_id(detail.get("EC2InstanceId"), field=prefix + "EC2InstanceId")
    action = LifecycleAction(
        lifecycle_transition=transition,
        lifecycle_action_token=validate.text(detail.get("LifecycleActionToken"), field=prefix + "LifecycleActionToken"),
        auto_scaling_group_name=validate.text(detail.get("AutoScalingGroupName"), field=prefix + "AutoScalingGroupName"),
        lifecycle_hook_name=validate.text(detail.get("LifecycleHookName"), field=prefix + "LifecycleHookName"),
        deadline_from=f"time+{settings.asg_deadline_seconds:g}s (--asg-deadline-seconds)")
    deadline = validate.shift(base.time, timedelta(seconds=settings.asg_deadline_seconds),
                              field="Time" if not prefix else "time")
    return replace(base, kind=KIND, instance_ids=(instance,), deadline=deadline, detail=action)


def plan(event: Event, settings: IntakeSettings) -> Plan:
    transition = event.detail.lifecycle_transition if isinstance(event.detail, LifecycleAction) else None
    if transition != TERMINATING:
        what = "test notification" if transition == "autoscaling:TEST_NOTIFICATION" else \
            f"transition {transition!r}, not {TERMINATING}"
        return Plan(event=event, actionable=False, instance_ids=event.instance_ids,
                    reason=f"ASG lifecycle {what}: nothing to act on")
    return Plan(event=event, actionable=True, steps=STEPS, instance_ids=event.instance_ids,
                deadline=event.deadline)
