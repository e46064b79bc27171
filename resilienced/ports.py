"""The narrow interfaces behind which every outside system sits.

Each protocol holds only the calls resilienced makes.  The production adapter and the test
double (where one is needed at all: tests prefer the real part over a real connection) both
implement it; everything above the adapters is written against these protocols only.

================  ==============================================  ==================================
port              production adapter                              in tests and the drill
================  ==============================================  ==================================
Queue             ``resilienced.aws.sqs.SqsQueue`` (aiobotocore)  moto server over HTTP
Cluster           ``resilienced.kube.cluster.KubeCluster``        emulated API server over HTTP
                  ``resilienced.ray.cluster.RayModeCluster``      real local Ray cluster
RayControl        ``resilienced.ray.gcs.RayGcs``                  real local Ray cluster
ObjectStore       ``resilienced.aws.s3.S3Store`` (aiobotocore)    moto server over HTTP
ExportTasks       ``resilienced.aws.fsx.FsxExportTasks``          botocore Stubber
CapacitySource    ``resilienced.capacity.ec2.Ec2Capacity``        botocore Stubber
LifecycleHooks    ``resilienced.aws.autoscaling.Lifecycle``       an Auto Scaling stand-in over HTTP
ClaimStore        per mode (Kubernetes Lease, Ray GCS KV)         the same, real
Responder         ``resilienced.recovery.responder.Recovery``     the same, real (``--mode plan``:
                                                                  ``recovery.plan_only.PlanLogger``)
Planner           ``capacity.planner.CapacityPlanner``            the same, over a botocore Stubber
Requeuer          ``requeue.router.ReportingRequeuer`` around     the same, real
                  ``requeue.router.RequeueRouter`` or
                  ``ray.requeue.RayModeRequeuer``
NodeProvider      ``aws.ec2nodes.Ec2NodeProvider`` (aiobotocore)  ``local.provider.LocalNodeProvider``;
                                                                  the EC2 one on moto over HTTP
FollowUpStore     ``kube.followup_store.KubeFollowUps`` (Leases), the same, real (``doubles.
                  ``ray.followup_store.RayKvFollowUps`` (GCS KV)  MemoryFollowUps`` in unit tests)
Progress          ``kube.progress.KubeProgress``,                 the same, real (emulated API,
                  ``ray.progress.RayProgress``                    real local Ray cluster)
Replacements      ``ray.replacement.ReplacementAnnouncer``        the same, real (local Ray cluster)
================  ==============================================  ==================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Literal, Protocol, runtime_checkable

from resilienced.errors import TemporaryError
from resilienced.model import (
    Capacity,
    CapacityDecision,
    CapacityOffering,
    Event,
    JsonValue,
    Outcome,
    Plan,
    RequeueResult,
    StageSeen,
    Target,
)


# --------------------------------------------------------------------------- queue
@dataclass(frozen=True)
class Message:
    """One received SQS message."""

    message_id: str
    receipt_handle: str
    body: str
    receive_count: int = 1
    sent_at: datetime | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class Queue(Protocol):
    async def receive(
        self, *, max_messages: int, wait_seconds: int, visibility_timeout: int
    ) -> list[Message]: ...

    async def delete(self, message: Message) -> None: ...

    async def change_visibility(self, message: Message, *, seconds: int) -> None: ...

    async def max_receive_count(self) -> int | None:
        """The redrive policy's maxReceiveCount, or None when the queue has no DLQ."""
        ...

    async def ping(self) -> None:
        """Raise BackendUnavailable unless the queue answers (readiness)."""
        ...


# --------------------------------------------------------------------------- cluster
@dataclass(frozen=True)
class Location:
    """The runs found on a set of instances, and why the rest are not actionable."""

    targets: tuple[Target, ...]
    unresolved: Mapping[str, str]  # instance id -> reason it has no target


@runtime_checkable
class Cluster(Protocol):
    """Where Ray runs: KubeRay on Kubernetes, or Ray clusters without Kubernetes."""

    mode: str  # "kubernetes" | "ray"

    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location: ...

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> bool:
        """Keep new work off the target's node (kubernetes: NoSchedule taint; ray: nothing); whether
        a node carries the cordon now (False: no node to mark, or ray mode)."""
        ...

    async def record(
        self, target: Target, *, reason: str, message: str, warning: bool = False,
        once: str | None = None,
    ) -> None:
        """Leave a trace an operator sees next to the run (kubernetes: Events).

        ``once``: a key (the event id) under which the trace is left once for (target, reason),
        whichever replica records it and however often (retries, a run taken over).
        """
        ...


