"""Every file of the shared event corpus (packaged as resilienced/samples) gets a verdict and a reason."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

import resilienced
from resilienced.intake import pipeline as intake
from resilienced.local import demo
from resilienced.model import Kind
from resilienced.settings import IntakeSettings

pytestmark = pytest.mark.unit

SHARED = Path(__file__).resolve().parents[3] / "shared" / "events"

#: sample -> (kind, actionable, what the reason must say when not actionable)
EXPECTED = {
    "aws-docs/capacity-block-reservation-delivered.json": (Kind.INVALID, False, "detail-type: missing"),
    "aws-docs/capacity-block-reservation-expiration-warning.json": (Kind.INVALID, False, "detail-type: missing"),
    "aws-docs/ec2-capacity-reservation-instance-interruption-warning.json": (Kind.INVALID, False, "account:"),
    "aws-docs/ec2-capacity-reservation-state-change-scheduled.json": (Kind.INVALID, False, "time:"),
    "aws-docs/ec2-instance-rebalance-recommendation.json": (Kind.INVALID, False, "time:"),
    "aws-docs/ec2-spot-instance-interruption-warning.json": (Kind.INVALID, False, "time:"),
    "karpenter/karpenter-capacity-reservation-interruption.json": (Kind.CAPACITY_RESERVATION_INTERRUPTION, True, None),
    "karpenter/karpenter-design-doc-spot-interruption.json": (Kind.INVALID, False, "detail.instance-id:"),
    "karpenter/karpenter-rebalance-recommendation.json": (Kind.REBALANCE_RECOMMENDATION, True, None),
    "karpenter/karpenter-scheduled-change.json": (Kind.INVALID, False, "detail.startTime: empty"),
    "karpenter/karpenter-spot-interruption.json": (Kind.SPOT_INTERRUPTION, True, None),
    "karpenter/karpenter-state-change-creating-ignored.json": (Kind.STATE_CHANGE, False, "state 'creating'"),
    "karpenter/karpenter-state-change-stopping.json": (Kind.STATE_CHANGE, True, None),
    "karpenter/karpenter-unparseable-message.json": (Kind.INVALID, False, "source: missing"),
    "nth/nth-asg-launch-lifecycle-eventbridge.json": (Kind.ASG_LIFECYCLE, False, "EC2_INSTANCE_LAUNCHING"),
    "nth/nth-asg-terminate-lifecycle-direct-sqs.json": (Kind.ASG_LIFECYCLE, True, None),
    "nth/nth-asg-terminate-lifecycle-eventbridge.json": (Kind.ASG_LIFECYCLE, True, None),
    "nth/nth-asg-test-notification-eventbridge.json": (Kind.ASG_LIFECYCLE, False, "test notification"),
    "nth/nth-aws-health-scheduled-change.json": (Kind.INVALID, False, "account: 'account id'"),
    "nth/nth-ec2-state-change-pending.json": (Kind.STATE_CHANGE, False, "state 'pending'"),
    "nth/nth-ec2-state-change-stopping.json": (Kind.STATE_CHANGE, True, None),
    "nth/nth-rebalance-recommendation.json": (Kind.REBALANCE_RECOMMENDATION, True, None),
    "nth/nth-spot-itn.json": (Kind.SPOT_INTERRUPTION, True, None),
}
SAMPLES = dict(demo.samples())


def test_every_packaged_sample_has_an_expectation():
    assert sorted(SAMPLES) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=sorted(EXPECTED))
def test_each_sample_is_read_as_expected(name):
    kind, actionable, reason = EXPECTED[name]
    plan = intake.read(SAMPLES[name], IntakeSettings()).plan
    assert plan.event.kind is kind, plan.reason
    assert plan.actionable is actionable
    if not actionable:
        assert reason in plan.reason


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/events is not next to this checkout")
def test_packaged_samples_are_a_copy_of_the_shared_corpus():
    package = Path(resilienced.__file__).parent / "samples"
    shared = sorted(str(f.relative_to(SHARED)) for f in SHARED.rglob("*") if f.is_file())
    assert shared == sorted(str(f.relative_to(package)) for f in package.rglob("*") if f.is_file())
    _, mismatch, errors = filecmp.cmpfiles(SHARED, package, shared, shallow=False)
    assert mismatch == [] and errors == []
