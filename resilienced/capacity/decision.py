"""The capacity decision: where a requeued run goes.  A pure function, tested as a table.

:func:`decide` takes what is known right now (the run's pool and size, the pool's recent
interruptions, the active Capacity Blocks, what is known to have no capacity, where the run is
and since when, the policy) and returns a :class:`CapacityDecision`: ``spot``,
``capacity-block`` (with the reservation id, or an offering to buy), ``on-demand`` or ``wait``,
with a reason a person can read on the decision line.

The order of preference::

    Spot          healthy: fewer than `interruption_threshold` interruptions of the pool within
                  `interruption_window`, not known to be out of capacity, and, for a run that was
                  moved off Spot, `spot_cooldown` passed since that move with no interruption in it
    Capacity Block  an active `capacity-block` reservation for the instance type (and AZ) with
                  enough available instances that does not end within the run's needs
                  (never one inside its last `block_end_margin`); `prefer_blocks` puts it first.
                  Where Karpenter's EC2NodeClasses are known (`selectable`), only a block one
                  of them lists in status.capacityReservations: Karpenter launches into no other
    purchase      (only with `purchase_blocks`) an offering within `price_cap` that starts within
                  `purchase_max_wait` and covers the run's needs
    On-Demand     if `allow_on_demand` and not known to be out of capacity
    Spot again    when Spot was passed over only for the cool-down: better than waiting
    wait          nothing above: leave the run where it is and try again after `wait_retry`

Nothing here does I/O or reads a clock: ``now`` is an argument.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from resilienced.capacity.policy import CapacityPolicy
from resilienced.model import Capacity, CapacityDecision, CapacityOffering, JsonValue
from resilienced.ports import CapacityReservation

#: ``CapacityReservation.reservation_type`` of a Capacity Block.
CAPACITY_BLOCK_TYPE = "capacity-block"
#: The only reservation state whose instances can be launched into.
ACTIVE = "active"


#: Capacity types that place a run (everything but ``wait``).
PLACEMENTS = (Capacity.SPOT, Capacity.CAPACITY_BLOCK, Capacity.ON_DEMAND)
#: How long before a Capacity Block's end Karpenter drains its nodes: the block is ``expiring``
#: from then on (aws/karpenter-provider-aws v1.6+, v1.14.1 ``pkg/apis/v1/ec2nodeclass_status.go``
#: ``capacityReservationExpirationPeriod``), and the capacity reservation expiration controller,
#: polling every minute, deletes the NodeClaims of an expiring block
#: (``pkg/controllers/capacityreservation/expiration/controller.go``); Karpenter launches into it no
#: more (``reserved_capacity_resolver.go``: an expiring reservation's offering is unavailable).
#: EC2 itself starts terminating 30 min before the end.
KARPENTER_BLOCK_DRAIN = timedelta(minutes=40)


@dataclass(frozen=True)
class Pool:
    """An EC2 capacity pool: instance type x Availability Zone (None: AZ not known)."""

    instance_type: str
    availability_zone: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.instance_type, str) or not self.instance_type.strip():
            raise ValueError(f"pool.instance_type must be a non-empty string, got {self.instance_type!r}")
        if self.availability_zone is not None and (
            not isinstance(self.availability_zone, str) or not self.availability_zone.strip()
        ):
            raise ValueError(f"pool.availability_zone must be a non-empty string or None, "
                             f"got {self.availability_zone!r}")

    def __str__(self) -> str:
        return f"{self.instance_type}/{self.availability_zone or '*'}"


@dataclass(frozen=True)
class Selectable:
    """The Capacity Reservations Karpenter can launch a run into, and where that was read.

    ``ids``: the ``status.capacityReservations[].id`` (state ``active``) of the EC2NodeClasses
    that the NodePools able to serve the run reference; ``sources``: ``"nodepool/ec2nodeclass"``
    pairs, for the reason.  (aws/karpenter-provider-aws v1.6+: Karpenter launches only into
    reservations its EC2NodeClass resolved from ``capacityReservationSelectorTerms`` into
    ``status.capacityReservations``, pkg/providers/capacityreservation,
    pkg/apis/v1/ec2nodeclass_status.go.)
    """

    ids: frozenset[str]
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        return ", ".join(self.sources) if self.sources else "no NodePool able to serve it"


# --------------------------------------------------------------------------- the decision
def decide(
    *,
    pool: Pool,
    instance_count: int,
    interruptions: Sequence[datetime],
    reservations: Sequence[CapacityReservation],
    unavailable: Collection[str] = frozenset(),
    now: datetime,
    run_needs: timedelta | None,
    current_capacity: Capacity | str | None,
    last_move: datetime | None,
    policy: CapacityPolicy,
    current_reservation_id: str | None = None,
    offerings: Sequence[CapacityOffering] = (),
    selectable: Selectable | None = None,
    drain_lead: timedelta | None = None,
    closed: Mapping[str, str] | None = None,
) -> CapacityDecision:
    """Decide where a run of ``instance_count`` instances of ``pool`` goes now.

    Args:
        pool: the run's instance type and AZ (AZ None: any AZ will do for a block).
        instance_count: instances the run needs placed (>= 1).
        interruptions: when the pool's instances were interrupted (tz-aware); those outside
            ``policy.interruption_window`` are ignored.
        reservations: Capacity Reservations as DescribeCapacityReservations lists them; only
            ``capacity-block`` ones that are ``active`` count.
        unavailable: what is known to have no capacity right now (an ICE cache): capacity type
            names (``"spot"``, ``"on-demand"``, ``"capacity-block"`` for every block) and
            reservation ids (one block).
        now: the current time (tz-aware).
        run_needs: how much longer the run needs the capacity, or None when unknown.
        current_capacity: where the run is now (None: not known / new).
        last_move: when the run was last moved between capacity types (None: never).
        policy: the knobs.
        current_reservation_id: the block the run is on now, preferred when it still fits.
        offerings: Capacity Block offerings to consider buying (only with ``purchase_blocks``).
        selectable: the reservations Karpenter can launch the run into (None: not known, any).
        drain_lead: the run's nodes are drained this long before a block ends (Karpenter: 40 min);
            the margin used for the run is at least that.
        closed: capacity value -> why the run cannot be admitted there now (Kueue quota, flavor).
    """
    _check_inputs(pool=pool, instance_count=instance_count, interruptions=interruptions,
                  now=now, run_needs=run_needs, last_move=last_move, unavailable=unavailable)
    policy = _for_the_run(policy, drain_lead)
    closed = dict(closed or {})
    current = Capacity(current_capacity) if current_capacity not in (None, Capacity.WAIT, "wait") else None
    unavailable = frozenset(unavailable)
    recent, details = _recent_interruptions(pool, instance_count=instance_count, interruptions=interruptions,
                                            now=now, policy=policy)

    spot_reason, why_not_spot, spot_soft = _spot(
        pool=pool, recent=recent, interruptions=interruptions, unavailable=unavailable, now=now,
        current=current, last_move=last_move, policy=policy) if Capacity.SPOT.value not in closed \
        else (None, closed[Capacity.SPOT.value], False)
    blocks, why_no_block = usable_blocks(
        reservations, pool=pool, instance_count=instance_count, now=now, run_needs=run_needs,
        policy=policy, unavailable=unavailable, prefer=current_reservation_id, selectable=selectable
    ) if Capacity.CAPACITY_BLOCK.value not in closed else ([], closed[Capacity.CAPACITY_BLOCK.value])
    passed_over = f"; {why_no_block}" if blocks and why_no_block else ""

    if blocks and (policy.prefer_blocks or spot_reason is None):
        prefix = "prefer_blocks is on" if policy.prefer_blocks else why_not_spot
        return _block_decision(blocks[0], f"{prefix}; ", passed_over, policy=policy, details=details)
    if spot_reason is not None:
        return CapacityDecision(Capacity.SPOT, spot_reason, details=details)
    return _buy_or_fall_back(why_not_spot, why_no_block, spot_soft=spot_soft, pool=pool,
                             instance_count=instance_count, now=now, run_needs=run_needs, offerings=offerings,
                             unavailable=unavailable, policy=policy, closed=closed, details=details)


def _recent_interruptions(pool: Pool, *, instance_count: int, interruptions: Sequence[datetime], now: datetime,
                          policy: CapacityPolicy) -> tuple[list[datetime], dict[str, JsonValue]]:
    """The pool's interruptions inside ``policy.interruption_window`` (oldest first), and the
    decision's details that describe the run and them."""
    window_start = now - policy.interruption_window
    recent = sorted(t for t in interruptions if window_start < t <= now)
    return recent, {"pool": str(pool), "instance_count": instance_count,
                    "interruptions_in_window": len(recent),
                    "interruption_threshold": policy.interruption_threshold}


