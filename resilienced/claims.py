"""The claim lifecycle: :func:`held_claim` (the in-memory store is ``resilienced.doubles.MemoryClaims``).

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

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

from resilienced.errors import ResilienceError, TemporaryError
from resilienced.log import Logger
from resilienced.model import JsonValue, Outcome, Plan, Result
from resilienced.ports import Claim, ClaimStore


# --------------------------------------------------------------------------- one claim lifecycle
class ClaimLost(TemporaryError):
    """The holder lost its claim while working (taken over, or not renewed for a whole TTL): it
    takes no further step and leaves the work to the claim's holder (retry after one TTL)."""

    def __init__(self, key: str, why: str, *, ttl: float) -> None:
        super().__init__(f"claim {key} lost: {why}; its holder finishes the run", delay=ttl)
        self.key = key
        self.why = why


class HeldClaim:
    """A claim held while its work runs (what :func:`held_claim` yields).

    Renewed every third of its TTL by a task beside the work; :attr:`lost` says why it was lost
    (None while held).  :meth:`complete` and :meth:`release` first stop the renewals and wait for
    one in flight, so no renewal lands after them (ray mode's GCS KV has no compare-and-set: a
    late renewal would turn a done claim back into a held one, issue #14).
    """

    def __init__(self, store: ClaimStore, key: str, *, holder: str, ttl: float, logger: Logger,
                 what: str) -> None:
        self.key, self.holder, self.ttl = key, holder, ttl
        self.lost: str | None = None
        self._store, self._log, self._what = store, logger, what
        self._stop = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._settled = False  # completed or released (or tried to): never released again

    def check(self) -> None:
        """Raise :class:`ClaimLost` when the claim was lost (call it before each step)."""
        if self.lost is not None:
            raise ClaimLost(self.key, self.lost, ttl=self.ttl)

    async def complete(self, details: Mapping[str, JsonValue]) -> None:
        """Stop renewing, then mark the claim done; :class:`ClaimLost` when it was lost."""
        await self.stop_renewing()
        self.check()
        self._settled = True
        await self._store.complete(self.key, holder=self.holder, details=details)

    async def release(self) -> None:
        """Stop renewing, then free the claim (the store leaves a claim taken over alone)."""
        await self.stop_renewing()
        self._settled = True
        await self._store.release(self.key, holder=self.holder)

    async def stop_renewing(self) -> None:
        """Renew no more; a renewal in flight is waited for, never cut off mid-request."""
        self._stop.set()
        renewer = self._renewer
        if renewer is None or renewer.done():
            return
        try:
            await asyncio.shield(renewer)
        except asyncio.CancelledError:  # our caller is cancelled: the renewal still lands first
            await asyncio.wait({renewer})
            raise

    def _start(self) -> None:
        self._renewer = asyncio.get_running_loop().create_task(
            self._renew_until_stopped(), name=f"resilienced.claim-renewal[{self.key}]")

    async def _renew_until_stopped(self) -> None:
        """Every ttl/3 renew (an acquire by the holder) until stopped or lost."""
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            try:
                async with asyncio.timeout(self.ttl / 3):
                    await self._stop.wait()
                return
            except TimeoutError:
                pass
            try:
                claim = await self._store.acquire(self.key, holder=self.holder, ttl_seconds=self.ttl)
            except Exception as e:  # noqa: BLE001 - any failure is a renewal that did not happen
                self._failed(e)
                if loop.time() - renewed >= self.ttl:
                    self._lose(f"not renewed for {self.ttl:g}s ({e})")
                    return
                continue
            if claim is None:
                try:
                    current = await self._store.get(self.key)
                except ResilienceError:  # only for the reason's detail
                    current = None
                self._lose(f"taken over by {current.holder}" if current is not None else "no longer held")
                return
            renewed = loop.time()

    def _failed(self, error: Exception) -> None:
        if isinstance(error, ResilienceError):
            self._log.warning(f"{self._what} renewal failed", key=self.key, error=str(error))
        else:  # a bug: said loudly, and the claim is lost after a TTL of them like any failure
            self._log.error(f"{self._what} renewal failed", key=self.key,
                            error=f"{type(error).__name__}: {error}", exc_info=error)

    def _lose(self, why: str) -> None:
        self.lost = why
        self._log.warning(f"{self._what} lost", key=self.key, reason=why)

    async def _end(self, *, release: bool) -> None:
        """Leaving the block unsettled: stop renewing; release the claim when ``release``."""
        await self.stop_renewing()
        if self._settled or not release:
            return
        self._settled = True
        try:
            await asyncio.shield(self._store.release(self.key, holder=self.holder))
        except ResilienceError as e:  # it lapses within its TTL
            self._log.warning(f"{self._what} release failed", key=self.key, error=str(e))