#: What a cordon standing for an event claim came to (:meth:`CordonClaims.cordon_claim`).
CordonClaimResult = Literal["cordoned", "decided", "taken", "gone"]


@runtime_checkable
class CordonClaims(Protocol):
    """A cluster whose cordon of an instance's Node can stand for the event claim of a notice that
    hits no run (kubernetes mode, issue #45: a gang's notices handled after its move found their
    pods gone, and each wrote an event claim, created and completed, besides its cordon).  The
    cordon is a write conditional on the Node's resourceVersion that names the event it decides,
    so of two deliveries of one event exactly one makes it; the other finds it (``decided``)."""

    def cordon_claimable(self, instance_id: str, *, event_id: str) -> bool:
        """From the cache, no request: the instance's Node is there, and resilienced's cordon is not
        on it, or is the one that decided ``event_id``."""
        ...

    async def cordon_claim(self, instance_id: str, *, event_id: str, reason: str,
                           deadline: datetime | None) -> CordonClaimResult:
        """Cordon the instance's Node naming ``event_id``: ``cordoned`` (this call did: the event
        is decided here), ``decided`` (the Node carries the cordon that decided ``event_id``: a
        copy's), ``taken`` (cordoned otherwise, meanwhile), ``gone`` (no Node)."""
        ...


# --------------------------------------------------------------------------- ray
@dataclass(frozen=True)
class RayNode:
    node_id: str  # hex
    address: str
    labels: Mapping[str, str]
    alive: bool
    is_head: bool = False
    draining_deadline_ms: int | None = None
    started_ms: int | None = None  # when the node registered with the GCS (unix ms; None: unknown)
    resources: Mapping[str, float] = field(default_factory=dict)  # its resources_total ("CPU", "GPU", ...)


@dataclass(frozen=True)
class DrainResult:
    """What a drain request came to.

    ``outcome``: ``drained`` (GCS accepted the drain), ``already_draining`` (the node drains with
    an earlier or equal deadline already: left alone), ``rejected`` (GCS refused; ``detail``
    says why), ``unknown_node`` (no such node in this cluster), ``dead`` (the node is gone).
    ``accepted`` is true for ``drained`` and ``already_draining``.
    """

    node_id: str
    outcome: str
    accepted: bool
    deadline_ms: int
    detail: str = ""


@runtime_checkable
class RayControl(Protocol):
    """The GCS calls resilienced makes on one Ray cluster (the ``ray drain-node`` protocol)."""

    async def nodes(self) -> list[RayNode]: ...

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        """Drain with reason PREEMPTION (see :class:`DrainResult` for what it came to)."""
        ...


# --------------------------------------------------------------------------- object store
@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    checksum_sha256: str | None = None  # hex, when S3 has a SHA-256 checksum for the object
    last_modified: datetime | None = None


@runtime_checkable
class ObjectStore(Protocol):
    async def list(self, *, bucket: str, prefix: str) -> list[StoredObject]: ...

    async def get(self, *, bucket: str, key: str) -> bytes: ...


# --------------------------------------------------------------------------- FSx
@dataclass(frozen=True)
class ExportTask:
    task_id: str
    lifecycle: str  # PENDING | EXECUTING | FAILED | SUCCEEDED | CANCELED | CANCELING
    failure: str | None = None
    report_path: str | None = None


@runtime_checkable
class ExportTasks(Protocol):
    async def start_export(self, *, file_system_id: str, paths: Sequence[str], token: str) -> ExportTask: ...

    async def describe(self, *, task_id: str) -> ExportTask: ...


# --------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class CapacityReservation:
    reservation_id: str
    instance_type: str
    availability_zone: str
    reservation_type: str  # "default" | "capacity-block"
    state: str
    available_instances: int
    total_instances: int
    start: datetime | None
    end: datetime | None


@runtime_checkable
class CapacitySource(Protocol):
    async def reservations(self, *, instance_type: str | None = None) -> list[CapacityReservation]: ...

    async def reservation_instances(self, *, reservation_id: str) -> list[str]:
        """Instance ids running in a capacity reservation (DescribeInstances filter)."""
        ...


# --------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class Claim:
    key: str
    holder: str
    state: str  # "held" | "done"
    details: Mapping[str, JsonValue] = field(default_factory=dict)


