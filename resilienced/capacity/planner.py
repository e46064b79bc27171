"""The capacity planner: gathers the decision's inputs, decides, and buys a block when told to.

:class:`CapacityPlanner` is the impure shell around :func:`~resilienced.capacity.decision.decide`:
it reads the active Capacity Blocks from the :class:`~resilienced.ports.CapacitySource`, the
pool's interruptions from the :class:`InterruptionHistory`, what is out of capacity from the
:class:`UnavailableCache`, and the clock; then it decides.  When buying is on and the decision
would be On-Demand or wait, it asks EC2 for offerings, decides again with them, and buys (or,
with ``purchase_dry_run``, asks EC2 whether it would buy) the chosen one.

A plan with ``dry_run=True`` (``replay --dry-run``) reads but never buys, not even as an EC2
dry run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter

from resilienced.capacity.decision import Pool, decide
from resilienced.capacity.history import InterruptionHistory, UnavailableCache
from resilienced.capacity.policy import CapacityPolicy
from resilienced.capacity.request import CapacityRequest
from resilienced.clock import utcnow
from resilienced.followup.rules import stalled_key
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, Kind, Target
from resilienced.ports import BlockMarket, CapacitySource

T = TypeVar("T")

#: Event kinds that count as an interruption of the pool the instance ran in.
INTERRUPTION_KINDS = frozenset({Kind.SPOT_INTERRUPTION})


def interruption_counter(registry: CollectorRegistry) -> Counter:
    """``resilienced_interruptions_total{instance_type, availability_zone}``: what the history counts."""
    return Counter("resilienced_interruptions", "Spot interruptions counted in the capacity "
                   "decision's history, per pool (instance type x Availability Zone).",
                   ["instance_type", "availability_zone"], registry=registry)


class CapacityPlanner:
    """Decides where runs go, from live inputs.

    Args:
        source: the reservations (``Ec2Capacity`` in production).  Buying needs its
            ``offerings`` and ``purchase`` methods too.
        policy: the knobs.
        history: interruptions per pool (one per process; see :mod:`.history`).
        unavailable: the ICE cache.
        clock: returns the current tz-aware time (tests pass a fixed one).
    """

    def __init__(
        self,
        *,
        source: CapacitySource,
        policy: CapacityPolicy,
        history: InterruptionHistory | None = None,
        unavailable: UnavailableCache | None = None,
        clock: Callable[[], datetime] = utcnow,
        interruptions: Counter | None = None,
    ) -> None:
        self.source = source
        self.interruptions = interruptions
        self.policy = policy
        self.history = history or InterruptionHistory(
            keep=max(policy.interruption_window, policy.spot_cooldown))
        self.unavailable = unavailable or UnavailableCache()
        self.clock = clock

    def observe(self, event: Event, pool: Pool) -> bool:
        """Count ``event`` against ``pool`` if it is an interruption (once per event id)."""
        if event.kind not in INTERRUPTION_KINDS:
            return False
        at = event.time or self.clock()
        counted = self.history.record(pool, at, event_id=event.event_id)
        if counted and self.interruptions is not None:
            self.interruptions.labels(instance_type=pool.instance_type,
                                      availability_zone=pool.availability_zone or "unknown").inc()
        return counted

    def mark_unavailable(self, pool: Pool, key: Capacity | str) -> None:
        """A provider answered "no capacity" for ``key`` (a capacity type or reservation id)."""
        self.unavailable.mark(pool, key.value if isinstance(key, Capacity) else key, now=self.clock())

    async def plan_for(self, target: Target, *, event: Event, dry_run: bool = False,
                       cache: dict[str, object] | None = None) -> tuple[CapacityRequest, CapacityDecision]:
        """Build the request for ``target`` under ``event``, count the interruption, decide.

        A dry run decides as if the interruption were counted but leaves the history as it was.
        ``cache``: EC2's answers (reservations, offerings) kept for further decisions of one plan.
        The one caller is ``resilienced.recovery.move.Mover`` (the move of a run has one owner).
        """
        return await self._decide(target, event=event, dry_run=dry_run, cache=cache)

    async def _decide(self, target: Target, *, event: Event, dry_run: bool,
                      cache: dict[str, object] | None) -> tuple[CapacityRequest, CapacityDecision]:
        request = CapacityRequest.from_target(target, event=event)
        if not dry_run:
            self.observe(event, request.pool)
        extra = self._uncounted(event, request.pool) if dry_run else ()
        kept = applied_decision(target, event=event)
        if kept is not None:
            return request, kept
        return request, await self.plan(request, dry_run=dry_run, extra_interruptions=extra, cache=cache)

    def _uncounted(self, event: Event, pool: Pool) -> tuple[datetime, ...]:
        """A dry run's interruption: ``event`` as if counted, when it is one the history lacks."""
        if event.kind in INTERRUPTION_KINDS and not self.history.seen(pool, event.event_id):
            return (event.time or self.clock(),)
        return ()

    async def target_plan(self, target: Target, *, event: Event) -> dict[str, JsonValue]:
        """``target.as_json()`` plus its ``capacity`` decision and ``reason``, and the ordered
        ``fallbacks`` a stalled recovery would try after it (:meth:`chain`): a target of the
        ``replay --dry-run --json`` plan.  Reads only; counts nothing, buys nothing."""
        cache: dict[str, object] = {}  # one read of EC2 for the decision and its chain
        _, decision = await self._decide(target, event=event, dry_run=True, cache=cache)
        out = target.as_json()
        out.update(decision.as_json())
        out["fallbacks"] = [{k: v for k, v in d.as_json().items() if k in ("capacity", "reservation_id", "reason")}
                            for d in await self.chain(target, event=event, first=decision, cache=cache)]
        return out

    async def fallback(self, target: Target, *, event: Event, dry_run: bool = False) -> CapacityDecision:
        """Where the run goes after its recovery stalled (``resilienced.recovery.move.Mover``, for the
        follow-up): the
        decision again for ``target``, whose ``facts.exclude`` names the stalled capacity (and any
        other in its cool-down).  No earlier move is kept.

        ``event`` is the notice the follow-up was opened for; it is counted once per event id, so
        not again by the replica that decided the first move, but by another replica that took the
        follow-up over: the history is per replica, and without it that replica's decision went
        back to the Spot pool that had just been interrupted (seen with two daemon processes on the
        real control plane, issue #40: the run fell back onto Spot, half its workers unschedulable,
        and had to be moved a third time)."""
        request = CapacityRequest.from_target(target, event=event)
        if not dry_run:
            self.observe(event, request.pool)
        return await self.plan(request, dry_run=dry_run, extra_interruptions=self._uncounted(event, request.pool)
                               if dry_run else ())

    async def decide_again(self, target: Target, *, event: Event, unavailable: str,
                           instance_count: int) -> CapacityDecision:
        """The decision after an applier found no capacity in ``unavailable`` (a capacity type or a
        reservation id), marked out for the run's pool in the ICE cache, for ``instance_count``
        instances (``ports.NoCapacity``; ``recovery.move.Mover`` asks).  A target whose request
        cannot be built (a fact missing) waits; a ``wait`` always carries its ``retry_after``."""
        try:
            request = CapacityRequest.from_target(target, event=event)
        except ValueError as e:
            return CapacityDecision(Capacity.WAIT, f"cannot decide again: {e}", retry_after=self.policy.wait_retry)
        self.mark_unavailable(request.pool, unavailable)
        decision = await self.plan(replace(request, instance_count=instance_count))
        if decision.capacity is Capacity.WAIT and decision.retry_after is None:
            decision = replace(decision, retry_after=self.policy.wait_retry)
        return decision

    async def chain(self, target: Target, *, event: Event, first: CapacityDecision, limit: int = 4,
                    cache: dict[str, object] | None = None) -> list[CapacityDecision]:
        """The fallbacks after ``first``, in the order a recovery that stalls on each would try
        them: each decided with every capacity before it passed over, until ``wait`` (dry run)."""
        out: list[CapacityDecision] = []
        exclude = list(target.facts.exclude)
        current = first
        for _ in range(limit):
            if not current.places:
                break
            exclude.append(stalled_key(current.capacity.value, current.reservation_id))
            passed = replace(target, facts=replace(target.facts, exclude=tuple(dict.fromkeys(exclude))))
            request = CapacityRequest.from_target(passed, event=event)
            current = await self.plan(request, dry_run=True, cache=cache,
                                      extra_interruptions=self._uncounted(event, request.pool))
            out.append(current)
        return out

    async def plan(self, request: CapacityRequest, *, dry_run: bool = False,
                   extra_interruptions: tuple[datetime, ...] = (),
                   cache: dict[str, object] | None = None) -> CapacityDecision:
        """Decide for ``request`` now (and buy a block if the policy says so and this is no dry run).

        ``cache``: where EC2's answers are kept for the next decision of the same plan (the
        fallback chain of a dry run); None: read each time.
        """
        now = self.clock()
        pool = request.pool
        reservations = await _kept(cache, "reservations", lambda: self.source.reservations(
            instance_type=pool.instance_type))
        unavailable = self.unavailable.unavailable(pool, now=now) | request.exclude
        interruptions = (*self.history.recent(pool, now=now), *extra_interruptions)

        def run(offerings=()) -> CapacityDecision:
            return decide(
                pool=pool, instance_count=request.instance_count, interruptions=interruptions,
                reservations=reservations, unavailable=unavailable, now=now,
                run_needs=request.run_needs, current_capacity=request.current_capacity,
                last_move=request.last_move, policy=self.policy,
                current_reservation_id=request.current_reservation_id, offerings=offerings,
                selectable=request.selectable, drain_lead=request.drain_lead, closed=request.closed)

        decision = run()
        if decision.capacity not in (Capacity.ON_DEMAND, Capacity.WAIT) or not self.policy.purchase_blocks:
            return decision
        market = self.source
        if not isinstance(market, BlockMarket):
            return replace(decision, reason=f"{decision.reason}; buying is on but the capacity "
                                            "source cannot buy")
        needed = request.run_needs or self.policy.min_block_time
        margin = max(self.policy.block_end_margin, request.drain_lead or timedelta(0))
        offerings = await _kept(cache, "offerings", lambda: market.offerings(
            instance_type=pool.instance_type, instance_count=request.instance_count,
            duration=needed + margin, start_after=now,
            start_before=now + self.policy.purchase_max_wait))
        with_offer = run(offerings)
        if with_offer.offering is None:
            return with_offer
        if dry_run:
            return replace(with_offer, reason=f"{with_offer.reason} (plan only: nothing bought)")
        assert self.policy.price_cap is not None  # validated: buying needs a cap
        bought = await market.purchase(
            with_offer.offering, platform=self.policy.purchase_platform,
            purchase_key=request.purchase_key or f"run/{request.run_key}",
            dry_run=self.policy.purchase_dry_run, price_cap=self.policy.price_cap,
            tags=self.policy.purchase_tag_map)
        if bought.dry_run or bought.reservation is None:
            return replace(decision, reason=f"{decision.reason}; {bought.message} (purchase_dry_run "
                                            "is on: nothing bought)",
                           details={**decision.details, "purchase_dry_run": with_offer.offering.offering_id})
        block = bought.reservation
        if block.state == "active" and (block.start is None or block.start <= now):
            return CapacityDecision(
                Capacity.CAPACITY_BLOCK, f"{with_offer.reason}; {bought.message}",
                reservation_id=block.reservation_id, details=with_offer.details)
        starts = block.start or now
        return CapacityDecision(
            Capacity.WAIT,
            f"{bought.message}; it is {block.state} and starts at {starts.isoformat()}: "
            "the run waits for it",
            retry_after=max(starts - now, self.policy.wait_retry),
            details={**with_offer.details, "bought_reservation_id": block.reservation_id})


