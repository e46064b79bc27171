"""The typed values that flow through the daemon: events, plans, targets, outcomes.

An SQS body is decoded into an :class:`Envelope`, parsed by the handler registered for its
(source, detail-type) into an :class:`Event`, and the handler turns the event into a :class:`Plan`
(what must happen to which instances by when).  Acting on a plan means locating the affected
:class:`Target` runs and taking each through the plan's :class:`Step` s; the result of one message
is an :class:`Outcome`.  All of these are frozen dataclasses: nothing downstream mutates them.

What comes from outside before it is checked (a message body, a Kubernetes object, a record read
back from a claim) is a :data:`JsonValue`: whatever ``json.loads`` can give, read with
``isinstance`` checks; each kind's parsed fields are its own frozen :class:`EventDetail`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TypeAlias, Union

#: A JSON value as ``json.loads`` gives it: what the daemon reads from outside (message bodies,
#: Kubernetes objects, records in claims) before checking it, and what its reports are made of.
JsonValue: TypeAlias = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
#: A JSON object.
JsonObject: TypeAlias = dict[str, JsonValue]


class Capacity(str, enum.Enum):
    """Where a run can be placed (``wait``: nowhere right now)."""

    SPOT = "spot"
    CAPACITY_BLOCK = "capacity-block"
    ON_DEMAND = "on-demand"
    WAIT = "wait"


#: The names of the capacities a run is placed on (every :class:`Capacity` but ``wait``), in the
#: enum's order: the one spelling of ``spot``, ``capacity-block``, ``on-demand`` for the settings
#: (``--node-join-seconds``, ``--ec2-autoscaler-capacities``), the ledger's prices and Kueue's check.
CAPACITY_NAMES: tuple[str, ...] = tuple(c.value for c in Capacity if c is not Capacity.WAIT)


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
    raw: Mapping[str, JsonValue]
    version: JsonValue = None
    id: JsonValue = None
    source: JsonValue = None
    detail_type: JsonValue = None
    account: JsonValue = None
    time: JsonValue = None
    region: JsonValue = None
    resources: JsonValue = None
    detail: JsonValue = None


@dataclass(frozen=True)
class EventDetail:
    """What one kind of event carries beyond the common fields, parsed and typed.

    Each kind's model is a frozen dataclass deriving from this one, next to its parser in
    ``handlers/<kind>.py`` (as Karpenter's ``messages/<kind>/model.go``); whoever needs a field
    reads it by type (``isinstance(event.detail, LifecycleAction)``), not by a string key.
    """

    def as_json(self) -> dict[str, JsonValue]:
        """The fields as the logs (the ``plan`` line's ``attributes``) show them."""
        raise NotImplementedError


@dataclass(frozen=True)
class Event:
    """One parsed and validated interruption event (or an ``unknown``/``invalid`` verdict).

    ``deadline`` is when the capacity goes away (UTC, tz-aware) or ``None`` when there is none
    (rebalance) or it has already gone (state change).  ``detail`` holds what the kind carries
    beyond the common fields (its :class:`EventDetail`: the Spot ``instance_action``, a state
    change's ``state``, an ASG hook's fields, a Health event's codes and window, a Capacity
    Block's ``end_date`` ...), or None for a kind without any (rebalance, unknown, invalid).
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
    detail: EventDetail | None = None

    def detail_json(self) -> dict[str, JsonValue]:
        """:meth:`EventDetail.as_json` of the detail ({} without one)."""
        return self.detail.as_json() if self.detail is not None else {}


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


class NodeShape(str, enum.Enum):
    """Who manages the Nodes a run is on, read from the lost Node's labels (docs/requeue.md "Node shapes").

    ``karpenter``: a NodePool (label ``karpenter.sh/nodepool``): capacity from Karpenter's labels,
    steered with them, Capacity Blocks only where an EC2NodeClass of the run selects them, blocks
    drained 40 min before their end.  ``eks-nodegroup``: an EKS managed node group (label
    ``eks.amazonaws.com/nodegroup``): capacity from ``eks.amazonaws.com/capacityType``, steered with
    it (the cluster autoscaler scales the group whose nodes fit).  Neither (None): Karpenter's
    labels where the Node has them, steered with Karpenter's labels, no NodePool rule.
    """

    KARPENTER = "karpenter"
    EKS_NODEGROUP = "eks-nodegroup"


@dataclass(frozen=True)
class RunFacts:
    """What the locate step knows about a run, for the capacity decision and the requeue.

    Every field is optional (``None`` / empty: not known); the safe defaults are one instance,
    unknown AZ, unknown current capacity (treated like Spot), never moved, unknown remaining time.
    Kubernetes mode reads them from the Node's labels and the run's annotations
    (``resilienced.kube.locate.capacity_facts``); ray mode from the Ray node's labels.
    ``resilienced.capacity.request.CapacityRequest.from_target`` checks and turns them into the
    decision's question (a value of the wrong form is an error naming the field there).
    """

    instance_type: str | None = None  # "p5.48xlarge" (label node.kubernetes.io/instance-type)
    availability_zone: str | None = None  # "us-east-1a" (topology.kubernetes.io/zone)
    # as labelled: "spot" | "capacity-block" | "on-demand", or Karpenter's "reserved" (a Capacity Block,
    # or an On-Demand Capacity Reservation when reservation_type is "default")
    capacity_type: str | None = None
    reservation_id: str | None = None  # the reservation the run is on (karpenter.k8s.aws/capacity-reservation-id)
    # Karpenter's karpenter.k8s.aws/capacity-reservation-type of a reserved node: "capacity-block" | "default" (an ODCR)
    reservation_type: str | None = None
    node_shape: str | None = None  # NodeShape value: who manages the run's Nodes (None: neither shape)
    moved_at: str | datetime | None = None  # the run's last move (annotation resilienced.io/capacity-moved-at)
    instance_count: int | None = None  # instances the whole run (gang) uses
    # accelerators the run's worker pods request (kube.locate.ACCELERATORS) or its Ray worker nodes offer
    # ("GPU"), all together; None: none declared (the ledger then counts 1 per rank)
    accelerators: float | None = None
    instance_ids: tuple[str, ...] = ()  # the run's instances this event names (set when runs are grouped)
    lost_instance_ids: tuple[str, ...] = ()  # the run's instances this event takes away
    run_needs_seconds: float | None = None  # how much longer the run needs capacity
    volcano_job: str | None = None  # "namespace/name" of the batch.volcano.sh Job running the run
    groups: tuple[str, ...] = ()  # KubeRay worker groups of the run's pods on the instance (ray.io/group)
    elastic: bool = False  # the run continues at a smaller size (annotation resilienced.io/elastic)
    elastic_fallback: str | None = None  # why an elastic run is requeued as a gang anyway (Kueue)
    elastic_error: str | None = None  # the resilienced.io/elastic annotation is malformed (named)
    # Only where the cluster serves EC2NodeClasses (None: any block of the account will do):
    selectable_reservations: tuple[str, ...] | None = None  # cr- ids Karpenter can launch the run into
    selectable_from: tuple[str, ...] = ()  # "nodepool/ec2nodeclass" pairs those ids were read from
    # the last requeue resilienced applied to the run (its annotations): the event it was for,
    # the capacity and the block; a delivery that takes the same event over keeps it
    requeued_for: str | None = None
    requeued_capacity: str | None = None
    requeued_reservation_id: str | None = None
    # capacity the run must not be moved to now (capacity types or reservation ids): what stalled
    # a recovery of this run, within its cool-down (resilienced.followup.rules, docs/requeue.md)
    exclude: tuple[str, ...] = ()
    # capacities the run cannot be admitted on now, with why: ((capacity value, reason), ...);
    # Kueue: no flavor of the run's ClusterQueue matches, or its free quota is short
    closed_capacity: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Target:
    """One Ray Train run with Ray nodes on the affected instances.

    In kubernetes mode ``ray_cluster``/``ray_job`` are ``"namespace/name"`` and ``node`` the
    Kubernetes Node name; in ray mode both are ``None`` and ``node`` is the Ray node's address.
    ``ray_node_ids`` are hex Ray node ids (those to drain).  ``checkpoint_uri`` is the run's S3
    prefix (``s3://bucket/prefix``), or ``None`` when nobody said where its checkpoints go.
    ``facts`` are what the capacity decision and the requeue read (:class:`RunFacts`);
    ``attributes`` hold what the locate step saw besides, for the logs and the operator
    (``head_on_instance``, ``gcs_error``, ``unmapped_pods``, ``matched_by``, ...).
    """

    instance_id: str
    node: str | None
    ray_cluster: str | None
    ray_job: str | None
    ray_node_ids: tuple[str, ...]
    checkpoint_uri: str | None
    ray_address: str | None = None
    attributes: Mapping[str, JsonValue] = field(default_factory=dict)
    facts: RunFacts = RunFacts()

    @property
    def run_key(self) -> str:
        """The identity of the run for idempotency: the RayJob, else the RayCluster, else the Ray address."""
        return self.ray_job or self.ray_cluster or self.ray_address or f"instance/{self.instance_id}"

    def as_json(self) -> dict[str, JsonValue]:
        return {
            "instance_id": self.instance_id,
            "node": self.node,
            "ray_cluster": self.ray_cluster,
            "ray_job": self.ray_job,
            "ray_node_ids": list(self.ray_node_ids),
            "checkpoint_uri": self.checkpoint_uri,
        }


@dataclass(frozen=True)
class StageSeen:
    """What one look at a stage of a requeued run found (``resilienced.followup.rules``).

    ``reached``: the stage's condition holds; ``detail``: what was seen, in words (the evidence of a
    stall when not reached: a pending Workload's condition, an unschedulable pod, a NodeClaim that
    could not launch); ``at``: when the stage was reached where the source says so (the trainer's
    first step), else None (the look's own time counts); ``facts``: JSON-serialisable numbers
    behind it (``resumed_from_step``, ``world_size`` ...).
    """

    reached: bool
    detail: str
    at: datetime | None = None
    facts: Mapping[str, JsonValue] = field(default_factory=dict)


class Verdict(str, enum.Enum):
    """What happens to the SQS message; decided in exactly one place (``resilienced.intake.ack_policy``)."""

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
    details: Mapping[str, JsonValue] = field(default_factory=dict)


# --------------------------------------------------------------------------- capacity and requeue
@dataclass(frozen=True)
class CapacityOffering:
    """One Capacity Block offering (DescribeCapacityBlockOfferings), in the decision's terms."""

    offering_id: str
    instance_type: str
    availability_zone: str
    instance_count: int
    start: datetime
    end: datetime
    upfront_fee: Decimal
    currency: str = "USD"


@dataclass(frozen=True)
class CapacityDecision:
    """Where the run goes, and why.

    ``reservation_id`` is set for ``capacity-block`` on an existing reservation;
    ``offering`` is set instead when the block is to be bought first.  ``details`` holds the
    numbers behind the reason (JSON-serialisable) for the decision line and the dry-run plan.
    """

    capacity: Capacity
    reason: str
    reservation_id: str | None = None
    offering: CapacityOffering | None = None
    retry_after: timedelta | None = None
    details: Mapping[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity", Capacity(self.capacity))
        if self.capacity is not Capacity.CAPACITY_BLOCK and (self.reservation_id or self.offering):
            raise ValueError(f"a {self.capacity.value} decision has no reservation or offering")

    @property
    def places(self) -> bool:
        """Whether the decision puts the run somewhere (not ``wait``)."""
        return self.capacity is not Capacity.WAIT

    def as_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"capacity": self.capacity.value, "reason": self.reason}
        if self.reservation_id:
            out["reservation_id"] = self.reservation_id
        if self.offering:
            out["offering"] = {
                "offering_id": self.offering.offering_id,
                "availability_zone": self.offering.availability_zone,
                "instance_count": self.offering.instance_count,
                "start": self.offering.start.isoformat(),
                "end": self.offering.end.isoformat(),
                "upfront_fee": str(self.offering.upfront_fee),
                "currency": self.offering.currency,
            }
        if self.retry_after is not None:
            out["retry_after_seconds"] = self.retry_after.total_seconds()
        if self.details:
            out["details"] = dict(self.details)
        return out


@dataclass(frozen=True)
class RequeueResult:
    """What a requeue changed (or, with ``dry_run``, would change).

    ``capacity``/``reservation_id`` say where the run now goes; in ray mode they can differ from
    the decision passed in (a pool turned out full and the decision was made again).
    ``changes`` lists each change in words; empty means the run already was where the decision
    puts it, or the decision was ``wait``.  ``retry_after`` is set when nothing could be done yet.
    ``refused`` is set when the requeuer will not move this run at all (``reason`` says why; a
    Warning Event ``RequeueRefused`` is recorded on it), e.g. a KubeRay ``upgradeStrategy:
    Recreate`` cluster outside Kueue, where any template change restarts every pod.
    """

    run_key: str
    kind: str  # "kueue" | "kuberay" | "volcano" | "ray"
    capacity: Capacity
    reason: str
    reservation_id: str | None = None
    changes: tuple[str, ...] = ()
    dry_run: bool = False
    retry_after: timedelta | None = None
    decision: CapacityDecision | None = None
    details: Mapping[str, JsonValue] = field(default_factory=dict)
    refused: bool = False

    @classmethod
    def waiting(cls, target: Target, *, kind: str, decision: CapacityDecision, dry_run: bool) -> RequeueResult:
        """The result for a ``wait`` decision: nothing is changed, try again later."""
        return cls(run_key=target.run_key, kind=kind, capacity=Capacity.WAIT,
                   reason=f"no capacity to move the run to: {decision.reason}", dry_run=dry_run,
                   retry_after=decision.retry_after, decision=decision)

    @property
    def changed(self) -> bool:
        """Whether this call changed something (never in a dry run)."""
        return bool(self.changes) and not self.dry_run
