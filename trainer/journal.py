"""Rank 0's JSON-lines files: one line per trained step, one line per lifecycle event.

``--metrics-out``: ``{"step": int, "loss": float, "world_size": int, "attempt": int, "time": float}``
per trained step; a step trained again after a restart is written again (that is how the drill
counts steps trained twice).

``--events-out``: ``{"event": str, "time": float, ...}`` with these events and fields:

=========================  ====================================================================
``started``                ``world_size``, ``resumed_from_step`` (int or null), ``attempt``
``preemption_notice``      ``step``, ``deadline_ms`` (unix ms or null), ``source`` ("ray"|"sigterm")
``checkpoint_committed``   ``step``, ``reason``, ``path``, ``save_seconds``
``checkpoint_rejected``    ``path``, ``why``
``resize_requested``       ``step`` (Ray Train is about to grow an elastic run: the ranks save it)
``waiting_for_teardown``   ``step`` (recorded once the last save is committed, before it is reported)
``restarted``              ``seconds``, ``kind``, ``world_size``, ``phases``, ``decision`` (an elastic
                           run's new group trained its first step: ``trainer.restarts``)
``finished``               ``step``
=========================  ====================================================================

Each line is written with one ``write`` on a file opened for appending and flushed at once, so a
reader tailing the file sees whole lines, and lines of several attempts interleave correctly.
Ranks other than 0 hold a journal that writes nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = (
    "started",
    "preemption_notice",
    "checkpoint_committed",
    "checkpoint_rejected",
    "resize_requested",
    "waiting_for_teardown",
    "restarted",
    "finished",
)


class Journal:
    """Appends metrics and events for rank 0; a no-op on every other rank."""

    def __init__(self, *, metrics_out: Path | None, events_out: Path | None, enabled: bool) -> None:
        self._metrics = metrics_out if enabled else None
        self._events = events_out if enabled else None
        for path in (self._metrics, self._events):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)

    def metric(self, *, step: int, loss: float, world_size: int, attempt: int) -> None:
        if self._metrics is not None:
            _append(self._metrics, {
                "step": step, "loss": loss, "world_size": world_size, "attempt": attempt,
                "time": time.time(),
            })

    def event(self, event: str, **fields: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}; expected one of {EVENTS}")
        if self._events is not None:
            _append(self._events, {"event": event, "time": time.time(), **fields})


def _append(path: Path, record: dict[str, Any]) -> None:
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a journal file (a torn last line is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