def _buy_or_fall_back(why_not_spot: str, why_no_block: str, *, spot_soft: bool, pool: Pool, instance_count: int,
                      now: datetime, run_needs: timedelta | None, offerings: Sequence[CapacityOffering],
                      unavailable: frozenset[str], policy: CapacityPolicy, closed: Mapping[str, str],
                      details: dict[str, JsonValue]) -> CapacityDecision:
    """Neither Spot nor a block held: buy a Capacity Block when the policy allows it and one is on
    offer, else On-Demand or wait (:func:`_no_block`)."""
    if policy.purchase_blocks and offerings and Capacity.CAPACITY_BLOCK.value not in closed:
        offering, why_no_offering = choose_offering(offerings, pool=pool, instance_count=instance_count,
                                                    now=now, run_needs=run_needs, policy=policy)
        if offering is not None:
            return _purchase(offering, f"{why_not_spot}; {why_no_block}", policy=policy, details=details)
        why_no_block = f"{why_no_block}; {why_no_offering}"
    return _no_block(f"{why_not_spot}; {why_no_block}", why_not_spot, why_no_block, spot_soft=spot_soft,
                     details=details, unavailable=unavailable, policy=policy, closed=closed.get("on-demand"))


def _for_the_run(policy: CapacityPolicy, drain_lead: timedelta | None) -> CapacityPolicy:
    """``policy`` with a ``block_end_margin`` of at least ``drain_lead`` (the run's nodes are
    drained that long before a block ends: Karpenter's 40 min where it manages them)."""
    if drain_lead is None or drain_lead <= policy.block_end_margin:
        return policy
    return replace(policy, block_end_margin=drain_lead)