@runtime_checkable
class ClaimStore(Protocol):
    """Cross-replica idempotency: who handles (event id, run), and whether it is done.

    The contract every store keeps (``doubles.MemoryClaims``, ``kube.leases.KubeLeaseClaims``,
    ``ray.claims.RayKvClaims``; one test runs it against all three:
    tests/intake/test_claim_contract.py).  A claim is ``held`` by one holder (one delivery of an
    event, ``<replica>/<message id>``, or one actor) until its TTL runs out, or ``done``.  A held
    claim is *live* until ``ttl_seconds`` after its last acquire or renewal, then *expired*.

    - **acquire** (``holder``): taken, returned held by ``holder``, when the key is free: no
      claim, a released one, an expired held one (a takeover: its old holder has lost it), or a
      done one the store has forgotten (after the dedupe window).  ``None`` when another holder's
      claim is live, or the claim is done (for every holder, its completer too).  Of concurrent
      acquires of one free key at most one wins.
    - **renew**: an acquire by the holder of the claim (live, or expired and not taken over):
      its TTL restarts now, the same claim is returned.
    - **lost**: a holder has lost its claim when its renewal returns ``None`` (another holder
      took it over after its TTL ran out), or when it could not renew it for a whole TTL (from
      then on another holder may take it over at any moment without it knowing).  A holder that
      lost its claim takes no further step of the work (``claims.held_claim`` watches this).
    - **complete** (``holder``, ``details``): the claim becomes done with ``details``, remembered
      for at least the dedupe window, when ``holder`` holds it (live or expired and not taken
      over) or the key is free (the work was done: a retry must not redo it).  A claim already
      done stays as it is (the first completion's details).  For a holder that lost its claim to
      another, live holder it changes nothing: the new holder decides.
    - **release** (``holder``): the claim is freed (anyone may acquire it at once) when ``holder``
      holds it.  A done claim, another holder's claim (a holder that lost it) and a free key are
      left as they are.
    - **get**: the live held claim or the done one; ``None`` for a free key (an expired held
      claim nobody took over included).
    - **done** (``prefix``): every done claim still remembered whose key starts with ``prefix``
      (``run/<event id>/``: whether an event was handled through a run's claim).

    Done claims are forgotten after the dedupe window: memory and the GCS KV expire them, the
    daemon sweeps done Leases (``kube.leases.KubeLeaseClaims.sweep``).
    """

    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Claim | None:
        """Take (or renew) the claim; None when another live holder has it or it is done."""
        ...

    async def get(self, key: str) -> Claim | None: ...

    async def complete(self, key: str, *, holder: str, details: Mapping[str, JsonValue]) -> None:
        """Mark it done, unless another live holder has it or it is done already."""
        ...

    async def release(self, key: str, *, holder: str) -> None:
        """Free it, when ``holder`` holds it (never a done claim)."""
        ...

    async def done(self, prefix: str = "") -> list[Claim]:
        """The done claims whose keys start with ``prefix`` (within the dedupe window; reads only)."""
        ...


@dataclass(frozen=True)
class PurchaseResult:
    """What PurchaseCapacityBlock did (or, in a dry run, would have done)."""

    offering_id: str
    dry_run: bool
    reservation: CapacityReservation | None  # None in a dry run
    message: str


@runtime_checkable
class BlockMarket(Protocol):
    """What buying a Capacity Block needs besides :class:`CapacitySource` (``Ec2Capacity`` has both;
    ``capacity.planner`` buys only from a source that is one)."""

    async def offerings(self, *, instance_type: str, instance_count: int, duration: timedelta,
                        start_after: datetime, start_before: datetime) -> list[CapacityOffering]: ...

    async def purchase(self, offering: CapacityOffering, *, platform: str, purchase_key: str,
                       dry_run: bool, price_cap: Decimal,
                       tags: Mapping[str, str] | None = None) -> PurchaseResult: ...


# --------------------------------------------------------------------------- Auto Scaling
class HookAction(Protocol):
    """The fields of an ASG lifecycle action its calls name (``handlers.asg_lifecycle.LifecycleAction``)."""

    @property
    def lifecycle_hook_name(self) -> str | None: ...

    @property
    def auto_scaling_group_name(self) -> str | None: ...

    @property
    def lifecycle_action_token(self) -> str | None: ...


