"""What a (re)start of an elastic run's worker group costs, measured by the run itself.

Ray Train's controller knows when it decided to start a worker group (a size decided: the first
start, a restart after a preemption, a resize); rank 0 knows when the new group has trained its
first step.  The time between the two is what the next decision to shrink or to wait for a
replacement weighs (:mod:`trainer.replacement`).  The files, under the checkpoint root (storage the
ranks and the controller share, as for :mod:`trainer.resize`):

* ``.restart``: written by ``trainer.elastic.ElasticCallback`` (in the controller) when a size is
  decided, then once per milestone of the worker group's start::

      {"id": "<hex>", "at": <unix s>, "kind": "start" | "restart" | "resize", "workers": N,
       "decision": {...} | null, "marks": {"group_start": t, "actors_ready": t, "group_ready": t, "launched": t}}

* ``.restart-cost``: written by rank 0 after the first step of the group (``Checkpointer``)::

      {"id": "<the .restart id>", "seconds": S, "kind": ..., "workers": N, "at": <unix s>,
       "phases": {"teardown": s, "actors": s, "process_group": s, "launch": s, "train_fn": s,
                  "checkpointer": s, "model": s, "restore": s, "first_step": s}, "decision": {...} | null}

  ``phases`` splits ``seconds``: ``teardown`` (a resize: the ranks' save and the old group's
  shutdown), ``actors`` (the placement group and the worker actors: new worker processes),
  ``process_group`` (each worker's train context and torch process group), ``launch`` (the
  train function started on every worker), ``train_fn`` (the train function up to the
  ``Checkpointer``: its imports and set-up), ``checkpointer`` (the checkpointer's own gloo groups
  and the root probe), ``model`` (from there to ``restore``: building and sharding the model),
  ``restore`` (reading the checkpoint), ``first_step``.

Both are written to a temporary name and renamed.  Wall clocks of the controller's and rank 0's
nodes are compared: they are NTP-synchronised on any cloud, and a skew shows in ``teardown`` or
``train_fn``.  This module imports neither Ray nor torch.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from trainer.resize import read_json_file, write_json_file

BEGAN = ".restart"
COST = ".restart-cost"

#: The controller's milestones, in order (``mark``), and rank 0's (``Checkpointer``).
CONTROLLER_MARKS = ("group_start", "actors_ready", "group_ready", "launched")
RANK_MARKS = ("checkpointer_init", "checkpointer_ready", "restore_start", "restore_end", "first_step")


def begin(root: str | os.PathLike[str], *, kind: str, workers: int, decision: dict[str, Any] | None = None,
          at: float | None = None) -> str:
    """A size was decided: the clock of this (re)start runs from ``at`` (default now).  The controller."""
    restart_id = uuid.uuid4().hex
    write_json_file(Path(root) / BEGAN, {"id": restart_id, "at": time.time() if at is None else at, "kind": kind,
                                "workers": workers, "decision": decision, "marks": {}})
    return restart_id


def mark(root: str | os.PathLike[str], name: str) -> None:
    """A milestone of the worker group's start (one of :data:`CONTROLLER_MARKS`).  The controller."""
    path = Path(root) / BEGAN
    data = read_json_file(path)
    if data is not None:
        data.setdefault("marks", {})[name] = time.time()
        write_json_file(path, data)


def measure(root: str | os.PathLike[str], *, marks: dict[str, float], world_size: int) -> dict[str, Any] | None:
    """After the first step of a group: its cost since the size decision (rank 0), or None.

    None when no controller started a clock (a run without ``ElasticCallback``), or this clock was
    measured already (an earlier group of the same start).  ``marks``: rank 0's milestones
    (:data:`RANK_MARKS`), unix seconds.
    """
    root = Path(root)
    began = read_json_file(root / BEGAN)
    if began is None or not isinstance(began.get("at"), (int, float)):
        return None
    measured = read_json_file(root / COST)
    if measured is not None and measured.get("id") == began.get("id"):
        return None
    at = float(began["at"])
    if at > marks.get("first_step", time.time()):
        return None  # a clock started after this group's first step: not this group's
    cost = {"id": began.get("id"), "seconds": round(marks.get("first_step", time.time()) - at, 3),
            "kind": began.get("kind"), "workers": world_size, "at": time.time(),
            "phases": phases(at=at, marks={**(began.get("marks") or {}), **marks}),
            "decision": began.get("decision")}
    write_json_file(root / COST, cost)
    return cost


def phases(*, at: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds between consecutive milestones (a missing one merges into the next phase)."""
    names = ("teardown", "actors", "process_group", "launch", "train_fn", "checkpointer", "model", "restore",
             "first_step")
    order = ("group_start", "actors_ready", "group_ready", "launched", "checkpointer_init", "checkpointer_ready",
             "restore_start", "restore_end", "first_step")
    out: dict[str, float] = {}
    previous = at
    for name, milestone in zip(names, order):
        t = marks.get(milestone)
        if isinstance(t, (int, float)):
            out[name] = round(max(0.0, t - previous), 3)
            previous = max(previous, t)
    return out


def last_cost(root: str | os.PathLike[str]) -> float | None:
    """Seconds the run's last measured (re)start took, or None (none measured)."""
    cost = read_json_file(Path(root) / COST)
    seconds = cost.get("seconds") if cost else None
    return float(seconds) if isinstance(seconds, (int, float)) else None


__all__ = ["BEGAN", "COST", "begin", "last_cost", "mark", "measure", "phases"]