def _end(block: CapacityReservation) -> datetime:
    """The end of a usable block (``_usable_blocks`` passes over a block without one)."""
    if block.end is None:
        raise ValueError(f"Capacity Block {block.reservation_id} has no end date")
    return block.end


def _block_decision(block: CapacityReservation, prefix: str, passed_over: str, *,
                    policy: CapacityPolicy, details: dict[str, JsonValue]) -> CapacityDecision:
    usable_until = _end(block) - policy.block_end_margin
    return CapacityDecision(
        Capacity.CAPACITY_BLOCK,
        f"{prefix}Capacity Block {block.reservation_id} has {block.available_instances} of "
        f"{block.total_instances} instances free, usable until {usable_until.isoformat()}"
        f"{passed_over}",
        reservation_id=block.reservation_id,
        details={**details, "reservation_available": block.available_instances,
                 "reservation_end": _end(block).isoformat()},
    )


def _purchase(offering: CapacityOffering, why_not_others: str, *, policy: CapacityPolicy,
              details: dict[str, JsonValue]) -> CapacityDecision:
    return CapacityDecision(
        Capacity.CAPACITY_BLOCK,
        f"{why_not_others}; buy offering {offering.offering_id} "
        f"({offering.instance_count} x {offering.instance_type} in "
        f"{offering.availability_zone} from {offering.start.isoformat()}) for "
        f"{offering.upfront_fee} {offering.currency} (cap {policy.price_cap})",
        offering=offering, details=details)


def _no_block(why_not_others: str, why_not_spot: str, why_no_block: str, *, spot_soft: bool,
              unavailable: frozenset[str], policy: CapacityPolicy,
              details: dict[str, JsonValue], closed: str | None = None) -> CapacityDecision:
    """No Spot by choice and no Capacity Block: On-Demand, else Spot after all, else wait."""
    why_not_on_demand = None
    if not policy.allow_on_demand:
        why_not_on_demand = "On-Demand is not allowed"
    elif Capacity.ON_DEMAND.value in unavailable:
        why_not_on_demand = "On-Demand has no capacity (ICE)"
    elif closed is not None:
        why_not_on_demand = closed
    if why_not_on_demand is None:
        return CapacityDecision(Capacity.ON_DEMAND, why_not_others, details=details)
    if spot_soft:
        # The cool-down only keeps a run off Spot while somewhere else would take it.
        return CapacityDecision(
            Capacity.SPOT,
            f"{why_not_spot}, but {why_no_block}; {why_not_on_demand}: Spot rather than waiting",
            details=details)
    return CapacityDecision(
        Capacity.WAIT, f"{why_not_others}; {why_not_on_demand}",
        retry_after=policy.wait_retry, details=details)


