"""Each kind: what it parses to, its deadline, and its plan (pure functions, no queue)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from handlers import registry
from handlers.asg_lifecycle import LifecycleAction
from resilienced.intake import pipeline as intake
from resilienced.model import Kind, Step, Wrapping
from resilienced.settings import IntakeSettings

from . import payloads as p

pytestmark = pytest.mark.unit

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
INTERRUPTION = [Step.SIGNAL, Step.DURABLE, Step.REQUEUE]


def read(event, settings: IntakeSettings | None = None):
    return intake.read(p.body(event), settings or IntakeSettings())


KINDS = [
    # (id, payload, kind, instance ids, reservation, deadline, steps)
    ("spot", p.spot(), Kind.SPOT_INTERRUPTION, [p.INSTANCE], None, T0 + timedelta(seconds=120),
     INTERRUPTION),
    ("spot-8-hex-id", p.spot("i-abcd1111"), Kind.SPOT_INTERRUPTION, ["i-abcd1111"], None,
     T0 + timedelta(seconds=120), INTERRUPTION),
    ("spot-stop", p.spot(detail={"instance-action": "stop"}), Kind.SPOT_INTERRUPTION, [p.INSTANCE],
     None, T0 + timedelta(seconds=120), INTERRUPTION),
    ("reservation-interruption-no-termination-time", p.reservation_interruption(),
     Kind.CAPACITY_RESERVATION_INTERRUPTION, [p.INSTANCE], None, T0 + timedelta(seconds=120),
     INTERRUPTION),
    ("reservation-interruption-termination-time",
     p.reservation_interruption(detail={"instance-termination-time": "2024-01-01T00:05:00Z",
                                        "azId": "use1-az1"}),
     Kind.CAPACITY_RESERVATION_INTERRUPTION, [p.INSTANCE], None, T0 + timedelta(minutes=5),
     INTERRUPTION),
    ("block-expiry", p.block_expiry(), Kind.CAPACITY_BLOCK_EXPIRY, [], p.RESERVATION,
     T0 + timedelta(minutes=30), INTERRUPTION),
    ("block-expiry-other-detail-type", p.block_expiry(detail_type="Capacity Block Expiration Warning"),
     Kind.CAPACITY_BLOCK_EXPIRY, [], p.RESERVATION, T0 + timedelta(minutes=30), INTERRUPTION),
    ("health-rfc1123", p.health(), Kind.SCHEDULED_CHANGE, [p.INSTANCE], None,
     datetime(2016, 6, 5, 15, 10, 9, tzinfo=timezone.utc), INTERRUPTION),
    ("health-iso-two-instances", p.health((p.INSTANCE, p.OTHER_INSTANCE), start="2024-02-01T10:00:00Z"),
     Kind.SCHEDULED_CHANGE, [p.INSTANCE, p.OTHER_INSTANCE], None,
     datetime(2024, 2, 1, 10, tzinfo=timezone.utc), INTERRUPTION),
    ("state-stopping", p.state_change("stopping"), Kind.STATE_CHANGE, [p.INSTANCE], None, None,
     [Step.REQUEUE]),
    ("state-terminated", p.state_change("terminated"), Kind.STATE_CHANGE, [p.INSTANCE], None, None,
     [Step.REQUEUE]),
    ("rebalance-notify", p.rebalance(), Kind.REBALANCE_RECOMMENDATION, [p.INSTANCE], None, None,
     [Step.NOTIFY]),
    ("asg-eventbridge", p.asg(), Kind.ASG_LIFECYCLE, [p.INSTANCE], None, T0 + timedelta(seconds=120),
     INTERRUPTION + [Step.COMPLETE_LIFECYCLE]),
    ("asg-direct", p.asg_direct(), Kind.ASG_LIFECYCLE, [p.INSTANCE], None,
     datetime(2022, 1, 31, 23, 9, 47, 872000, tzinfo=timezone.utc),
     INTERRUPTION + [Step.COMPLETE_LIFECYCLE]),
    ("sns-wrapped-spot", p.sns(p.spot()), Kind.SPOT_INTERRUPTION, [p.INSTANCE], None,
     T0 + timedelta(seconds=120), INTERRUPTION),
    ("sns-wrapped-asg-direct", p.sns(p.asg_direct()), Kind.ASG_LIFECYCLE, [p.INSTANCE], None,
     datetime(2022, 1, 31, 23, 9, 47, 872000, tzinfo=timezone.utc),
     INTERRUPTION + [Step.COMPLETE_LIFECYCLE]),
]


@pytest.mark.parametrize("payload, kind, instances, reservation, deadline, steps",
                         [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_actionable_kinds_plan_their_steps_and_deadline(payload, kind, instances, reservation,
                                                        deadline, steps):
    reading = read(payload)
    plan = reading.plan
    assert reading.decoded
    assert plan.event.kind is kind, plan.event.reason
    assert plan.actionable, plan.reason
    assert list(plan.instance_ids) == instances
    assert plan.capacity_reservation_id == reservation
    assert plan.deadline == deadline
    assert list(plan.steps) == steps
    if deadline is not None:
        assert plan.deadline.tzinfo is not None


NOT_ACTIONABLE = [
    ("state-pending", p.state_change("pending"), Kind.STATE_CHANGE, "state 'pending'"),
    ("state-running", p.state_change("running"), Kind.STATE_CHANGE, "state 'running'"),
    ("health-other-service", p.health(service="RDS"), Kind.SCHEDULED_CHANGE, "service 'RDS'"),
    ("health-other-category", p.health(category="issue"), Kind.SCHEDULED_CHANGE, "category 'issue'"),
    ("health-only-a-host", p.health(("h-0123456789abcdef0",)), Kind.SCHEDULED_CHANGE,
     "no EC2 instance"),
    ("asg-launch", p.asg(transition="autoscaling:EC2_INSTANCE_LAUNCHING"), Kind.ASG_LIFECYCLE,
     "EC2_INSTANCE_LAUNCHING"),
    ("asg-test-notification-eventbridge",
     p.envelope("EC2 Instance-terminate Lifecycle Action",
                {"Event": "autoscaling:TEST_NOTIFICATION",
                 "LifecycleTransition": "autoscaling:TEST_NOTIFICATION"}, source="aws.autoscaling"),
     Kind.ASG_LIFECYCLE, "test notification"),
    ("asg-test-notification-direct",
     {"AccountId": p.ACCOUNT, "RequestId": "2a6a4d3c-1111-2222-3333-444455556666",
      "AutoScalingGroupARN": "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:x",
      "AutoScalingGroupName": "gpu-workers", "Service": "AWS Auto Scaling",
      "Event": "autoscaling:TEST_NOTIFICATION", "Time": "2024-01-01T00:00:00.000Z"},
     Kind.ASG_LIFECYCLE, "test notification"),
    ("odcr-state-event", p.envelope("EC2 Capacity Reservation Scheduled",
                                    {"capacity-reservation-id": p.RESERVATION, "state": "scheduled"}),
     Kind.UNKNOWN, "no handler for source 'aws.ec2' and detail-type 'EC2 Capacity Reservation Scheduled'"),
    ("block-delivered", p.envelope("Capacity Block Reservation Delivered",
                                   {"capacity-reservation-id": p.RESERVATION, "end-date": p.TIME}),
     Kind.UNKNOWN, "no handler"),
    ("other-aws-service", p.envelope("Object Created", {"bucket": {}}, source="aws.s3"), Kind.UNKNOWN,
     "no handler for source 'aws.s3'"),
]


@pytest.mark.parametrize("payload, kind, reason", [k[1:] for k in NOT_ACTIONABLE],
                         ids=[k[0] for k in NOT_ACTIONABLE])
def test_valid_events_that_ask_for_nothing_are_not_actionable_with_a_reason(payload, kind, reason):
    plan = read(payload).plan
    assert plan.event.kind is kind
    assert not plan.actionable
    assert plan.steps == ()
    assert reason in plan.reason


@pytest.mark.parametrize("policy, steps, has_deadline", [
    ("notify", [Step.NOTIFY], False),
    ("checkpoint-ahead", [Step.SIGNAL, Step.DURABLE], False),
    ("drain", INTERRUPTION, True),
], ids=["notify", "checkpoint-ahead", "drain"])
def test_rebalance_plan_follows_the_policy(policy, steps, has_deadline):
    plan = read(p.rebalance(), IntakeSettings(rebalance_policy=policy)).plan
    assert plan.actionable
    assert list(plan.steps) == steps
    assert plan.deadline == (T0 + timedelta(seconds=120) if has_deadline else None)


def test_asg_deadline_follows_the_setting_and_keeps_the_hook_fields():
    plan = read(p.asg(), IntakeSettings(asg_deadline_seconds=900)).plan
    assert plan.deadline == T0 + timedelta(seconds=900)
    action = plan.event.detail
    assert isinstance(action, LifecycleAction)
    assert action.lifecycle_action_token == "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6"
    assert action.auto_scaling_group_name == "gpu-workers"
    assert action.lifecycle_hook_name == "resilienced"
    assert plan.event.detail_json() == {  # what the plan line's attributes show
        "lifecycle_transition": "autoscaling:EC2_INSTANCE_TERMINATING",
        "lifecycle_action_token": "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6",
        "auto_scaling_group_name": "gpu-workers", "lifecycle_hook_name": "resilienced",
        "deadline_from": "time+900s (--asg-deadline-seconds)"}


@pytest.mark.parametrize("payload, wrapping", [
    (p.spot(), Wrapping.EVENTBRIDGE),
    (p.sns(p.spot()), Wrapping.SNS),
    (p.asg_direct(), Wrapping.ASG_DIRECT),
], ids=["eventbridge", "sns", "asg-direct"])
def test_the_wrapping_is_recorded(payload, wrapping):
    assert read(payload).event.wrapping is wrapping


def test_direct_asg_event_id_is_the_request_id():
    payload = p.asg_direct(RequestId="3775fac9-93c3-7ead-8713-159816566000")
    assert read(payload).event.event_id == "3775fac9-93c3-7ead-8713-159816566000"


def test_every_kind_but_unknown_and_invalid_has_exactly_one_documented_handler_module():
    kinds = {module.KIND for module in registry.MODULES}
    assert kinds == set(Kind) - {Kind.UNKNOWN, Kind.INVALID}
    assert len(kinds) == len(registry.MODULES)
    for (source, detail_type), module in registry.REGISTRY.items():
        assert source == module.SOURCE and detail_type in module.DETAIL_TYPES
        assert f'"source": "{module.SOURCE}"' in module.__doc__  # opens with a real payload