async def _kept(cache: dict[str, object] | None, key: str, read: Callable[[], Awaitable[T]]) -> T:
    """``await read()``, once per ``cache`` (None: every time)."""
    if cache is None:
        return await read()
    if key not in cache:
        cache[key] = await read()
    return cache[key]  # what ``read`` gave for ``key``


def applied_decision(target: Target, *, event: Event) -> CapacityDecision | None:
    """The decision already applied to ``target``'s run for ``event``, when its objects record one.

    A replica that dies after its requeue and before its run claim is done leaves the event to
    another; that one's interruption history (per replica) can differ, and deciding again could
    move the gang a second time, onto other capacity (found by the reliability campaign,
    docs/reliability.md).  The requeue already applied for this event is kept instead; the
    requeuer then finds the run in place and changes nothing.  Elastic runs keep their own
    per-worker record (``resilienced.io/elastic-replaced``) and are decided as usual.
    """
    facts = target.facts
    if not event.event_id or facts.elastic is True or facts.requeued_for != event.event_id:
        return None
    try:
        capacity = Capacity(facts.requeued_capacity)
    except ValueError:
        return None
    reservation = facts.requeued_reservation_id if capacity is Capacity.CAPACITY_BLOCK else None
    if capacity is Capacity.WAIT or (capacity is Capacity.CAPACITY_BLOCK and not reservation):
        return None
    where = f"{capacity.value} {reservation}" if reservation else capacity.value
    return CapacityDecision(
        capacity=capacity, reservation_id=reservation, details={"kept": True},
        reason=f"already requeued onto {where} for event {event.event_id} by an earlier delivery: kept, "
               "not decided again")

