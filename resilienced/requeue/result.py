"""The one protocol every requeuer implements, and what it reports.

A requeuer takes a located run (:class:`~resilienced.model.Target`), the capacity decision made
for it and the event, and gets the whole gang scheduled again on that capacity.  It is
idempotent per (event, run): it reads the current state and changes only what differs, so a
second application of the same decision changes nothing (``RequeueResult.changes`` empty).
With ``dry_run`` it reads but writes nothing and reports what it would change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from resilienced.capacity.decision import Capacity, CapacityDecision
from resilienced.model import Event, Target


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
    details: Mapping[str, Any] = field(default_factory=dict)
    refused: bool = False

    @property
    def changed(self) -> bool:
        """Whether this call changed something (never in a dry run)."""
        return bool(self.changes) and not self.dry_run

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "run": self.run_key, "kind": self.kind, "capacity": self.capacity.value,
            "reason": self.reason, "changes": list(self.changes), "dry_run": self.dry_run,
        }
        if self.reservation_id:
            out["reservation_id"] = self.reservation_id
        if self.retry_after is not None:
            out["retry_after_seconds"] = self.retry_after.total_seconds()
        if self.details:
            out["details"] = dict(self.details)
        if self.refused:
            out["refused"] = True
        return out


@runtime_checkable
class Requeuer(Protocol):
    """Gets one run scheduled again, as a whole, on the decided capacity."""

    kind: str

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult: ...


def waiting(target: Target, *, kind: str, decision: CapacityDecision, dry_run: bool) -> RequeueResult:
    """The result for a ``wait`` decision: nothing is changed, try again later."""
    return RequeueResult(
        run_key=target.run_key, kind=kind, capacity=Capacity.WAIT,
        reason=f"no capacity to move the run to: {decision.reason}", dry_run=dry_run,
        retry_after=decision.retry_after, decision=decision)
