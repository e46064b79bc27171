"""Stand-ins for ports, in one place: stores that keep their state in the process, and adapters
that only read.

* :class:`MemoryClaims`: a ``ports.ClaimStore`` in a dict, correct for one replica (plan mode, the
  demo, unit tests); the cross-replica stores are ``kube.leases`` (Leases) and ``ray.claims`` (the
  GCS KV).
* :class:`MemoryFollowUps`: a ``ports.FollowUpStore`` in a dict (unit tests: plan mode follows
  nothing up); the daemon's stores are ``kube.followup_store`` (Leases) and ``ray.followup_store``
  (the GCS KV).  Records are JSON-able dicts, versioned by a counter: :meth:`MemoryFollowUps.put`
  writes only on the version it was given (compare-and-set).
* :class:`ReadOnlyRay` and :class:`ReadOnlyCapacity`: what ``replay`` wraps the Ray and EC2
  adapters in, so that a dry run cannot act: ``drain`` and ``purchase`` refuse.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, NoReturn

from resilienced.errors import BackendUnavailable, PermanentError, ResilienceError
from resilienced.model import CapacityOffering, JsonValue
from resilienced.ports import CapacityReservation, Claim, DrainResult, RayNode

if TYPE_CHECKING:  # imported where it is built (its dependencies load on use)
    from resilienced.capacity.ec2 import Ec2Capacity
    from resilienced.ray.gcs import RayGcs


# --------------------------------------------------------------------------- in memory
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

    async def complete(self, key: str, *, holder: str, details: Mapping[str, JsonValue]) -> None:
        current = self._live(key, self._clock())
        if current is not None and (current.state == "done" or current.holder != holder):
            return  # done already, or taken over after our TTL ran out: the new holder decides
        self._claims[key] = (Claim(key=key, holder=holder, state="done", details=dict(details)),
                             self._clock() + self._done_ttl)

    async def release(self, key: str, *, holder: str) -> None:
        current = self._live(key, self._clock())
        if current is not None and current.holder == holder and current.state == "held":
            del self._claims[key]

    async def done(self, prefix: str = "") -> list[Claim]:
        now = self._clock()
        return [c for c in (self._live(k, now) for k in sorted(self._claims) if k.startswith(prefix))
                if c is not None and c.state == "done"]

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


class MemoryFollowUps:
    """``ports.FollowUpStore`` in a dict (correct for one process; forgotten on restart)."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[dict[str, JsonValue], int]] = {}

    async def get(self, run: str) -> tuple[dict[str, JsonValue], str] | None:
        entry = self._records.get(run)
        return None if entry is None else (copy.deepcopy(entry[0]), str(entry[1]))

    async def put(self, run: str, record: Mapping[str, JsonValue], *, version: str | None) -> str | None:
        entry = self._records.get(run)
        current = None if entry is None else str(entry[1])
        if current != version:
            return None
        number = (entry[1] if entry is not None else 0) + 1
        self._records[run] = (json.loads(json.dumps(dict(record), default=str)), number)
        return str(number)

    async def all(self) -> list[tuple[dict[str, JsonValue], str]]:
        return [(copy.deepcopy(record), str(number)) for record, number in self._records.values()]

    async def delete(self, run: str, *, version: str) -> bool:
        entry = self._records.get(run)
        if entry is None or str(entry[1]) != version:
            return False
        del self._records[run]
        return True


# --------------------------------------------------------------------------- read only (replay)
class ReadOnlyRay:
    """A Ray cluster's GCS for replay: node listings only; ``drain`` refuses.

    ``errors`` (kubernetes mode): when given, a GCS that does not answer is recorded there by
    address and its node list taken as empty, so the run's targets still come out (without
    ``ray_node_ids``); otherwise the error is raised.  ``timeout_s`` bounds one listing.
    """

    def __init__(self, inner: RayGcs, *, timeout_s: float, errors: dict[str, str] | None = None) -> None:
        self._inner = inner
        self._timeout_s = timeout_s
        self._errors = errors

    @property
    def address(self) -> str | None:
        return getattr(self._inner, "address", None)

    async def nodes(self) -> list[RayNode]:
        try:
            async with asyncio.timeout(self._timeout_s):
                nodes = await self._inner.nodes()
        except TimeoutError:
            error: BackendUnavailable = BackendUnavailable(
                "ray-gcs", f"{self.address}: no node list within {self._timeout_s:g}s")
        except BackendUnavailable as e:
            error = e
        else:
            if self._errors is not None:
                self._errors.pop(self.address or "", None)
            return nodes
        if self._errors is None:
            raise error
        self._errors[self.address or ""] = str(error)
        return []

    async def ping(self) -> str:
        """Connect once (token and Ray version checked); BackendUnavailable when it does not answer."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._inner.ping()
        except TimeoutError:
            raise BackendUnavailable("ray-gcs", f"{self.address}: no answer within {self._timeout_s:g}s") from None

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        raise PermanentError(f"replay only reads: it does not drain Ray node {node_id}")


class ReadOnlyCapacity:
    """The capacity source of replay's decisions: Describe* only; ``purchase`` refuses.

    ``inner`` is ``Ec2Capacity`` when a region is configured, else None with ``missing`` saying
    why (no Capacity Blocks are known then).  A reservation listing that fails is taken as
    empty; every such gap is appended to :attr:`notes`, which the caller adds to the decision's
    reason.
    """

    def __init__(self, inner: Ec2Capacity | None, *, missing: str = "no EC2") -> None:
        self._inner = inner
        self.missing = missing
        self.notes: list[str] = []

    async def reservations(self, *, instance_type: str | None = None) -> list[CapacityReservation]:
        if self._inner is None:
            self.notes.append(f"{self.missing}: decided with no Capacity Blocks known")
            return []
        try:
            return await self._inner.reservations(instance_type=instance_type)
        except ResilienceError as e:
            self.notes.append(f"EC2 did not answer ({e}): decided with no Capacity Blocks known")
            return []

    async def reservation_instances(self, *, reservation_id: str) -> list[str]:
        if self._inner is None:
            raise PermanentError(self.missing)
        return await self._inner.reservation_instances(reservation_id=reservation_id)

    async def offerings(self, *, instance_type: str, instance_count: int, duration: timedelta,
                        start_after: datetime, start_before: datetime) -> list[CapacityOffering]:
        if self._inner is None:
            self.notes.append(f"{self.missing}: no Capacity Block offerings known")
            return []
        try:
            return await self._inner.offerings(instance_type=instance_type, instance_count=instance_count,
                                               duration=duration, start_after=start_after,
                                               start_before=start_before)
        except ResilienceError as e:
            self.notes.append(f"EC2 did not answer ({e}): no Capacity Block offerings known")
            return []

    async def purchase(self, offering: CapacityOffering, **_: object) -> NoReturn:
        raise PermanentError(f"replay only reads: it does not buy {offering.offering_id}")
