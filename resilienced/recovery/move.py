"""Moving a run: the one owner of deciding where it goes and of applying it, in both modes.

The first requeue of a notice (``Recovery``) and every fallback of its follow-up (``Follower``)
move the run through :class:`Mover`, and nothing else asks the planner for a run's capacity
(``Planner.plan_for`` / ``Planner.fallback`` / ``Planner.decide_again`` have this one caller):

* :meth:`Mover.moving` takes the run's move claim ``move/<run>`` (never two moves of one run at
  once; a replica killed mid-move leaves it to expire before another goes on);
* :meth:`Mover.move` (the first move): the exclusions (what stalled an earlier recovery of the
  run, in its cool-down) passed over, the decision (``plan_for``), applied through the
  ``Requeuer``, and an elastic run's replacement announced through the ``Replacements`` port;
* :meth:`Mover.fallback` decides the next capacity after a stall (``Planner.fallback``), which the
  follow-up records as decided before :meth:`Mover.apply` makes it (withdrawing what the stalled
  capacity was asked for first, ``ports.Withdraws``), so a replica killed mid-move is taken over and
  the run is moved once;
* :meth:`Mover.apply`: when the applier finds no capacity in the decided pool
  (``ports.NoCapacity``: ray mode's node provider), the pool is marked out and the decision is
  made again (``Planner.decide_again``), Spot -> Capacity Block -> On-Demand, until a pool places
  the run or the decision is ``wait`` (nothing held; an elastic run keeps what it got).

Appliers only apply (``requeue.router.RequeueRouter`` and its Kueue, KubeRay and Volcano
requeuers; ``ray.requeue.RayModeRequeuer``); the planner only decides.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from datetime import datetime

from resilienced import log
from resilienced.claims import HeldClaim, held_claim
from resilienced.clock import utcnow
from resilienced.errors import ResilienceError
from resilienced.followup.rules import FollowUp, unusable_now
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.ports import ClaimStore, FollowUpStore, NoCapacity, Planner, Replacements, Requeuer, Withdraws

#: Decisions an application tries before it waits (Spot, a block, another block, On-Demand).
MAX_ATTEMPTS = 4


@dataclass(frozen=True)
class Moved:
    """What one move did: the requeue's result and, for an elastic run, the replacement announced."""

    result: RequeueResult
    replacement: dict[str, JsonValue] | None = None


@dataclass
class _Tries:
    """The pools that had no capacity during one application, and what an elastic run kept."""

    tried: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