@contextlib.asynccontextmanager
async def held_claim(store: ClaimStore, key: str, *, holder: str, ttl_seconds: float, logger: Logger,
                     what: str = "claim", release_on_cancel: bool = True) -> AsyncIterator[HeldClaim | None]:
    """Acquire ``key`` for ``holder`` and hold it for the block: the one claim lifecycle
    (acquire -> renew every ttl/3 -> lost -> complete / release) of event, run and move claims.

    Yields None when the claim is not free (another live holder has it, or it is done; the
    caller asks ``store.get`` why), else a :class:`HeldClaim`, renewed beside the work until the
    block settles it (:meth:`HeldClaim.complete` or :meth:`HeldClaim.release`) or ends.  Lost
    (:attr:`HeldClaim.lost`, logged ``"<what> lost"``): a renewal found it taken over, or none
    succeeded for a whole TTL.  A block that ends unsettled, normally or by an error, releases
    the claim; a cancelled one too unless ``release_on_cancel`` is False (a move stopped midway:
    nobody moves the run until the TTL ran out, while its writes may still be in flight).  A
    failed acquire raises the store's error.
    """
    if await store.acquire(key, holder=holder, ttl_seconds=ttl_seconds) is None:
        yield None
        return
    held = HeldClaim(store, key, holder=holder, ttl=ttl_seconds, logger=logger, what=what)
    held._start()
    try:
        yield held
    except asyncio.CancelledError:
        await held._end(release=release_on_cancel)
        raise
    except BaseException:
        await held._end(release=True)
        raise
    await held._end(release=True)


# --------------------------------------------------------------------------- an event's claim not free
def not_free(plan: Plan, existing: Claim | None, *, holder: str, what: str, held_delay: float) -> Outcome:
    """The outcome of a delivery (``holder``, ``<replica>/<message id>``) that found the claim of its
    event (``what``: "the event", or "the event's run" where the run claim stands for it) not free:
    one rule for the consumer's event claim and the recovery's run claim (issue #45).

    - freed between the try and the look: retried at once;
    - done: a ``duplicate``;
    - held by an earlier delivery of this very message (its visibility ran out while it works):
      kept, retried after ``held_delay``, never deleted, so a slow or dead holder cannot make its
      event vanish;
    - held by another delivery: a ``duplicate`` (deleted: the holder's own message stays on the
      queue until the holder finishes, and comes back if it fails).
    """
    event = plan.event
    if existing is None:
        return Outcome(result=Result.RETRY, event=event, plan=plan, retry_delay=0,
                       reason="claim changed hands while checking it")
    if existing.state == "done":
        return Outcome(result=Result.DUPLICATE, event=event, plan=plan,
                       reason=f"event {event.event_id} already handled by {existing.holder}")
    if existing.holder.rsplit("/", 1)[-1] == holder.rsplit("/", 1)[-1]:
        return Outcome(result=Result.RETRY, event=event, plan=plan, retry_delay=held_delay,
                       reason=f"an earlier delivery of this message ({existing.holder}) still holds {what}")
    return Outcome(result=Result.DUPLICATE, event=event, plan=plan,
                   reason=f"event {event.event_id} is being handled by {existing.holder}; its message stays "
                          "on the queue until that finishes")
