"""What the daemon did to one run for one event: the record kept in the run's done claim.

:class:`~resilienced.recovery.responder.Recovery` completes the claim ``run/<event id>/<run>`` with
:func:`record` (in kubernetes mode the Lease annotation ``resilienced.io/details``, in ray mode
the GCS KV record's ``details``).  The record is the run's report (``run``, ``instances``, one
key per step: ``notify``, ``signal``, ``durable``, ``resume``, ``requeue``) plus the event's
``event_id``, ``kind`` and ``event_time``, ``done_at`` and ``outcome``.

:func:`summary` flattens a record into the facts ``resilienced status`` shows and a
notification carries (:mod:`resilienced.notify`): one place, so the two cannot disagree.
Records written before these fields existed give ``None`` for what they lack.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from resilienced.model import Event
from resilienced.validate import isoformat

#: The key prefix of run claims (``run/<event id>/<run>``).
RUN_PREFIX = "run/"
#: The fields of a summary, in the order ``resilienced status`` shows them.
FIELDS = ("time", "event_id", "kind", "instances", "run", "outcome", "stage", "drained",
          "checkpoint_step", "durable", "steps_lost", "capacity", "capacity_reason", "reason",
          "training_again_s", "fallbacks")


def record(event: Event, report: Mapping[str, Any], *, outcome: str, at: datetime,
           reason: str | None = None) -> dict[str, Any]:
    """The done claim's details for one run: its report plus the event and the outcome."""
    out = {**report, "event_id": event.event_id, "kind": event.kind.value,
           "event_time": isoformat(event.time), "done_at": isoformat(at), "outcome": outcome}
    if reason:
        out["reason"] = reason
    return out


def summary(details: Mapping[str, Any], *, key: str | None = None) -> dict[str, Any]:
    """The facts of one record (a status row, a notification); ``key`` fills a missing event id."""
    durable = details.get("durable") if isinstance(details.get("durable"), Mapping) else {}
    resume = details.get("resume") if isinstance(details.get("resume"), Mapping) else {}
    requeue = details.get("requeue") if isinstance(details.get("requeue"), Mapping) else {}
    signal = details.get("signal") if isinstance(details.get("signal"), Mapping) else {}
    event_id = details.get("event_id")
    if event_id is None and key and key.startswith(RUN_PREFIX):
        event_id = key[len(RUN_PREFIX):].split("/", 1)[0]
    if durable:
        step = durable.get("step") if durable.get("verified") else durable.get("resume_step")
        is_durable: bool | None = bool(durable.get("verified"))
    else:
        step, is_durable = resume.get("resume_step"), None
    return {
        "time": details.get("done_at") or details.get("event_time"),
        "event_id": event_id,
        "kind": details.get("kind"),
        "instances": list(details.get("instances") or []),
        "run": details.get("run"),
        "outcome": details.get("outcome") or ("failed" if details.get("failed") else "done"),
        "drained": sorted((signal.get("drained") or {}).keys()),
        "checkpoint_step": step,
        "durable": is_durable,
        "steps_lost": durable.get("steps_lost") if durable else None,
        "capacity": requeue.get("capacity"),
        "capacity_reason": requeue.get("reason"),
        "reason": details.get("reason") or details.get("failed") or durable.get("reason"),
        # the run's follow-up after the requeue (resilienced.followup), filled in by ``status``
        "stage": None,
        "training_again_s": None,
        "fallbacks": [],
    }
