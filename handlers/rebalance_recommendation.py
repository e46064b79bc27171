"""EC2 instance rebalance recommendation: a Spot Instance is at elevated risk.

A real payload (aws/aws-node-termination-handler fixture)::

    {
      "version": "0",
      "id": "5d5555d5-dd55-5555-5555-5555dd55d55d",
      "detail-type": "EC2 Instance Rebalance Recommendation",
      "source": "aws.ec2",
      "account": "123456789012",
      "time": "2020-10-26T14:14:14Z",
      "region": "us-east-1",
      "resources": ["arn:aws:ec2:us-east-1b:instance/i-0b662ef9931388ba0"],
      "detail": {"instance-id": "i-0b662ef9931388ba0"}
    }

AWS documents no lead time: it may come well before the interruption notice, with it, or for
an instance that is never interrupted.  What it asks for is a policy
(``--rebalance-policy``):

- ``notify`` (default): record it (plan: notify); nothing is drained or saved.
- ``checkpoint-ahead``: get a durable checkpoint now and keep running (plan: signal, durable;
  no deadline, meaning "save, do not stop": the responder must not remove the node).
- ``drain``: treat it as an interruption notice (plan: signal, durable, requeue) with the
  Spot deadline, ``time`` + 120 s, since AWS says it can arrive together with the notice.
"""

from __future__ import annotations

from dataclasses import replace

from resilienced.intake import validate
from resilienced.model import Envelope, Event, Kind, Plan, Step
from resilienced.settings import IntakeSettings, RebalancePolicy

SOURCE = "aws.ec2"
DETAIL_TYPES = ("EC2 Instance Rebalance Recommendation",)
KIND = Kind.REBALANCE_RECOMMENDATION
#: Under the drain policy: the worst case, a rebalance that arrives with the two-minute notice.
STEPS = {
    RebalancePolicy.NOTIFY: (Step.NOTIFY,),
    RebalancePolicy.CHECKPOINT_AHEAD: (Step.SIGNAL, Step.DURABLE),
    RebalancePolicy.DRAIN: (Step.SIGNAL, Step.DURABLE, Step.REQUEUE),
}


def parse(envelope: Envelope, base: Event, settings: IntakeSettings) -> Event:
    instance = validate.instance_id(envelope.detail.get("instance-id"), field="detail.instance-id")
    return replace(base, kind=KIND, instance_ids=(instance,))


def plan(event: Event, settings: IntakeSettings) -> Plan:
    policy = settings.rebalance_policy
    deadline = None
    if policy is RebalancePolicy.DRAIN and event.time is not None:
        try:
            deadline = event.time + settings.notice
        except OverflowError:  # an event stamped at the very end of year 9999
            deadline = event.time
    return Plan(event=event, actionable=True, steps=STEPS[policy], instance_ids=event.instance_ids,
                deadline=deadline)
