"""The ledger of a recovery: what one interruption of one run cost, and what its capacity cost.  Pure.

One :class:`Ledger` per recovery (one notice of one run), kept with the run's follow-up record
(docs/operations.md, "What an interruption cost: the ledger").  Two halves:

``lost``: the run's time lost to the interruption, in seconds and in GPU-seconds (ranks x
accelerators per rank x seconds: a gang restart idles every rank), as four parts that never
count the same second twice (:func:`lost_parts`)::

    steps_repeated   steps trained twice x the run's step time      (trained again after the resume)
    save_pause       the save at the notice                         (before training stopped)
    idle             training stopped -> training again, less the capacity wait
    capacity_wait    the requeue -> the placement stage reached     (within stopped -> again)

each with the source it was read from, and ``null`` with the reason when an input is unknown
(never a guess).

``capacity``: each span the run held capacity (:class:`CapacityUse`: the capacity, instances,
hours, the price per instance-hour and where it was read from; an unknown price is ``null`` with
the reason).  From them: ``premium_usd`` (what the moves cost over Spot: each span's price less
Spot's, times its hours), ``savings_usd`` (On-Demand's price less each span's, times its hours:
what the spans saved against On-Demand all along) and ``goodput`` (productive GPU-seconds / GPU-
seconds held, held = productive + lost, this recovery's and the run's earlier ones).

Nothing here reads a clock or does I/O: every input is an argument (tests build a run whose cost
is known by construction, tests/test_ledger.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from resilienced.clock import parse_time
from resilienced.model import JsonValue


class Part(str, enum.Enum):
    """One part of what an interruption cost (the ``part`` label of ``resilienced_lost_gpu_seconds_total``)."""

    STEPS_REPEATED = "steps_repeated"
    SAVE_PAUSE = "save_pause"
    IDLE = "idle"
    CAPACITY_WAIT = "capacity_wait"


#: The parts, in the order they are shown.
PARTS: tuple[str, ...] = tuple(p.value for p in Part)
#: The moments a ledger marks (``Ledger.marks``): the notice, training stopped on the lost node, the
#: requeue, the capacity placed, training again.
MARKS: tuple[str, ...] = ("notice", "stopped", "requeued", "placed", "again")
FORMAT = "resilienced-ledger/1"


@dataclass(frozen=True)
class Known:
    """A number and where it was read from; ``value`` None: unknown, ``source`` then says why."""

    value: float | None
    source: str

    @classmethod
    def unknown(cls, why: str) -> Known:
        return cls(None, why)


@dataclass(frozen=True)
class Gpus:
    """The accelerators the run holds: ``ranks`` x ``per_rank`` (1 per rank where none is declared)."""

    ranks: int
    per_rank: float = 1.0
    source: str = "1 accelerator per rank: none declared"

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.per_rank <= 0:
            raise ValueError(f"gpus: ranks must be >= 1 and per_rank > 0, got {self.ranks} x {self.per_rank}")

    @property
    def total(self) -> float:
        return self.ranks * self.per_rank


@dataclass(frozen=True)
class Recovery:
    """What the ledger of one recovery is computed from; each input with its source.

    ``training_stopped_at``: the end of training on the lost node (the last step before the
    teardown); ``requeued_at``: the requeue (the move that asked for capacity); ``placed_at``: the
    placement stage reached (``scheduled``/``joined``: the capacity is there); ``training_again_at``:
    the first step trained after the notice (the trainer's resume record).
    """

    notice_at: datetime
    gpus: Gpus
    steps_trained_twice: Known
    step_seconds: Known
    save_seconds: Known
    training_stopped_at: datetime | None
    requeued_at: datetime | None
    placed_at: datetime | None
    training_again_at: datetime | None
    stopped_source: str = ""
    placed_source: str = ""
    again_source: str = ""


@dataclass(frozen=True)
class LostPart:
    """One part of ``lost``: seconds (wall) and GPU-seconds, its source; None with the reason."""

    part: str
    seconds: float | None
    gpu_seconds: float | None
    source: str

    def as_json(self) -> dict[str, JsonValue]:
        return {"part": self.part, "seconds": self.seconds, "gpu_seconds": self.gpu_seconds, "source": self.source}


def _span(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, (end - start).total_seconds())


def _overlap(a: tuple[datetime, datetime], b: tuple[datetime, datetime]) -> float:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return max(0.0, (end - start).total_seconds())


def lost_parts(r: Recovery) -> tuple[LostPart, ...]:
    """The four parts of what the recovery ``r`` lost (see the module docstring), in :data:`PARTS` order."""
    gpus = r.gpus.total

    def part(name: Part, seconds: float | None, source: str) -> LostPart:
        if seconds is None:
            return LostPart(name.value, None, None, source)
        return LostPart(name.value, round(seconds, 3), round(seconds * gpus, 3), source)

    out = []
    if r.steps_trained_twice.value is None or r.step_seconds.value is None:
        why = r.steps_trained_twice.source if r.steps_trained_twice.value is None else r.step_seconds.source
        out.append(part(Part.STEPS_REPEATED, None, f"unknown: {why}"))
    else:
        n = int(r.steps_trained_twice.value)
        out.append(part(Part.STEPS_REPEATED, n * r.step_seconds.value,
                        f"{n} step(s) trained twice ({r.steps_trained_twice.source}) x "
                        f"{r.step_seconds.value:g}s per step ({r.step_seconds.source})"))
    if r.save_seconds.value is None:
        out.append(part(Part.SAVE_PAUSE, None, f"unknown: {r.save_seconds.source}"))
    else:
        out.append(part(Part.SAVE_PAUSE, r.save_seconds.value, r.save_seconds.source))
    stopped, again = r.training_stopped_at, r.training_again_at
    down = _span(stopped, again)
    wait = None
    if stopped is not None and again is not None and r.requeued_at is not None and r.placed_at is not None:
        wait = _overlap((r.requeued_at, r.placed_at), (stopped, again))
    if down is None:
        missing = "the end of training on the lost node" if r.training_stopped_at is None else "training again"
        out.append(part(Part.IDLE, None, f"unknown: {missing} not seen"))
    else:
        out.append(part(Part.IDLE, down - (wait or 0.0),
                        f"training stopped ({r.stopped_source}) -> training again ({r.again_source})"
                        + (", less the capacity wait" if wait else "")))
    if wait is None:
        why = ("training stopped -> again unknown" if down is None
               else "the requeue not recorded" if r.requeued_at is None else "the placement stage not reached")
        out.append(part(Part.CAPACITY_WAIT, None, f"unknown: {why}"))
    else:
        out.append(part(Part.CAPACITY_WAIT, wait, f"the requeue -> the capacity placed ({r.placed_source}), "
                                                  "within training stopped -> again"))
    return tuple(out)


# --------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class Price:
    """A price per instance-hour in USD, where it was read from; ``usd_per_hour`` None: unknown (``reason``)."""

    usd_per_hour: float | None
    source: str
    reason: str | None = None

    @classmethod
    def unknown(cls, source: str, reason: str) -> Price:
        return cls(None, source, reason)

    def as_json(self) -> dict[str, JsonValue]:
        return {"usd_per_hour": self.usd_per_hour, "source": self.source, "reason": self.reason}

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> Price:
        reason = data.get("reason")
        return cls(_num(data.get("usd_per_hour"), "usd_per_hour"), str(data.get("source") or ""),
                   None if reason is None else str(reason))


def block_price(*, upfront_fee: float, hours: float, instances: int, source: str) -> Price:
    """A Capacity Block's price per instance-hour: its upfront fee over its duration and instances."""
    if hours <= 0 or instances < 1:
        return Price.unknown(source, f"a block of {hours:g} hour(s) x {instances} instance(s) has no hourly price")
    return Price(round(float(upfront_fee) / (hours * instances), 6), source)


@dataclass(frozen=True)
class CapacityUse:
    """A span the run held ``instances`` instances of ``capacity`` (``spot``, ``capacity-block``, ``on-demand``)."""

    capacity: str
    start: datetime
    end: datetime
    instances: int
    price: Price

    @property
    def hours(self) -> float:
        """Instance-hours."""
        return self.instances * max(0.0, (self.end - self.start).total_seconds()) / 3600

    @property
    def cost_usd(self) -> float | None:
        return None if self.price.usd_per_hour is None else round(self.hours * self.price.usd_per_hour, 6)

    def as_json(self) -> dict[str, JsonValue]:
        return {"capacity": self.capacity, "start": self.start.isoformat(), "end": self.end.isoformat(),
                "instances": self.instances, "hours": round(self.hours, 6), "price": self.price.as_json(),
                "cost_usd": self.cost_usd}

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> CapacityUse:
        return cls(str(data["capacity"]), _time(data["start"]), _time(data["end"]),
                   record_whole(data["instances"], "instances"), Price.from_json(record_object(data["price"], "price", required=True)))


@dataclass(frozen=True)
class Figure:
    """A derived figure: a value, or None and why."""

    value: float | None
    reason: str | None = None

    def as_json(self) -> JsonValue:
        return self.value


def premium(uses: Sequence[CapacityUse], spot: Price) -> Figure:
    """What the spans off Spot cost over Spot: sum of (price - Spot's) x hours; None naming the unknown price."""
    off = [u for u in uses if u.capacity != "spot"]
    if not off:
        return Figure(0.0)
    if spot.usd_per_hour is None:
        return Figure(None, f"the Spot price is unknown: {spot.reason}")
    total = 0.0
    for u in off:
        if u.price.usd_per_hour is None:
            return Figure(None, f"the {u.capacity} price is unknown: {u.price.reason}")
        total += (u.price.usd_per_hour - spot.usd_per_hour) * u.hours
    return Figure(round(total, 6))


def premium_by_capacity(uses: Sequence[CapacityUse], spot: Price) -> dict[str, float]:
    """Capacity -> premium over Spot (known prices only): the counter's increments."""
    out: dict[str, float] = {}
    if spot.usd_per_hour is None:
        return out
    for u in uses:
        if u.capacity != "spot" and u.price.usd_per_hour is not None:
            out[u.capacity] = round(out.get(u.capacity, 0.0) + (u.price.usd_per_hour - spot.usd_per_hour) * u.hours, 6)
    return out


def savings(uses: Sequence[CapacityUse], on_demand: Price) -> Figure:
    """What the spans saved against On-Demand all along: sum of (On-Demand's price - price) x hours."""
    if not uses:
        return Figure(None, "no capacity span recorded")
    if on_demand.usd_per_hour is None:
        return Figure(None, f"the On-Demand price is unknown: {on_demand.reason}")
    total = 0.0
    for u in uses:
        if u.price.usd_per_hour is None:
            return Figure(None, f"the {u.capacity} price is unknown: {u.price.reason}")
        total += (on_demand.usd_per_hour - u.price.usd_per_hour) * u.hours
    return Figure(round(total, 6))


def goodput(productive_gpu_seconds: Known, lost_gpu_seconds: float) -> Figure:
    """productive / (productive + lost); None when the productive GPU-seconds are unknown."""
    if productive_gpu_seconds.value is None:
        return Figure(None, f"productive GPU-seconds unknown: {productive_gpu_seconds.source}")
    held = productive_gpu_seconds.value + lost_gpu_seconds
    if held <= 0:
        return Figure(None, "no GPU-seconds held yet")
    return Figure(round(productive_gpu_seconds.value / held, 6))


# --------------------------------------------------------------------------- the ledger
@dataclass(frozen=True)
class Ledger:
    """The ledger of one recovery of ``run`` (see the module docstring); ``at``: when it was computed.

    ``earlier_lost_gpu_seconds``: what the run's earlier recoveries lost (carried from the ledger
    of the follow-up this one replaced), for the run's ``goodput`` so far.
    """

    run: str
    event_id: str
    notice_at: datetime
    at: datetime
    gpus: Gpus
    lost: tuple[LostPart, ...]
    capacity: tuple[CapacityUse, ...]
    prices: Mapping[str, Price]
    productive_gpu_seconds: Known
    earlier_lost_gpu_seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    marks: Mapping[str, str] = field(default_factory=dict)  # what happened when (ISO): MARKS, for the plot

    @property
    def lost_gpu_seconds(self) -> float:
        """The sum of the known parts, in GPU-seconds."""
        return round(sum(p.gpu_seconds or 0.0 for p in self.lost), 3)

    @property
    def lost_seconds(self) -> float:
        return round(sum(p.seconds or 0.0 for p in self.lost), 3)

    def part(self, name: str) -> LostPart:
        return next(p for p in self.lost if p.part == name)

    def price(self, capacity: str) -> Price:
        return self.prices.get(capacity) or Price.unknown("", f"no {capacity} price read")

    @property
    def premium(self) -> Figure:
        return premium(self.capacity, self.price("spot"))

    @property
    def savings(self) -> Figure:
        return savings(self.capacity, self.price("on-demand"))

    @property
    def goodput(self) -> Figure:
        return goodput(self.productive_gpu_seconds, self.lost_gpu_seconds + self.earlier_lost_gpu_seconds)

    def as_json(self) -> dict[str, JsonValue]:
        prem, save, good = self.premium, self.savings, self.goodput
        return {
            "format": FORMAT, "run": self.run, "event_id": self.event_id,
            "notice_at": self.notice_at.isoformat(), "at": self.at.isoformat(),
            "gpus": {"ranks": self.gpus.ranks, "per_rank": self.gpus.per_rank, "source": self.gpus.source},
            "lost": [p.as_json() for p in self.lost],
            "lost_gpu_seconds": self.lost_gpu_seconds, "lost_seconds": self.lost_seconds,
            "capacity": [u.as_json() for u in self.capacity],
            "prices": {k: v.as_json() for k, v in self.prices.items()},
            "currency": "USD",
            "premium_usd": prem.value, "premium_reason": prem.reason,
            "savings_usd": save.value, "savings_reason": save.reason,
            "productive_gpu_seconds": {"value": self.productive_gpu_seconds.value,
                                       "source": self.productive_gpu_seconds.source},
            "earlier_lost_gpu_seconds": self.earlier_lost_gpu_seconds,
            "goodput": good.value, "goodput_reason": good.reason,
            "notes": list(self.notes), "marks": dict(self.marks),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> Ledger:
        """The ledger in ``data``; ValueError naming what is wrong."""
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            g = record_object(data["gpus"], "gpus", required=True)
            productive = record_object(data.get("productive_gpu_seconds"), "productive_gpu_seconds")
            return cls(
                run=str(data["run"]), event_id=str(data["event_id"]), notice_at=_time(data["notice_at"]),
                at=_time(data["at"]),
                gpus=Gpus(record_whole(g["ranks"], "gpus.ranks"), record_number(g["per_rank"], "gpus.per_rank"),
                          str(g.get("source") or "")),
                lost=tuple(_lost_part(record_object(p, "lost", required=True))
                           for p in record_items(data["lost"], "lost", required=True)),
                capacity=tuple(CapacityUse.from_json(record_object(u, "capacity", required=True))
                               for u in record_items(data.get("capacity"), "capacity")),
                prices={str(k): Price.from_json(record_object(v, f"prices.{k}", required=True))
                        for k, v in record_object(data.get("prices"), "prices").items()},
                productive_gpu_seconds=Known(_num(productive.get("value"), "productive_gpu_seconds.value"),
                                             str(productive.get("source") or "")),
                earlier_lost_gpu_seconds=record_number(data.get("earlier_lost_gpu_seconds") or 0.0,
                                                       "earlier_lost_gpu_seconds"),
                notes=tuple(str(n) for n in record_items(data.get("notes"), "notes")),
                marks={str(k): str(v) for k, v in record_object(data.get("marks"), "marks").items()})
        except (KeyError, TypeError, ValueError, StopIteration) as e:
            raise ValueError(f"ledger of {data.get('run')!r}: {type(e).__name__}: {e}") from None

    def prices_per_hour(self) -> dict[str, float | None]:
        """Capacity -> USD per instance-hour, or None (the drill's ``cost.prices``)."""
        return {k: v.usd_per_hour for k, v in self.prices.items()}


def capacity_spans(moves: Iterable[tuple[str, datetime]], *, until: datetime, instances: int,
                   prices: Mapping[str, Price]) -> tuple[CapacityUse, ...]:
    """The spans of capacity from the moves ``(capacity, at)`` in time order: each lasts until the next
    move (the last until ``until``), priced from ``prices`` (capacity -> Price)."""
    moves = sorted(moves, key=lambda m: m[1])
    out = []
    for (capacity, start), following in zip(moves, [*moves[1:], (None, until)]):
        end = max(start, following[1])
        out.append(CapacityUse(capacity, start, end, instances,
                               prices.get(capacity) or Price.unknown("", f"no {capacity} price read")))
    return tuple(out)


def compute(r: Recovery, *, run: str, event_id: str, at: datetime, capacity: Sequence[CapacityUse],
            prices: Mapping[str, Price], productive_gpu_seconds: Known, earlier_lost_gpu_seconds: float = 0.0,
            notes: Sequence[str] = ()) -> Ledger:
    """The ledger of the recovery ``r`` (its parts from :func:`lost_parts`)."""
    marks = {name: moment.isoformat() for name, moment in (
        ("notice", r.notice_at), ("stopped", r.training_stopped_at), ("requeued", r.requeued_at),
        ("placed", r.placed_at), ("again", r.training_again_at)) if moment is not None}
    return Ledger(run=run, event_id=event_id, notice_at=r.notice_at, at=at, gpus=r.gpus, lost=lost_parts(r),
                  capacity=tuple(capacity), prices=dict(prices), productive_gpu_seconds=productive_gpu_seconds,
                  earlier_lost_gpu_seconds=earlier_lost_gpu_seconds, notes=tuple(notes), marks=marks)


def summary(ledger: Ledger) -> dict[str, JsonValue]:
    """The short form (the drill's ``ledger``, the notifications): the sum, each part, goodput, cost."""
    return {
        "lost_gpu_seconds": ledger.lost_gpu_seconds,
        "parts": {p.part: p.gpu_seconds for p in ledger.lost},
        "goodput": ledger.goodput.value,
        "cost": {"currency": "USD", "premium": ledger.premium.value, "premium_reason": ledger.premium.reason,
                 "savings": ledger.savings.value, "prices": {k: v for k, v in ledger.prices_per_hour().items()}},
    }


def _lost_part(data: Mapping[str, JsonValue]) -> LostPart:
    return LostPart(str(data["part"]), _num(data.get("seconds"), "lost.seconds"),
                    _num(data.get("gpu_seconds"), "lost.gpu_seconds"), str(data.get("source") or ""))


def _num(value: JsonValue | None, what: str) -> float | None:
    return None if value is None else record_number(value, what)


def _time(value: object) -> datetime:
    moment = value if isinstance(value, datetime) else parse_time(str(value))
    if moment.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone")
    return moment


# The checked readers of a JSON record (a follow-up record, a ledger): each reads the value at ``what``
# and raises ValueError naming ``what`` for a value of another type.

def record_object(value: JsonValue | None, what: str, *, required: bool = False) -> dict[str, JsonValue]:
    """The JSON object of the record at ``what`` ({} when absent or empty, unless ``required``); ValueError
    for another type."""
    if not value and not required:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what}: expected an object, got {type(value).__name__}")
    return value


def record_items(value: JsonValue | None, what: str, *, required: bool = False) -> list[JsonValue]:
    """The JSON list of the record at ``what`` ([] when absent or empty, unless ``required``); ValueError for
    another type."""
    if not value and not required:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{what}: expected a list, got {type(value).__name__}")
    return value


def record_objects(value: JsonValue | None, what: str) -> list[dict[str, JsonValue]]:
    """The list of JSON objects of the record at ``what`` ([] when absent or empty); ValueError otherwise."""
    return [record_object(item, what) for item in record_items(value, what)]


def record_number(value: JsonValue | None, what: str) -> float:
    """A number of the record (written as a number or its text); ValueError for anything else."""
    if isinstance(value, (int, float, str)):
        return float(value)
    raise ValueError(f"{what}: expected a number, got {type(value).__name__}")


def record_whole(value: JsonValue | None, what: str) -> int:
    """A whole number of the record (written as a number or its text); ValueError for anything else."""
    if isinstance(value, (int, float, str)):
        return int(value)
    raise ValueError(f"{what}: expected a number, got {type(value).__name__}")


def record_text(value: JsonValue | None) -> str | None:
    """A string of the record, None when absent, empty or not a string."""
    return value if isinstance(value, str) and value else None


def record_time(value: JsonValue | None) -> datetime | None:
    """A time of the record, None when absent, empty or not a string."""
    text = record_text(value)
    return None if text is None else parse_time(text)
