"""What the daemon did to one run for one event: the record kept in the run's done claim.

:class:`~resilienced.recovery.responder.Recovery` completes the claim ``run/<event id>/<run>`` with
a :class:`RunRecord` (in kubernetes mode the Lease annotation ``resilienced.io/details``, in ray
mode the GCS KV record's ``details``).  Its JSON (:meth:`RunRecord.as_json`) is the run's report
(``run``, ``instances``, one key per step: ``notify``, ``signal``, ``durable``, ``resume``,
``requeue``, ``follow_up``) plus the event's ``event_id``, ``kind`` and ``event_time``,
``done_at`` and ``outcome`` (and ``reason`` for a failed run).

:meth:`RunRecord.summary` flattens a record into the facts ``resilienced status`` shows and a
notification carries (:mod:`resilienced.ops.notify`): one place, so the two cannot disagree.
Records written before these fields existed give ``None`` for what they lack; the steps' reports
are read back through :meth:`resilienced.recovery.steps.StepResults.from_json`, the one reader of
them, which raises :class:`~resilienced.errors.RecordError` naming a field of the wrong form.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from resilienced.model import Event, JsonValue
from resilienced.intake.validate import isoformat
from resilienced.recovery.steps import StepResults

#: The key prefix of run claims (``run/<event id>/<run>``).
RUN_PREFIX = "run/"
#: The fields of a summary, in the order ``resilienced status`` shows them.
FIELDS = ("time", "event_id", "kind", "instances", "run", "outcome", "stage", "drained",
          "checkpoint_step", "durable", "steps_lost", "capacity", "capacity_reason", "reason",
          "training_again_s", "fallbacks", "lost_gpu_hours", "premium_usd", "goodput", "ledger")


@dataclass(frozen=True)
class RunRecord:
    """One run's record for one event (see the module docstring).

    ``steps``: each step's typed report (``recovery.steps``: ``signal``: deadline and the drained
    nodes; ``durable``: verified, step, or why not and the resume step; ``resume``; ``requeue``: the
    ``RequeueResult``; ``follow_up``), one key each in the JSON the claim keeps.  ``failed``: the
    error an older record kept under that key (read, never written by this version).
    """

    run: str | None
    instances: tuple[str, ...] = ()
    steps: StepResults = StepResults()
    event_id: str | None = None
    kind: str | None = None
    event_time: str | None = None
    done_at: str | None = None
    outcome: str | None = None
    reason: str | None = None
    failed: str | None = None

    @classmethod
    def of(cls, event: Event, *, run: str, instances: tuple[str, ...], steps: StepResults,
           outcome: str, at: datetime, reason: str | None = None) -> RunRecord:
        """The done claim's record for one run: its steps' reports plus the event and the outcome."""
        return cls(run=run, instances=instances, steps=steps, event_id=event.event_id,
                   kind=event.kind.value, event_time=isoformat(event.time), done_at=isoformat(at),
                   outcome=outcome, reason=reason or None)

    def as_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"run": self.run, "instances": list(self.instances), **self.steps.as_json(),
                                     "event_id": self.event_id, "kind": self.kind,
                                     "event_time": self.event_time, "done_at": self.done_at,
                                     "outcome": self.outcome}
        if self.reason:
            out["reason"] = self.reason
        if self.failed:
            out["failed"] = self.failed
        return out

    @classmethod
    def from_json(cls, details: Mapping[str, JsonValue]) -> RunRecord:
        """The record a claim keeps: what is missing is None; an own field of the wrong form is None, a
        step's report of the wrong form a ``RecordError`` naming the field (``StepResults.from_json``)."""
        def text(name: str) -> str | None:
            value = details.get(name)
            return value if isinstance(value, str) else None

        instances = details.get("instances")
        return cls(run=text("run"), steps=StepResults.from_json(details), failed=text("failed"),
                   instances=tuple(str(i) for i in instances) if isinstance(instances, list) else (),
                   event_id=text("event_id"), kind=text("kind"), event_time=text("event_time"),
                   done_at=text("done_at"), outcome=text("outcome"), reason=text("reason"))

    def summary(self, *, key: str | None = None) -> dict[str, JsonValue]:
        """The facts of the record (a status row, a notification); ``key`` fills a missing event id."""
        steps = self.steps
        durable, requeue = steps.durable, steps.requeue
        event_id = self.event_id
        if event_id is None and key and key.startswith(RUN_PREFIX):
            event_id = key[len(RUN_PREFIX):].split("/", 1)[0]
        return {
            "time": self.done_at or self.event_time,
            "event_id": event_id,
            "kind": self.kind,
            "instances": list(self.instances),
            "run": self.run,
            "outcome": self.outcome or ("failed" if self.failed else "done"),
            "drained": list[JsonValue](sorted(steps.signal.drained)) if steps.signal is not None else [],
            "checkpoint_step": steps.checkpoint_step,
            "durable": durable.verified if durable is not None else None,
            "steps_lost": durable.steps_lost if durable is not None else None,
            "capacity": requeue.capacity.value if requeue is not None and requeue.capacity is not None else None,
            "capacity_reason": requeue.reason if requeue is not None else None,
            "reason": self.reason or self.failed or (durable.reason if durable is not None else None),
            # the run's follow-up after the requeue (resilienced.followup.rules), filled in by ``status``
            "stage": None,
            "training_again_s": None,
            "fallbacks": [],
            # the recovery's ledger (resilienced.ops.ledger), from the follow-up, filled in by ``status``
            "lost_gpu_hours": None, "premium_usd": None, "goodput": None, "ledger": None,
        }
