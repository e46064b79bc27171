"""In-process idempotency: :class:`MemoryClaims`, a ClaimStore for one replica.

A claim is keyed by event id (or ``run/...``, ``move/...``).  Its holder acquires it before
acting, renews it while acting, completes it when done, and releases it when the work failed
temporarily or was interrupted: :func:`held_claim` runs that lifecycle for every user (the
consumer's event claims, the recovery's run claims, the follow-up's move claims).  The rules
are the :class:`~resilienced.ports.ClaimStore` contract (its docstring), which the
cross-replica stores (Kubernetes Lease, Ray GCS KV) keep too:

- free, or held past its TTL (the holder died): taken;
- held by the same holder: renewed (TTL restarted) and returned;
- held by another live holder, or done and remembered: ``None``.

Done claims are remembered for ``done_ttl_seconds`` (the dedupe window), so a duplicate
delivered within it is acknowledged without acting again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from resilienced.ports import Claim


class MemoryClaims:
    """A ClaimStore in a dict: correct for one replica, forgotten on restart."""

    def __init__(self, *, done_ttl_seconds: float = 86400.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._done_ttl = done_ttl_seconds
        self._clock = clock
        self._claims: dict[str, tuple[Claim, float]] = {}  # key -> (claim, expires at)
        self._next_prune = 0.0

    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Claim | None:
        now = self._clock()
        self._prune(now)
        current = self._live(key, now)
        if current is not None and (current.state == "done" or current.holder != holder):
            return None
        claim = Claim(key=key, holder=holder, state="held")
        self._claims[key] = (claim, now + ttl_seconds)
        return claim

    async def get(self, key: str) -> Claim | None:
        return self._live(key, self._clock())

    async def complete(self, key: str, *, holder: str, details: Mapping[str, Any]) -> None:
        current = self._live(key, self._clock())
        if current is not None and (current.state == "done" or current.holder != holder):
            return  # done already, or taken over after our TTL ran out: the new holder decides
        self._claims[key] = (Claim(key=key, holder=holder, state="done", details=dict(details)),
                             self._clock() + self._done_ttl)

    async def release(self, key: str, *, holder: str) -> None:
        current = self._live(key, self._clock())
        if current is not None and current.holder == holder and current.state == "held":
            del self._claims[key]

    def count(self) -> int:
        """Claims in memory, live or not yet pruned (not ``__len__``: an empty store is not falsy)."""
        return len(self._claims)

    def _live(self, key: str, now: float) -> Claim | None:
        entry = self._claims.get(key)
        if entry is None:
            return None
        claim, expires = entry
        if expires <= now:
            del self._claims[key]
            return None
        return claim

    def _prune(self, now: float) -> None:
        """Drop expired claims, at most once a minute (keeps memory bounded by the window)."""
        if now < self._next_prune:
            return
        self._next_prune = now + 60.0
        for key in [k for k, (_, expires) in self._claims.items() if expires <= now]:
            del self._claims[key]