@runtime_checkable
class LifecycleHooks(Protocol):
    """The calls a terminate lifecycle hook waits for (``aws.autoscaling.Lifecycle``);
    ``heartbeat_seconds``: how often ``recovery.heartbeat`` beats."""

    heartbeat_seconds: float

    async def heartbeat(self, action: HookAction, *, instance_id: str | None) -> bool:
        """Restart the hook's heartbeat timeout; False when the action is no longer pending."""
        ...

    async def complete(self, action: HookAction, *, instance_id: str | None) -> str:
        """CONTINUE the terminate action; what happened, in words."""
        ...


# --------------------------------------------------------------------------- capacity and requeue
@runtime_checkable
class Planner(Protocol):
    """The capacity decision for one run (``resilienced.capacity.planner.CapacityPlanner``)."""

    async def plan_for(
        self, target: Target, *, event: Event, dry_run: bool = False
    ) -> tuple[object, CapacityDecision]:
        """The question asked about ``target``'s run (a ``CapacityRequest``) and the decision."""
        ...

    async def fallback(self, target: Target, *, event: Event, dry_run: bool = False) -> CapacityDecision:
        """Where the run goes after its recovery stalled: decided again, ``target.facts.exclude``
        passed over; ``event`` is the follow-up's notice, counted once per event id (a replica that
        takes a follow-up over has not counted it)."""
        ...

    async def decide_again(self, target: Target, *, event: Event, unavailable: str,
                           instance_count: int) -> CapacityDecision:
        """The decision after an applier found no capacity in ``unavailable`` (a capacity type or a
        reservation id; marked out of capacity for the run's pool) for ``instance_count`` instances
        (:class:`NoCapacity`); a ``wait`` decision carries its ``retry_after``."""
        ...


@runtime_checkable
class Requeuer(Protocol):
    """Gets one run scheduled again, as a whole, on the decided capacity.

    Implemented by each applier (``requeue.kueue``, ``requeue.kuberay``, ``requeue.volcano``,
    ``ray.requeue``), by ``requeue.router.RequeueRouter`` (which picks one) and by
    ``requeue.router.ReportingRequeuer`` (one of them plus its metric and its Events; what
    ``Recovery`` is given).
    """

    @property
    def kind(self) -> str:
        """Which applier: ``kueue`` | ``kuberay`` | ``volcano`` | ``kubernetes`` | ``ray``."""
        ...

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult: ...


@runtime_checkable
class Withdraws(Protocol):
    """A requeuer that can give back what a requeue asked of one capacity and that never came
    (ray mode: replacement nodes that did not join), before the run is moved elsewhere."""

    async def withdraw(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> list[str]:
        """Give it back; the things given back, in words (empty: nothing to give back)."""
        ...


class NoCapacity(TemporaryError):
    """An applier (or a :class:`NodeProvider`) found no capacity in the decided pool right now (an
    insufficient-capacity error).  ``recovery.move.Mover`` decides again on it, in both modes.

    ``asked``: instances asked of the pool; ``given``: how many it gave before it ran out; ``kept``:
    whether those stay (an elastic run grows by what there is; a gang gives them back), with
    ``changes`` saying what was kept, in words.  ``cause``: why the pool gave no more where it is
    more than its being out of capacity (an EC2 quota used up, named), carried into the fallback's
    reason.
    """

    def __init__(self, capacity: Capacity, message: str = "", *, asked: int = 0, given: int = 0,
                 kept: bool = False, changes: Sequence[str] = (), cause: str = "") -> None:
        super().__init__(f"no {capacity.value} capacity{': ' + message if message else ''}", delay=60.0)
        self.capacity = capacity
        self.asked, self.given, self.kept, self.changes = asked, given, kept, tuple(changes)
        self.cause = cause

    @property
    def still_missing(self) -> int:
        """How many instances the next decision must place."""
        return self.asked - self.given if self.kept else self.asked


@dataclass(frozen=True)
class ProvidedNode:
    """A node a :class:`NodeProvider` launched."""

    instance_id: str
    capacity: Capacity
    labels: Mapping[str, str] = field(default_factory=dict)
    ray_node_id: str | None = None


@runtime_checkable
class NodeProvider(Protocol):
    """Starts and stops the nodes of one Ray cluster, per capacity pool (ray mode's requeue;
    the drill's ``resilienced.local.provider.LocalNodeProvider``)."""

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None, idempotency_key: str | None = None,
                     ) -> list[ProvidedNode]:
        """Start one node per entry of ``node_labels`` (extra labels each); may return fewer
        than asked when the pool runs out; raises :class:`NoCapacity` when it got none.
        ``idempotency_key`` (the event id): the same launch again starts nothing twice (EC2: the
        instances' ``ClientToken``)."""
        ...

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        """Stop ``nodes`` and give their capacity back."""
        ...

    async def nodes(self) -> list[ProvidedNode]:
        """The nodes this provider launched that are still up."""
        ...

    async def available(self, capacity: Capacity) -> int | None:
        """How many more nodes ``capacity`` can give (None: not known)."""
        ...


