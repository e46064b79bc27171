"""Following a requeued run until it trains again: the record, the stages, the verdict.  Pure.

A recovery does not end when the requeue's writes are accepted: the run must be admitted,
scheduled and training again (docs/requeue.md, "Following the run after the requeue").  The
daemon keeps one :class:`FollowUp` per run in its follow-up store (kubernetes mode: a Lease next
to the run claims; ray mode: the GCS KV), so a replica that dies mid-follow-up leaves it to
another.  ``resilienced.followup.follower.Follower`` looks at the run's current stage, then asks
:func:`judge` what to do: wait, go to the next stage, end (resumed), fall back to the next
capacity of the decision's ranking, or give up (stuck).

Stages, in order, by where the run lives (:func:`stages_for`)::

    kueue (kubernetes)   admitted -> scheduled -> training
    kuberay, volcano     scheduled -> training
    ray mode             joined -> training

Each stage has its own bound (:class:`Bounds`), counted from when the previous stage was
reached (the first from the requeue, or the last fallback).  Nothing here does I/O or reads a
clock: ``now`` is an argument.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from resilienced.clock import parse_time
from resilienced.model import Capacity, JsonValue, RunFacts, StageSeen, Target


class Stage(str, enum.Enum):
    """One step of a run's way back to training."""

    ADMITTED = "admitted"  # Kueue: the active Workload holds quota on a flavor of the decided capacity
    SCHEDULED = "scheduled"  # every worker pod bound to a Node of the decided capacity
    JOINED = "joined"  # ray mode: the replacement node joined the Ray cluster with the capacity's label
    TRAINING = "training"  # an attempt trained a step again (the trainer's resume record)


class State(str, enum.Enum):
    """Where a follow-up is."""

    FOLLOWING = "following"  # looking at its stages
    RESUMED = "resumed"  # ended: the run trains again
    STUCK = "stuck"  # no move left; still watched for training, never moved again
    SUPERSEDED = "superseded"  # ended: a later notice moved the run again (a new follow-up)


#: States that end a follow-up (nothing is looked at any more).
ENDED = frozenset({State.RESUMED, State.SUPERSEDED})


def stages_for(*, mode: str, applier: str) -> tuple[Stage, ...]:
    """The stages a run goes through after a requeue by ``applier`` in ``mode``."""
    if mode == "ray" or applier == "ray":
        return (Stage.JOINED, Stage.TRAINING)
    if applier == "kueue":
        return (Stage.ADMITTED, Stage.SCHEDULED, Stage.TRAINING)
    return (Stage.SCHEDULED, Stage.TRAINING)


@dataclass(frozen=True)
class Bounds:
    """How long each stage may take before it counts as stalled (``joined`` takes ``scheduled``'s)."""

    admitted: timedelta = timedelta(minutes=10)
    scheduled: timedelta = timedelta(minutes=15)
    training: timedelta = timedelta(minutes=15)

    def of(self, stage: Stage) -> timedelta:
        return {Stage.ADMITTED: self.admitted, Stage.SCHEDULED: self.scheduled,
                Stage.JOINED: self.scheduled, Stage.TRAINING: self.training}[stage]


