"""The one protocol every requeuer implements, and what it reports.

A requeuer takes a located run (:class:`~resilienced.model.Target`), the capacity decision made
for it and the event, and gets the whole gang scheduled again on that capacity.  It is
idempotent per (event, run): it reads the current state and changes only what differs, so a
second application of the same decision changes nothing (``RequeueResult.changes`` empty).
With ``dry_run`` it reads but writes nothing and reports what it would change.
"""

from __future__ import annotations

from resilienced.model import Capacity, CapacityDecision, RequeueResult, Target
from resilienced.ports import Requeuer

__all__ = ["RequeueResult", "Requeuer", "waiting"]


def waiting(target: Target, *, kind: str, decision: CapacityDecision, dry_run: bool) -> RequeueResult:
    """The result for a ``wait`` decision: nothing is changed, try again later."""
    return RequeueResult(
        run_key=target.run_key, kind=kind, capacity=Capacity.WAIT,
        reason=f"no capacity to move the run to: {decision.reason}", dry_run=dry_run,
        retry_after=decision.retry_after, decision=decision)
