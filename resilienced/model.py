"""The typed values that flow through the daemon: events, plans, targets, outcomes.

An SQS body is decoded into an :class:`Envelope`, parsed by the handler registered for its
(source, detail-type) into an :class:`Event`, and the handler turns the event into a :class:`Plan`
(what must happen to which instances by when).  Acting on a plan means locating the affected
:class:`Target` runs and taking each through the plan's :class:`Step` s; the result of one message
is an :class:`Outcome`.  All of these are frozen dataclasses: nothing downstream mutates them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class Kind(str, enum.Enum):
    """What an SQS message turned out to be."""

    SPOT_INTERRUPTION = "spot_interruption"
    CAPACITY_RESERVATION_INTERRUPTION = "capacity_reservation_interruption"
    CAPACITY_BLOCK_EXPIRY = "capacity_block_expiry"
    SCHEDULED_CHANGE = "scheduled_change"
    STATE_CHANGE = "state_change"
    REBALANCE_RECOMMENDATION = "rebalance_recommendation"
    ASG_LIFECYCLE = "asg_lifecycle"
    UNKNOWN = "unknown"  # well-formed, but not a kind resilienced acts on
    INVALID = "invalid"  # breaks a rule; ``Event.reason`` names the field


class Wrapping(str, enum.Enum):
    """How the event reached the queue."""

    EVENTBRIDGE = "eventbridge"  # the body is the EventBridge event
    SNS = "sns"  # the body is an SNS notification whose ``Message`` holds the event
    ASG_DIRECT = "asg_direct"  # an ASG lifecycle hook notifying SQS directly (no envelope)


@dataclass(frozen=True)
class Envelope:
    """A decoded message body: the EventBridge envelope fields, not yet validated.

    For the direct ASG-to-SQS form ``source`` is ``aws.autoscaling``, ``detail_type`` is the
    lifecycle transition's detail-type and ``detail`` is the whole body.
    """

    wrapping: Wrapping
    raw: Mapping[str, Any]
    version: Any = None
    id: Any = None
    source: Any = None
    detail_type: Any = None
    account: Any = None
    time: Any = None
    region: Any = None
    resources: Any = None
    detail: Any = None


@dataclass(frozen=True)
class Event:
    """One parsed and validated interruption event (or an ``unknown``/``invalid`` verdict).

    ``deadline`` is when the capacity goes away (UTC, tz-aware) or ``None`` when there is none
    (rebalance) or it has already gone (state change).  ``attributes`` holds what a kind carries
    beyond the common fields (``instance_action``, ``state``, lifecycle hook fields, Health
    ``event_type_code``, ``end_date`` ...), always JSON-serialisable.
    """

    kind: Kind
    event_id: str | None
    source: str | None = None
    detail_type: str | None = None
    account: str | None = None
    region: str | None = None
    time: datetime | None = None
    instance_ids: tuple[str, ...] = ()
    capacity_reservation_id: str | None = None
    deadline: datetime | None = None
    reason: str | None = None
    wrapping: Wrapping = Wrapping.EVENTBRIDGE
    attributes: Mapping[str, Any] = field(default_factory=dict)


class Step(str, enum.Enum):
    """One thing a plan asks for, in the order they run."""

    NOTIFY = "notify"  # record what was seen (log, metric, Kubernetes Event); nothing else
    SIGNAL = "signal"  # drain the run's Ray nodes on the affected instances (PREEMPTION, deadline)
    DURABLE = "durable"  # wait until a checkpoint saved after the notice is in S3
    REQUEUE = "requeue"  # decide capacity and get the whole gang scheduled again
    COMPLETE_LIFECYCLE = "complete_lifecycle"  # tell the ASG it may continue terminating


@dataclass(frozen=True)
class Plan:
    """What must happen to which instances by when, for one event.

    Computed by the event kind's handler, purely from the event and the policy.  A plan that is
    not ``actionable`` has no steps and a ``reason``.
    """

    event: Event
    actionable: bool
    steps: tuple[Step, ...] = ()
    instance_ids: tuple[str, ...] = ()
    capacity_reservation_id: str | None = None
    deadline: datetime | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Target:
    """One Ray Train run with Ray nodes on the affected instances.

    In kubernetes mode ``ray_cluster``/``ray_job`` are ``"namespace/name"`` and ``node`` the
    Kubernetes Node name; in ray mode both are ``None`` and ``node`` is the Ray node's address.
    ``ray_node_ids`` are hex Ray node ids (those to drain).  ``checkpoint_uri`` is the run's S3
    prefix (``s3://bucket/prefix``), or ``None`` when nobody said where its checkpoints go.
    """

    instance_id: str
    node: str | None
    ray_cluster: str | None
    ray_job: str | None
    ray_node_ids: tuple[str, ...]
    checkpoint_uri: str | None
    ray_address: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run_key(self) -> str:
        """The identity of the run for idempotency: the RayJob, else the RayCluster, else the Ray address."""
        return self.ray_job or self.ray_cluster or self.ray_address or f"instance/{self.instance_id}"

    def as_json(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "node": self.node,
            "ray_cluster": self.ray_cluster,
            "ray_job": self.ray_job,
            "ray_node_ids": list(self.ray_node_ids),
            "checkpoint_uri": self.checkpoint_uri,
        }


class Verdict(str, enum.Enum):
    """What happens to the SQS message; decided in exactly one place (``resilienced.ack``)."""

    DELETE = "delete"  # the work is done (or there was none): acknowledge
    KEEP = "keep"  # the work failed and may succeed later: leave it for redelivery
    DEAD_LETTER = "dead_letter"  # poison: let the queue's redrive policy move it to the DLQ


class Result(str, enum.Enum):
    """How handling one message ended, before the ack policy turns it into a Verdict."""

    DONE = "done"  # the plan ran to its end (or was a no-op by design)
    DUPLICATE = "duplicate"  # another delivery of an event already handled or being handled
    NOT_ACTIONABLE = "not_actionable"  # valid, but nothing to do (unknown kind, pending state...)
    INVALID = "invalid"  # broke a validation rule: nothing to act on; dead-lettered for an operator
    UNDECODABLE = "undecodable"  # not an event at all: poison
    RETRY = "retry"  # a temporary failure: leave it
    FAILED = "failed"  # a permanent failure for this event: recorded and acknowledged


@dataclass(frozen=True)
class Outcome:
    """The result of handling one message, as logged on the decision line."""

    result: Result
    event: Event | None
    plan: Plan | None = None
    reason: str | None = None
    retry_delay: float | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