def _spot(*, pool: Pool, recent: Sequence[datetime], interruptions: Sequence[datetime],
          unavailable: frozenset[str], now: datetime, current: Capacity | None,
          last_move: datetime | None, policy: CapacityPolicy) -> tuple[str | None, str, bool]:
    """(reason to use Spot, "", False), or (None, why not Spot, whether that is only the cool-down)."""
    n, threshold = len(recent), policy.interruption_threshold
    window = _fmt(policy.interruption_window)
    if Capacity.SPOT.value in unavailable:
        return None, f"Spot {pool} has no capacity (ICE)", False
    if n >= threshold:
        return None, (f"Spot {pool} interrupted {n} times in the last {window} "
                      f"(threshold {threshold})"), False
    if current in (Capacity.CAPACITY_BLOCK, Capacity.ON_DEMAND):
        cooldown = policy.spot_cooldown
        if last_move is not None and now - last_move < cooldown:
            back = last_move + cooldown
            return None, (f"cool-down: the run left Spot at {last_move.isoformat()}, "
                          f"back to Spot not before {back.isoformat()}"), True
        calm_since = now - cooldown
        loud = sorted(t for t in interruptions if calm_since < t <= now)
        if loud:
            return None, (f"Spot {pool} not calm: interrupted at {loud[-1].isoformat()}, "
                          f"within the {_fmt(cooldown)} cool-down"), True
        return (f"cool-down of {_fmt(cooldown)} passed and Spot {pool} is calm "
                f"(no interruption since {calm_since.isoformat()}): back to Spot"), "", False
    return (f"Spot {pool} healthy: {n} interruptions in the last {window} "
            f"(threshold {threshold})"), "", False


def usable_blocks(
    reservations: Sequence[CapacityReservation],
    *,
    pool: Pool,
    instance_count: int,
    now: datetime,
    run_needs: timedelta | None,
    policy: CapacityPolicy,
    unavailable: Collection[str] = frozenset(),
    prefer: str | None = None,
    selectable: Selectable | None = None,
) -> tuple[list[CapacityReservation], str]:
    """The Capacity Blocks the run can go to, best first, and (when none) why not.

    Best: the block the run is on (``prefer``), then the latest end (fewest moves), then the
    most room, then the id (stable).  A block qualifies when it is a ``capacity-block``,
    ``active``, for the pool's instance type (and AZ, when known), not marked unavailable, has
    ``instance_count`` available instances, and is usable (before its last
    ``block_end_margin``) for the run's needs, or for ``min_block_time`` when they are unknown,
    and (``selectable`` given) an EC2NodeClass able to serve the run lists it.  The reason lists
    every block passed over, also when another one qualifies.
    """
    if Capacity.CAPACITY_BLOCK.value in unavailable:
        return [], "Capacity Blocks have no capacity (ICE)"
    need = run_needs if run_needs is not None else policy.min_block_time
    candidates = [r for r in reservations
                  if r.reservation_type == CAPACITY_BLOCK_TYPE and r.state == ACTIVE
                  and r.instance_type == pool.instance_type
                  and (pool.availability_zone is None or r.availability_zone == pool.availability_zone)]
    if not candidates:
        return [], f"no active Capacity Block for {pool}"
    usable, rejected = [], []
    for r in candidates:
        if selectable is not None and r.reservation_id not in selectable.ids:
            rejected.append(f"{r.reservation_id} is selected by no EC2NodeClass of the run "
                            f"({selectable.describe()}): Karpenter cannot launch into it")
        elif r.reservation_id in unavailable:
            rejected.append(f"{r.reservation_id} has no capacity (ICE)")
        elif r.start is not None and r.start > now:
            rejected.append(f"{r.reservation_id} starts at {r.start.isoformat()}")
        elif r.end is None:
            rejected.append(f"{r.reservation_id} has no end date")
        elif r.end - policy.block_end_margin <= now:
            rejected.append(f"{r.reservation_id} is in its last {_fmt(policy.block_end_margin)} "
                            f"(ends {r.end.isoformat()})")
        elif r.end - policy.block_end_margin < now + need:
            rejected.append(f"{r.reservation_id} ends {r.end.isoformat()}, within the run's "
                            f"{'needs' if run_needs is not None else 'minimum block time'} "
                            f"({_fmt(need)} + {_fmt(policy.block_end_margin)} margin)")
        elif r.available_instances < instance_count:
            rejected.append(f"{r.reservation_id} has {r.available_instances} free, "
                            f"the run needs {instance_count}")
        else:
            usable.append(r)
    usable.sort(key=lambda r: (r.reservation_id != prefer, -_end(r).timestamp(),
                               -r.available_instances, r.reservation_id))
    if not rejected:
        return usable, ""
    return usable, ("Capacity Blocks passed over: " if usable else "no usable Capacity Block: ") + "; ".join(rejected)