class Mover:
    """Decides and applies the moves of runs (see the module docstring).

    Args:
        planner: the capacity decision.  requeue: the applier (``ReportingRequeuer``).
        claims: the move claims (the run claims' store); None: moves are not claimed (no follow-up).
        follow_ups: the follow-up records, whose cool-downs a first move passes over (None: none).
        replacements: where an elastic run's replacement is announced (None: nowhere).
        claim_ttl_s: the move claim's TTL when the caller gives none.
        max_attempts: decisions one application tries before it waits.
    """

    def __init__(self, *, planner: Planner, requeue: Requeuer, claims: ClaimStore | None = None,
                 follow_ups: FollowUpStore | None = None, replacements: Replacements | None = None,
                 claim_ttl_s: float = 60.0, max_attempts: int = MAX_ATTEMPTS,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.planner, self.requeue, self.claims, self.follow_ups = planner, requeue, claims, follow_ups
        self.replacements = replacements
        self.claim_ttl_s, self.max_attempts, self.clock = claim_ttl_s, max_attempts, clock
        self._log = log.get("resilienced.followup")
        self._recovery_log = log.get("resilienced.recovery")

    @property
    def kind(self) -> str:
        """The applier's kind (``kubernetes`` or ``ray``): which follow-up stages a move has."""
        return self.requeue.kind

    # ------------------------------------------------------------------ the move claim
    @staticmethod
    def move_key(run: str) -> str:
        return f"move/{run}"

    @contextlib.asynccontextmanager
    async def moving(self, run: str, *, holder: str, ttl: float | None = None) -> AsyncIterator[HeldClaim | None]:
        """Hold the run's move claim for the block (yields None when another replica holds it).

        ``claims.held_claim``: renewed every third of ``ttl`` while held (default ``claim_ttl_s``);
        released at the end, also after a failure, but not when the holder is cancelled (a replica
        stopped mid-move: nobody moves the run until the TTL ran out, while that move may still be
        in flight).
        """
        if self.claims is None:
            raise RuntimeError("Mover.moving needs a claim store (the follow-up's)")
        async with held_claim(self.claims, self.move_key(run), holder=holder, logger=self._log,
                              ttl_seconds=ttl or self.claim_ttl_s, what="move claim",
                              release_on_cancel=False) as held:
            yield held

    # ------------------------------------------------------------------ the first move
    async def move(self, target: Target, *, event: Event) -> Moved:
        """The first move after a notice (call it holding the move claim, when following): the
        exclusions passed over, decided, applied, an elastic replacement announced."""
        exclude = await self.exclusions(target.run_key)
        if exclude:  # what stalled an earlier recovery of this run, in its cool-down
            target = replace(target, facts=replace(target.facts, exclude=tuple(dict.fromkeys(
                [*target.facts.exclude, *exclude]))))
        _request, decision = await self.planner.plan_for(target, event=event)
        result = await self.apply(target, decision=decision, event=event)
        return Moved(result=result, replacement=await self._announce(target, result))

    # ------------------------------------------------------------------ a fallback
    async def fallback(self, target: Target, *, event: Event) -> CapacityDecision:
        """Where the run goes after its recovery stalled (``target.facts.exclude`` names what
        stalled); the follow-up records it as decided, then :meth:`apply` makes it."""
        return await self.planner.fallback(target, event=event)

    async def apply(self, target: Target, *, decision: CapacityDecision, event: Event,
                    withdraw: tuple[Capacity, str | None] | None = None) -> RequeueResult:
        """Apply ``decision``; on ``NoCapacity`` decide again, at most ``max_attempts`` decisions.

        ``withdraw``: the capacity (and reservation) the run was moved to before and is moved away
        from now; what was asked of it and never came is given back first (``ports.Withdraws``).
        """
        if withdraw is not None and isinstance(self.requeue, Withdraws):
            await self.requeue.withdraw(target, capacity=withdraw[0], reservation_id=withdraw[1])
        tries = _Tries()
        current = decision
        for _ in range(self.max_attempts):
            try:
                result = await self.requeue.requeue(target, decision=current, event=event)
            except NoCapacity as e:
                tries.tried.append(f"{current.capacity.value} gave {e.given} of {e.asked}"
                                   + (f" ({e.cause})" if e.cause else ""))
                tries.kept += e.changes
                current = await self.planner.decide_again(
                    target, event=event, unavailable=current.reservation_id or current.capacity.value,
                    instance_count=e.still_missing)
                continue
            return _with_tries(result, tries)
        # every attempt found no capacity: wait with what the last decision said
        waiting = CapacityDecision(Capacity.WAIT, f"{self.max_attempts} decisions tried: {current.reason}",
                                   retry_after=current.retry_after)
        return _with_tries(await self.requeue.requeue(target, decision=waiting, event=event), tries)

    # ------------------------------------------------------------------ helpers
    async def exclusions(self, run: str) -> tuple[str, ...]:
        """The capacity that stalled a recovery of ``run`` and is still in its cool-down."""
        if self.follow_ups is None:
            return ()
        return unusable_now(await read_follow_up(self.follow_ups, run, logger=self._log), now=self.clock())

    async def _announce(self, target: Target, result: RequeueResult) -> dict[str, JsonValue] | None:
        """An elastic run: write when its replacement is expected, for the run to decide whether to
        shrink or wait; None when there is nothing to write or it cannot be written (the run then
        shrinks at once, as without the record)."""
        if self.replacements is None:
            return None
        try:
            return await self.replacements.announce(target, result)
        except ResilienceError as e:
            self._recovery_log.warning("could not announce the replacement", run=target.run_key, error=str(e))
            return None


async def read_follow_up(store: FollowUpStore, run: str, *, logger: log.Logger) -> FollowUp | None:
    """The run's follow-up record, or None (none, or unreadable: said in the log; the run is moved
    all the same, but a follow-up opened for it finds the unreadable record in its place and is
    not written: the stores do not hand back an unreadable record's version yet)."""
    found = await store.get(run)
    if found is None:
        return None
    try:
        return FollowUp.from_json(found[0], version=found[1])
    except ValueError as e:
        logger.warning("follow-up record unreadable", run=run, error=str(e))
        return None


def _with_tries(result: RequeueResult, tries: _Tries) -> RequeueResult:
    """``result`` with the pools tried before it in its reason and details, and what was kept."""
    if not tries.tried:
        return result
    tried = "; ".join(tries.tried)
    reason = f"{tried}; {result.reason}" if result.capacity is Capacity.WAIT else f"{tried}; then {result.reason}"
    return replace(result, reason=reason, changes=(*tries.kept, *result.changes),
                   details={**result.details, "tried": list(tries.tried)})