@runtime_checkable
class Replacements(Protocol):
    """Where an elastic run learns when its replacement is expected to join
    (``resilienced.ray.replacement.ReplacementAnnouncer``: the run's GCS KV)."""

    async def announce(self, target: Target, result: RequeueResult) -> dict[str, JsonValue] | None:
        """Write the expected join for the workers ``result`` replaces; None when there is nothing
        to write or it cannot be written (the run then shrinks at once)."""
        ...


# --------------------------------------------------------------------------- a Ray cluster's GCS KV
class GcsKv(Protocol):
    """The internal-KV calls ray mode's claim and follow-up stores need (``ray.gcs.RayGcs`` has them)."""

    async def kv_put_if_absent(self, key: str, value: bytes) -> bool: ...

    async def kv_put(self, key: str, value: bytes) -> None: ...

    async def kv_get(self, key: str) -> bytes | None: ...

    async def kv_keys(self, prefix: str) -> list[str]: ...

    async def kv_del(self, key: str) -> bool: ...


@runtime_checkable
class BoardKv(Protocol):
    """The GCS calls the replacement board needs (``ray.replacement``; ``RayGcs`` has them)."""

    async def kv_put(self, key: str, value: bytes) -> None: ...

    async def kv_get(self, key: str) -> bytes | None: ...

    async def kv_keys(self, prefix: str) -> list[str]: ...

    async def nodes(self) -> list[RayNode]: ...


# --------------------------------------------------------------------------- following a requeue
@runtime_checkable
class FollowUpStore(Protocol):
    """Where the follow-up of each run lives (``resilienced.followup.rules.FollowUp`` as JSON), next to
    the run claims: one record per run, written compare-and-set on the version it was read at."""

    async def get(self, run: str) -> tuple[dict[str, JsonValue], str] | None:
        """(record, version), or None when the run has none."""
        ...

    async def put(self, run: str, record: Mapping[str, JsonValue], *, version: str | None) -> str | None:
        """Write ``record`` if the stored one is still at ``version`` (None: there is none yet);
        the new version, or None when someone wrote it first."""
        ...

    async def all(self) -> list[tuple[dict[str, JsonValue], str]]:
        """Every record (open and ended), with its version."""
        ...

    async def delete(self, run: str, *, version: str) -> bool:
        """Delete the record if it is still at ``version``; whether it was."""
        ...


@runtime_checkable
class Progress(Protocol):
    """Looks at a requeued run's way back (kubernetes: Kueue, pods, Nodes, NodeClaims; ray: the
    Ray cluster's nodes).  The training stage is read from the run's checkpoint root in S3."""

    async def admitted(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> StageSeen:
        """Kueue: the run's active Workload holds quota and is admitted on a flavor of ``capacity``."""
        ...

    async def placed(self, target: Target, *, capacity: Capacity, reservation_id: str | None,
                     since: datetime | None = None) -> StageSeen:
        """kubernetes: every worker pod is bound to a Node of ``capacity`` (``scheduled``); ray:
        the replacement nodes joined the cluster with its label (``joined``).  ``since``: when the
        stage began (evidence older than it is not the stage's)."""
        ...


# --------------------------------------------------------------------------- respond
@runtime_checkable
class Responder(Protocol):
    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        """Carry out ``plan``; return its outcome or raise TemporaryError / PermanentError."""
        ...


@runtime_checkable
class SharesClaims(Protocol):
    """A responder that can say a plan needs no event claim of its own (``consumer.event_claim``'s
    docstring: ``Recovery`` for a notice that joins its run's handling in this replica)."""

    async def needs_event_claim(self, plan: Plan) -> bool: ...

    def settled(self, plan: Plan) -> None:
        """This delivery's handling of ``plan`` is over (acted on, or not: its event claim was
        another's); what :meth:`needs_event_claim` set aside for it is let go."""