def choose_offering(
    offerings: Sequence[CapacityOffering],
    *,
    pool: Pool,
    instance_count: int,
    now: datetime,
    run_needs: timedelta | None,
    policy: CapacityPolicy,
) -> tuple[CapacityOffering | None, str]:
    """The cheapest offering worth buying for the run, and (when none) why not.

    Worth buying: the pool's instance type (and AZ), at least ``instance_count`` instances, an
    upfront fee within ``price_cap``, a start within ``purchase_max_wait``, and an end that
    covers the run's needs (or ``min_block_time``) plus ``block_end_margin``.
    """
    if not policy.purchase_blocks or policy.price_cap is None:
        return None, "buying Capacity Blocks is off"
    need = run_needs if run_needs is not None else policy.min_block_time
    fitting, rejected = [], []
    for o in offerings:
        if o.instance_type != pool.instance_type or (
            pool.availability_zone is not None and o.availability_zone != pool.availability_zone
        ):
            continue
        if o.currency != "USD":
            rejected.append(f"{o.offering_id} is priced in {o.currency}")
        elif o.instance_count < instance_count:
            rejected.append(f"{o.offering_id} has {o.instance_count} instances")
        elif o.upfront_fee > policy.price_cap:
            rejected.append(f"{o.offering_id} costs {o.upfront_fee} > cap {policy.price_cap}")
        elif o.start > now + policy.purchase_max_wait:
            rejected.append(f"{o.offering_id} starts {o.start.isoformat()}, later than "
                            f"{_fmt(policy.purchase_max_wait)} from now")
        elif o.end - policy.block_end_margin < max(o.start, now) + need:
            rejected.append(f"{o.offering_id} ends {o.end.isoformat()}, too soon")
        else:
            fitting.append(o)
    if not fitting:
        return None, ("no offering to buy: " + "; ".join(rejected)) if rejected else \
            f"no Capacity Block offering for {pool}"
    fitting.sort(key=lambda o: (o.upfront_fee, o.start, o.offering_id))
    return fitting[0], ""


# --------------------------------------------------------------------------- input checks
def _aware(name: str, value: datetime) -> None:
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got {value.isoformat()}")


def _check_inputs(*, pool: Pool, instance_count: int, interruptions: Sequence[datetime],
                  now: datetime, run_needs: timedelta | None, last_move: datetime | None,
                  unavailable: Collection[str]) -> None:
    if not isinstance(pool, Pool):
        raise TypeError(f"pool must be a Pool, got {type(pool).__name__}")
    if isinstance(instance_count, bool) or not isinstance(instance_count, int) or instance_count < 1:
        raise ValueError(f"instance_count must be a whole number >= 1, got {instance_count!r}")
    _aware("now", now)
    for i, t in enumerate(interruptions):
        _aware(f"interruptions[{i}]", t)
    if last_move is not None:
        _aware("last_move", last_move)
    if run_needs is not None and (not isinstance(run_needs, timedelta) or run_needs < timedelta(0)):
        raise ValueError(f"run_needs must be a non-negative timedelta or None, got {run_needs!r}")
    if isinstance(unavailable, str):
        raise TypeError("unavailable must be a collection of names, not one string")


def _fmt(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds % 86400 == 0 and seconds:
        return f"{seconds // 86400}d"
    if seconds % 3600 == 0 and seconds:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0 and seconds:
        return f"{seconds // 60}m"
    return f"{seconds}s"
