"""Fuzzing decode + parse + plan: whatever the body, no exception escapes and a reason is given."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilienced.intake import pipeline as intake
from resilienced.model import Kind
from resilienced.settings import IntakeSettings

from . import payloads as p
import pytest

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICIES = [IntakeSettings(), IntakeSettings(allowed_accounts=(p.ACCOUNT,), allowed_regions=("us-east-1",)),
            IntakeSettings(rebalance_policy="drain")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
field_values = st.one_of(
    json_values,
    st.sampled_from(["", "aws.ec2", "aws.health", "aws.autoscaling", "custom.x", p.INSTANCE, "i-1",
                     p.RESERVATION, p.TIME, "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z",
                     "Sat, 05 Jun 2016 15:10:09 GMT", "yyyy-mm-ddThh:mm:ssZ", "terminate",
                     "autoscaling:EC2_INSTANCE_TERMINATING", "autoscaling:TEST_NOTIFICATION",
                     "EC2", "scheduledChange", "stopping", p.ACCOUNT, "us-east-1", "\ud800"]),
)
templates = st.sampled_from([p.spot(), p.reservation_interruption(), p.block_expiry(), p.health(),
                             p.state_change(), p.rebalance(), p.asg(), p.asg_direct(),
                             p.asg(transition="autoscaling:TEST_NOTIFICATION")])


def check(body, policy: IntakeSettings) -> None:
    reading = intake.read(body, policy)  # must not raise
    plan = reading.plan
    assert plan.event.kind in set(Kind)
    assert isinstance(plan.actionable, bool)
    if not plan.actionable:
        assert plan.reason
    if plan.deadline is not None:
        assert plan.deadline.tzinfo is not None
    if not reading.decoded:
        assert plan.event.kind is Kind.INVALID


@FUZZ
@given(st.binary(max_size=300), st.sampled_from(POLICIES))
def test_any_bytes(body, policy):
    check(body, policy)


@FUZZ
@given(json_values, st.sampled_from(POLICIES))
def test_any_json(value, policy):
    check(json.dumps(value), policy)


@FUZZ
@given(templates, st.data(), st.sampled_from(POLICIES), st.booleans())
def test_real_shapes_with_fields_replaced(template, data, policy, wrap):
    event = json.loads(json.dumps(template))
    target = event["detail"] if "detail" in event and data.draw(st.booleans()) else event
    for key in data.draw(st.lists(st.sampled_from(sorted(target) + ["extra"]), max_size=4)):
        if data.draw(st.booleans()):
            target[key] = data.draw(field_values)
        else:
            target.pop(key, None)
    check(json.dumps(p.sns(event) if wrap else event), policy)