# --------------------------------------------------------------------------- the record
@dataclass(frozen=True)
class FollowUp:
    """The follow-up of one run after one requeue (kept as JSON in the follow-up store).

    ``capacity`` / ``reservation_id``: where the run is being moved now (the last move);
    ``reached``: stage -> ISO time it was reached; ``fallbacks``: the moves made, each
    ``{"from", "to", "reason", "stage", "at"}``; ``unusable``: capacity names (``spot``,
    ``on-demand``) or reservation ids -> ISO time until which they are not tried again for this
    run; ``moving``: a move decided and not yet recorded as made (``{"to": decision, "event_id",
    "from", "stage", "reason"}``): whoever takes the follow-up over applies that move again
    (idempotent) instead of deciding another; ``looked_by``: the replica whose follower wrote it
    last, which looks at it every pass (the others once it has waited in its stage a while:
    ``Follower._looks_at``); ``version``: the store's, not serialised.
    """

    run: str
    event_id: str
    kind: str
    notice_at: datetime
    opened_at: datetime
    target: Mapping[str, Any]  # target_json's document: JSON the daemon wrote itself
    capacity: str
    reservation_id: str | None
    stages: tuple[str, ...]
    stage: str
    stage_since: datetime
    reached: Mapping[str, str] = field(default_factory=dict)
    fallbacks: tuple[Mapping[str, Any], ...] = ()
    unusable: Mapping[str, str] = field(default_factory=dict)
    moving: Mapping[str, Any] | None = None
    state: str = State.FOLLOWING.value
    durable_step: int | None = None
    durable_world_size: int | None = None
    elastic: bool = False
    resumed: Mapping[str, Any] | None = None
    ended_at: datetime | None = None
    reason: str | None = None
    evidence: str | None = None
    ledgers: tuple[Mapping[str, JsonValue], ...] = ()  # the run's recoveries' ledgers (resilienced.ops.ledger), newest last
    bought: Mapping[str, JsonValue] = field(default_factory=dict)  # reservation id -> the offering a move bought
    looked_by: str | None = field(default=None, compare=False)  # the replica that wrote it last
    version: str | None = field(default=None, compare=False)

    @property
    def ended(self) -> bool:
        return State(self.state) in ENDED

    @property
    def where(self) -> str:
        """The capacity being moved to, with its block: ``capacity-block cr-...``."""
        return f"{self.capacity} {self.reservation_id}" if self.reservation_id else self.capacity

    def seconds_from_notice(self, moment: datetime) -> float:
        return round((moment - self.notice_at).total_seconds(), 3)

    def stage_seconds(self) -> dict[str, float]:
        """Stage -> seconds from the notice to when it was reached (the drill's ``recovery_stages``)."""
        return {stage: self.seconds_from_notice(_time(at)) for stage, at in self.reached.items()}

    def as_json(self) -> dict[str, JsonValue]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "version"}
        for name in ("notice_at", "opened_at", "stage_since", "ended_at"):
            out[name] = _iso(out[name]) if out[name] is not None else None
        out["stages"] = list(self.stages)
        out["fallbacks"] = [dict(f) for f in self.fallbacks]
        out["ledgers"] = [dict(x) for x in self.ledgers]
        for name in ("reached", "unusable", "target", "bought"):
            out[name] = dict(out[name])
        if self.moving is not None:
            out["moving"] = dict(self.moving)
        if self.resumed is not None:
            out["resumed"] = dict(self.resumed)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, version: str | None = None) -> FollowUp:
        """The record in ``data`` (JSON as the store read it); ValueError naming the field that is wrong."""
        try:
            values: dict[str, Any] = {f.name: data[f.name] for f in dataclasses.fields(cls)
                      if f.name != "version" and f.name in data}
            for name in ("notice_at", "opened_at", "stage_since"):
                values[name] = _time(data[name])
            if data.get("ended_at"):
                values["ended_at"] = _time(data["ended_at"])
            values["stages"] = tuple(data["stages"])
            values["fallbacks"] = tuple(dict(f) for f in data.get("fallbacks") or ())
            values["ledgers"] = tuple(dict(x) for x in data.get("ledgers") or ())
            State(values.get("state", State.FOLLOWING.value))
            Stage(values["stage"])
            return cls(**values, version=version)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"follow-up record of {data.get('run')!r}: {type(e).__name__}: {e}") from None


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _time(value: object) -> datetime:
    moment = value if isinstance(value, datetime) else parse_time(str(value))
    if moment.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone")
    return moment


# --------------------------------------------------------------------------- targets as JSON
_TUPLE_FACTS = {f.name for f in dataclasses.fields(RunFacts) if "tuple" in str(f.type)}


