"""What the capacity decision remembers: interruptions per pool, and pools with no capacity.

Both are in-memory and per process.  **Each replica keeps its own**: with two replicas
consuming one queue, each sees only the interruptions it handled, so a pool's count can be
split between them (a threshold of 2 may need 3-4 interruptions to trip on one replica).  That
errs towards staying on Spot, never towards wrongly leaving it.  A shared history is a small
step when it is wanted: the interruptions are already visible cluster-wide as the Kubernetes
Events resilienced records (reason ``SpotInterruption`` on the run), and the claim store
(a Kubernetes Lease / the Ray GCS KV) can hold one small record per pool
(``capacity/<instance-type>/<az>`` -> recent timestamps); :class:`InterruptionHistory` would then
be loaded from and appended to it.  Not done here; see docs/requeue.md.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from datetime import datetime, timedelta

from resilienced.capacity.decision import Pool


def _aware(name: str, value: datetime) -> None:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")


class InterruptionHistory:
    """A sliding window of interruption times per pool (instance type x AZ).

    ``record`` is idempotent per event id: a redelivered or duplicated event is counted once.
    Entries older than ``keep`` are dropped as new ones arrive (and on ``recent``).

    Args:
        keep: how long an interruption is remembered; at least the policy's
            ``interruption_window`` and ``spot_cooldown``, whichever is longer.
        max_per_pool: a bound on memory per pool (the oldest go first).
    """

    def __init__(self, *, keep: timedelta = timedelta(hours=6), max_per_pool: int = 1000) -> None:
        if keep <= timedelta(0):
            raise ValueError(f"keep must be a positive duration, got {keep}")
        if max_per_pool < 1:
            raise ValueError(f"max_per_pool must be >= 1, got {max_per_pool}")
        self._keep = keep
        self._max = max_per_pool
        self._by_pool: dict[Pool, deque[tuple[datetime, str | None]]] = {}
        self._seen: dict[Pool, set[str]] = {}
        self._lock = threading.Lock()

    def record(self, pool: Pool, at: datetime, *, event_id: str | None = None) -> bool:
        """Remember one interruption of ``pool`` at ``at``; False when ``event_id`` was seen."""
        _aware("at", at)
        with self._lock:
            seen = self._seen.setdefault(pool, set())
            if event_id is not None and event_id in seen:
                return False
            entries = self._by_pool.setdefault(pool, deque())
            entries.append((at, event_id))
            if event_id is not None:
                seen.add(event_id)
            while len(entries) > self._max:
                _, old_id = entries.popleft()
                seen.discard(old_id)
            self._prune(pool, newest=max(t for t, _ in entries))
            return True

    def seen(self, pool: Pool, event_id: str | None) -> bool:
        """Whether the interruption ``event_id`` of ``pool`` is already counted."""
        with self._lock:
            return event_id is not None and event_id in self._seen.get(pool, ())

    def recent(self, pool: Pool, *, now: datetime, window: timedelta | None = None) -> tuple[datetime, ...]:
        """Interruption times of ``pool`` within ``window`` (default: everything kept) before ``now``."""
        _aware("now", now)
        window = self._keep if window is None else window
        with self._lock:
            self._prune(pool, newest=now)
            return tuple(sorted(t for t, _ in self._by_pool.get(pool, ()) if now - window < t <= now))

    def pools(self) -> Iterable[Pool]:
        with self._lock:
            return tuple(self._by_pool)

    def _prune(self, pool: Pool, *, newest: datetime) -> None:
        entries = self._by_pool.get(pool)
        if not entries:
            return
        cutoff = newest - self._keep
        kept = deque(sorted((e for e in entries if e[0] > cutoff), key=lambda e: e[0]))
        dropped = {eid for t, eid in entries if t <= cutoff and eid is not None}
        self._by_pool[pool] = kept
        self._seen[pool] -= dropped


class UnavailableCache:
    """Capacity known to be out (insufficient capacity), for a while: an ICE cache.

    A provider that answered "no capacity" for Spot in a pool, or a block that turned out full,
    is marked here and left out of the decision until the entry expires (default 3 min, as
    Karpenter's ICE cache: capacity comes back in minutes).  Keys are capacity type names
    (``"spot"``, ``"on-demand"``, ``"capacity-block"``) or reservation ids, per pool.
    """

    def __init__(self, *, ttl: timedelta = timedelta(minutes=3)) -> None:
        if ttl <= timedelta(0):
            raise ValueError(f"ttl must be a positive duration, got {ttl}")
        self._ttl = ttl
        self._until: dict[tuple[Pool, str], datetime] = {}
        self._lock = threading.Lock()

    def mark(self, pool: Pool, key: str, *, now: datetime) -> None:
        """``key`` (capacity type or reservation id) has no capacity in ``pool`` as of ``now``."""
        _aware("now", now)
        if not key:
            raise ValueError("key must name a capacity type or a reservation id")
        with self._lock:
            self._until[(pool, key)] = now + self._ttl

    def unavailable(self, pool: Pool, *, now: datetime) -> frozenset[str]:
        """What is out in ``pool`` at ``now`` (pool-less AZ entries match every AZ of the type)."""
        _aware("now", now)
        with self._lock:
            for k in [k for k, until in self._until.items() if until <= now]:
                del self._until[k]
            return frozenset(
                key for (p, key) in self._until
                if p.instance_type == pool.instance_type
                and (p.availability_zone in (None, pool.availability_zone))
            )
