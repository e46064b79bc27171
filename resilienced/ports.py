"""The narrow interfaces behind which every outside system sits.

Each protocol holds only the calls resilienced makes.  The production adapter and the test
double (where one is needed at all: tests prefer the real part over a real connection) both
implement it; everything above the adapters is written against these protocols only.

================  ==============================================  ==================================
port              production adapter                              in tests and the drill
================  ==============================================  ==================================
Queue             ``resilienced.aws.sqs.SqsQueue`` (aiobotocore)  moto server over HTTP
Cluster           ``resilienced.kube.KubeCluster``                emulated API server over HTTP
                  ``resilienced.ray.cluster.RayModeCluster``      real local Ray cluster
RayControl        ``resilienced.ray.gcs.RayGcs``                  real local Ray cluster
ObjectStore       ``resilienced.aws.s3.S3Store`` (aiobotocore)    moto server over HTTP
ExportTasks       ``resilienced.aws.fsx.FsxExportTasks``          botocore Stubber
CapacitySource    ``resilienced.capacity.Ec2Capacity``            botocore Stubber
ClaimStore        per mode (Kubernetes Lease, Ray GCS KV)         the same, real
Responder         ``resilienced.recovery.responder.Recovery``     the same, real (``--mode plan``:
                                                                  ``recovery.plan_only.PlanLogger``)
================  ==============================================  ==================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from resilienced.model import Outcome, Plan, Target


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

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> None:
        """Keep new work off the target's node (kubernetes: NoSchedule taint; ray: nothing)."""
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


# --------------------------------------------------------------------------- ray
@dataclass(frozen=True)
class RayNode:
    node_id: str  # hex
    address: str
    labels: Mapping[str, str]
    alive: bool
    is_head: bool = False
    draining_deadline_ms: int | None = None


@runtime_checkable
class RayControl(Protocol):
    """The GCS calls resilienced makes on one Ray cluster (the ``ray drain-node`` protocol)."""

    async def nodes(self) -> list[RayNode]: ...

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> bool:
        """Drain with reason PREEMPTION; True when GCS accepted it."""
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
    details: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class ClaimStore(Protocol):
    """Cross-replica idempotency: who handles (event id, run), and whether it is done."""

    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Claim | None:
        """Take the claim; return None when another live holder has it or it is done."""
        ...

    async def get(self, key: str) -> Claim | None: ...

    async def complete(self, key: str, *, holder: str, details: Mapping[str, Any]) -> None: ...

    async def release(self, key: str, *, holder: str) -> None: ...


# --------------------------------------------------------------------------- respond
@runtime_checkable
class Responder(Protocol):
    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        """Carry out ``plan``; return its outcome or raise TemporaryError / PermanentError."""
        ...