def target_json(target: Target) -> dict[str, JsonValue]:
    """``target`` as JSON, everything the follow-up needs to act on the run again."""
    facts: dict[str, JsonValue] = {}
    for f in dataclasses.fields(RunFacts):
        value: Any = getattr(target.facts, f.name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        facts[f.name] = value
    return {"instance_id": target.instance_id, "node": target.node, "ray_cluster": target.ray_cluster,
            "ray_job": target.ray_job, "ray_node_ids": list(target.ray_node_ids),
            "checkpoint_uri": target.checkpoint_uri, "ray_address": target.ray_address, "facts": facts}


def target_from(data: Mapping[str, Any], *, exclude: Sequence[str] = ()) -> Target:
    """The Target of :func:`target_json`, with ``exclude`` (capacity in its cool-down) in its facts."""
    facts: dict[str, Any] = {}
    for name, value in dict(data.get("facts") or {}).items():
        if name in _TUPLE_FACTS and value is not None:
            value = tuple(value)
        facts[name] = value
    facts["exclude"] = tuple(dict.fromkeys([*facts.get("exclude", ()), *exclude]))
    return Target(instance_id=data["instance_id"], node=data.get("node"), ray_cluster=data.get("ray_cluster"),
                  ray_job=data.get("ray_job"), ray_node_ids=tuple(data.get("ray_node_ids") or ()),
                  checkpoint_uri=data.get("checkpoint_uri"), ray_address=data.get("ray_address"),
                  facts=RunFacts(**facts))


# --------------------------------------------------------------------------- decisions
@dataclass(frozen=True)
class Judgement:
    """What to do after one look: ``wait``, ``advance`` (the stage is reached, go on), ``resumed``
    (the last stage is reached: the run trains again), ``fall_back`` or ``stuck``."""

    action: str
    reason: str


def judge(record: FollowUp, seen: StageSeen, *, now: datetime, bounds: Bounds,
          max_fallbacks: int) -> Judgement:
    """The verdict on ``record``'s current stage, given what a look at it found."""
    stage = Stage(record.stage)
    if seen.reached:
        return Judgement("resumed" if stage is Stage.TRAINING else "advance", seen.detail)
    waited, bound = now - record.stage_since, bounds.of(stage)
    if State(record.state) is State.STUCK:
        return Judgement("wait", f"stuck; still watched for training: {seen.detail}")
    if waited < bound:
        return Judgement("wait", f"{stage.value} not yet after {fmt(waited)} (bound {fmt(bound)}): {seen.detail}")
    reason = f"{stage.value} not reached within {fmt(bound)}: {seen.detail}"
    if record.elastic:
        return Judgement("stuck", f"{reason}; an elastic run is not moved by the follow-up (its lost workers "
                                  "were replaced; it trains with the survivors at its minimum)")
    if len(record.fallbacks) >= max_fallbacks:
        return Judgement("stuck", f"{reason}; {len(record.fallbacks)} fallback(s) made, at most {max_fallbacks}")
    return Judgement("fall_back", reason)


def overdue(record: FollowUp, *, now: datetime, bounds: Bounds) -> bool:
    """Whether the run is not training again within its bound: stuck, or its stage past its bound."""
    if record.ended:
        return False
    return State(record.state) is State.STUCK or now - record.stage_since >= bounds.of(Stage(record.stage))


def stalled_key(capacity: str, reservation_id: str | None) -> str:
    """What to mark unusable when ``capacity`` stalls: the block itself, else the capacity type."""
    return reservation_id if capacity == Capacity.CAPACITY_BLOCK.value and reservation_id else capacity


def unusable_now(record: FollowUp | None, *, now: datetime) -> tuple[str, ...]:
    """The capacity still in its cool-down for the run (names and reservation ids)."""
    if record is None:
        return ()
    return tuple(sorted(k for k, until in record.unusable.items() if _time(until) > now))


def opens_new(existing: FollowUp | None, *, event_id: str, event_time: datetime | None, changed: bool) -> bool:
    """Whether a requeue for ``event_id`` opens a new follow-up of the run, given the one it has.

    A redelivery of the same event keeps the follow-up; a requeue that moved the run (changed
    something) supersedes it; one that changed nothing keeps an open follow-up (the run is still
    on its way back from the earlier notice) and opens a new one only after the last one ended
    before this event (a new interruption of a run that trained again).
    """
    if existing is None:
        return True
    if existing.event_id == event_id:
        return False
    if changed:
        return True
    if not existing.ended and State(existing.state) is not State.STUCK:
        return False
    ended = existing.ended_at
    return ended is None or event_time is None or event_time > ended


def fmt(delta: timedelta) -> str:
    """``90s``, ``15m``, ``1h30m`` (whole seconds)."""
    seconds = max(0, int(delta.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "", f"{secs}s" if secs else ""]
    return "".join(parts) or "0s"
