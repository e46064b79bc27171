"""Shrink now, or wait for the replacement: the decision an elastic run makes when a node is lost.

An elastic run that loses a node can restart at once on the survivors (one restart now, a second
when the replacement joins and the run grows back), or wait for the replacement and restart once
at full size, as a gang requeue does.  Which costs fewer idle worker-seconds depends on two
figures, each known by one side:

* **when the replacement joins**: the daemon asked for it and knows, from its own launches of that
  capacity kind, how long a node takes to join (docs/requeue.md, "Elastic runs: the replacement's
  estimate").  It writes one record per lost Ray node into the cluster's GCS internal KV,
  namespace :data:`NAMESPACE`, key :func:`key` (``replacement/<lost node id, hex>``), JSON::

      {"lost_instance_id": "i-0...", "capacity": "capacity-block", "asked_at": 1796185063.2,
       "expected_join_s": 65.0, "basis": "measured: median of 3 launches", "replacements": ["i-0..."]}

  ``expected_join_s`` is null when no replacement is coming (no capacity) or the daemon has no
  estimate; no record at all (no daemon, or it has not got that far) means the same.
* **what a restart costs the run**: measured by the run at its own last (re)start
  (:mod:`trainer.restarts`: from the size decision to the first step trained).

The cost of each choice, from the moment the lost node is gone, in worker-seconds, with ``W`` the
seconds until the replacement is expected, ``R`` a restart, ``d`` the resize interval (Ray
Train looks for a joined node every ``elastic_resize_monitor_interval_s``), ``n`` the survivors::

    wait:    n * (W + R)  +  R              (n idle until the restart at full size ends; the new node idle during it)
    shrink:  n * R  +  d / 2  +  (n + 1) * R  (a restart now, the new node idle until the resize, the grow's restart)

so shrinking is cheaper exactly when ``W > R + d / (2 n)``: the survivors gain from shrinking only
when they train longer at the smaller size than the extra restart costs them.  When the
replacement is expected sooner, the run waits for it, **at most until the expected join plus one
restart** (``R``), and never more than ``max_wait_s``: a node later than that means the estimate
was wrong, and the run shrinks then (it has lost at most ``n * (W + R)`` worker-seconds to the
wrong estimate, the price of one more restart).  Without an estimate, or without a measured
restart, it shrinks at once (Ray Train's own behaviour).

This module imports neither Ray nor torch: the controller callback (``trainer.elastic``) reads the
KV and the clock, this decides.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: The GCS internal-KV namespace the daemon writes its replacement records to (resilienced's).
NAMESPACE = "resilienced"
#: Key prefix of a replacement record; the rest is the lost Ray node's hex id.
PREFIX = "replacement/"


def key(node_id: str) -> str:
    """The KV key of the replacement record for the lost Ray node ``node_id`` (hex)."""
    return f"{PREFIX}{node_id}"


@dataclass(frozen=True)
class Expected:
    """When the replacement of one lost node is expected to join (unix seconds; None: not coming)."""

    node_id: str
    at: float | None
    basis: str = ""

    @classmethod
    def parse(cls, node_id: str, raw: bytes | str | None) -> "Expected":
        """The record as the daemon wrote it; a missing or unreadable one expects nothing."""
        if raw is None:
            return cls(node_id, None, "no record from the daemon")
        try:
            data: Any = json.loads(raw)
            asked, join = data.get("asked_at"), data.get("expected_join_s")
        except (ValueError, AttributeError):
            return cls(node_id, None, "unreadable record")
        if join is None:
            return cls(node_id, None, str(data.get("basis") or "no replacement expected"))
        try:
            return cls(node_id, float(asked) + float(join), str(data.get("basis") or ""))
        except (TypeError, ValueError):
            return cls(node_id, None, "unreadable record")


@dataclass(frozen=True)
class Decision:
    """``wait_until`` (unix seconds) when the run waits for its replacement, None to shrink now."""

    wait_until: float | None
    reason: str
    expected_at: float | None = None

    @property
    def wait(self) -> bool:
        return self.wait_until is not None


def decide(*, now: float, expected: Iterable[Expected], restart_s: float | None, survivors: int,
           resize_interval_s: float, max_wait_s: float = 600.0) -> Decision:
    """Shrink now or wait for the replacement(s) of the lost node(s) (see the module docstring).

    ``now``: the lost nodes are gone (unix seconds); ``restart_s``: the run's last measured
    restart (None: none measured); ``survivors``: the workers left.
    """
    records = list(expected)
    if not records:
        return Decision(None, "no node was lost")
    missing = [r for r in records if r.at is None]
    if missing:
        return Decision(None, f"shrink now: no replacement expected for {missing[0].node_id[:12]} ({missing[0].basis})")
    if restart_s is None:
        return Decision(None, "shrink now: no restart of this run measured yet")
    expected_at = max(r.at for r in records if r.at is not None)
    w = expected_at - now
    breakeven = restart_s + resize_interval_s / (2 * max(survivors, 1))
    figures = (f"replacement expected in {w:.0f}s ({records[0].basis}), a restart costs {restart_s:.0f}s, "
               f"shrinking pays from {breakeven:.0f}s")
    if w > breakeven:
        return Decision(None, f"shrink now: {figures}", expected_at)
    until = min(expected_at + restart_s, now + max_wait_s)
    return Decision(until, f"wait for the replacement until {until - now:.0f}s from now: {figures}", expected_at)


def wait_for_replacement(*, until: float, room: Callable[[], bool], still_expected: Callable[[], bool],
                         clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                         poll_s: float = 0.5, recheck_s: float = 5.0) -> str:
    """Hold a restart until the replacement is there: ``"joined"`` once ``room()`` (the cluster
    holds the run's ``max`` workers again), ``"late"`` when ``until`` passes first (the estimate
    was wrong: shrink), ``"not coming"`` when ``still_expected()`` turns false (the daemon found no
    capacity after all; asked every ``recheck_s``)."""
    rechecked = clock()
    while clock() < until:
        if room():
            return "joined"
        if clock() - rechecked >= recheck_s:
            rechecked = clock()
            if not still_expected():
                return "not coming"
        sleep(min(poll_s, max(0.0, until - clock())))
    return "joined" if room() else "late"


__all__ = ["NAMESPACE", "PREFIX", "Decision", "Expected", "decide", "key", "wait_for_replacement"]
