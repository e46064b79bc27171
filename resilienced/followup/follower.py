"""After the requeue: follow each run until it trains again, fall back when it stalls.

The :class:`Follower` is a long-lived task of the daemon (a reconciler, as Karpenter's are).
``Recovery`` opens a follow-up (:meth:`Follower.open`) once a requeue placed a run, in the same
move claim as the requeue (``recovery.move.Mover``, which makes every move of a run), and then completes the notice: the SQS message is not held for the
minutes a run takes to train again (docs/requeue.md, "Following the run after the requeue").
Every ``interval`` the follower lists the follow-ups (``ports.FollowUpStore``: a Lease per run
in kubernetes mode, the GCS KV in ray mode) and looks at the open ones together, at most
``looks_at_once`` at a time.  For each one it:

1. finishes a move another replica recorded as decided and did not record as made (the
   record's ``moving``: applied again, which changes nothing if it was applied: the run is
   moved once);
2. looks at the current stage (``ports.Progress``: in kubernetes mode from the daemon's watch
   caches; the training stage from the trainer's resume records in S3, ``trainer.resume``) and
   asks :func:`resilienced.followup.rules.judge`;
3. goes on to the next stage, ends the follow-up (``TrainingResumed``), falls back to the next
   capacity of the decision's ranking (the stalled one unusable for the run for ``cooldown``;
   ``RecoveryStalled``), or gives up after ``max_fallbacks`` moves (``RecoveryStuck``: the run
   is still watched for training, never moved again).

A move (1., and a fallback in 3.) is made under the run's move claim ``move/<run>`` (TTL
``claim_ttl``, renewed while held; never two moves of one run at once, and a replica that dies
mid-move leaves the claim to expire before another goes on), on the record read again under it
and unchanged since the look; a look that does not move the run takes no claim (issue #45: a
waiting run costs no write), and the stages one look reaches are saved in one write with its
verdict (the end, a move, or the wait's: the stage reached and its evidence), not one per stage.
Every write of a record is at the version read, so two replicas' looks at one run, or a look and a
notice's requeue, never both write: the later one finds the record changed (:class:`RecordChanged`)
and the run is looked at again next pass.  So that two replicas do not both look at every run and
race for each of its writes, a run is looked at every pass by the replica that wrote its record last
(``FollowUp.looked_by``: the one whose notice opened it, or that moved it last) and by the others
only once it has waited in its stage half the stage's bound or :data:`TAKEOVER_PASSES` passes,
whichever is sooner (its writer may be gone), or has a move to finish (:meth:`Follower._looks_at`).

Each end and each fallback is an Event on the run, a webhook notification and metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from resilienced import log
from resilienced.aws.s3 import ObjectNotFound, parse_s3_uri
from resilienced.clock import utcnow
from resilienced.errors import PermanentError, ResilienceError, TemporaryError
from resilienced.followup.rules import (
    Bounds,
    FollowUp,
    Judgement,
    Stage,
    State,
    judge,
    opens_new,
    overdue,
    stages_for,
    stalled_key,
    target_from,
    target_json,
    unusable_now,
)
from resilienced.model import (
    Capacity,
    CapacityDecision,
    Event,
    JsonValue,
    Kind,
    RequeueResult,
    StageSeen,
    Target,
)
from resilienced.ops.ledger import Ledger
from resilienced.ops.notify import Notifier
from resilienced.ports import Cluster, FollowUpStore, ObjectStore, Progress
from resilienced.recovery.ledger import LedgerKeeper, notification_facts
from resilienced.recovery.move import Mover, read_follow_up
from resilienced.recovery.steps import StepResults
from resilienced.settings import FollowUpSettings, IntakeSettings, Mode, Settings
from trainer import resume

REASON_TRAINING_RESUMED = "TrainingResumed"
REASON_RECOVERY_STALLED = "RecoveryStalled"
REASON_RECOVERY_STUCK = "RecoveryStuck"

#: notice -> training again: a gang restart takes minutes on EKS; the drill's tens of seconds.
TRAINING_BUCKETS = (5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900, 1800, 3600, 7200)
#: The stages of the ``resilienced_runs_recovering`` gauge (``stuck`` besides the stages).
GAUGE_STAGES = (*(s.value for s in Stage), State.STUCK.value)


#: The settings' defaults, the options' defaults (docs/requeue.md says why each is what it is).
_FOLLOW_UP, _INTAKE = FollowUpSettings(), IntakeSettings()


def _bounds(fs: FollowUpSettings) -> Bounds:
    return Bounds(admitted=timedelta(seconds=fs.admitted_bound_seconds),
                  scheduled=timedelta(seconds=fs.scheduled_bound_seconds),
                  training=timedelta(seconds=fs.training_bound_seconds))


@dataclass(frozen=True)
class FollowUpOptions:
    """How the follower behaves: ``FollowUpSettings`` in the follower's terms, made by
    :meth:`from_settings`; the defaults are the settings' (kubernetes mode)."""

    bounds: Bounds = _bounds(_FOLLOW_UP)
    max_fallbacks: int = _FOLLOW_UP.max_fallbacks
    cooldown: timedelta = timedelta(seconds=_FOLLOW_UP.fallback_cooldown_seconds)
    interval_s: float = _FOLLOW_UP.follow_up_interval_seconds
    claim_ttl_s: float = _FOLLOW_UP.follow_up_claim_ttl_seconds
    keep: timedelta = timedelta(seconds=_INTAKE.dedupe_seconds)  # an ended record, as long as an event id
    mode: Mode = Mode.KUBERNETES
    looks_at_once: int = 10  # open follow-ups looked at together in a pass

    @classmethod
    def from_settings(cls, settings: Settings) -> FollowUpOptions:
        """The options of ``settings.follow_up`` (the bounds, the moves, the looks), kept records as
        long as handled event ids (``--dedupe-seconds``), in ``--mode``."""
        fs = settings.follow_up
        return cls(bounds=_bounds(fs), max_fallbacks=fs.max_fallbacks,
                   cooldown=timedelta(seconds=fs.fallback_cooldown_seconds),
                   interval_s=fs.follow_up_interval_seconds, claim_ttl_s=fs.follow_up_claim_ttl_seconds,
                   keep=timedelta(seconds=settings.intake.dedupe_seconds), mode=settings.mode.mode)


#: The end of the follow-up's name in a run's move claim (``<replica>/follow-up``): a notice that
#: finds the move claim held by a follow-up does not wait for that move (``recovery.responder``).
FOLLOW_UP_HOLDER = "/follow-up"


class RecordChanged(TemporaryError):
    """The follow-up record changed since it was read (another replica, or a notice's requeue)."""


#: Times a requeue's follow-up is opened again on a record a look changed meanwhile.
OPEN_TRIES = 3

#: Passes another replica's run may wait in its stage before this replica looks at it too (unless
#: half the stage's bound comes sooner): its writer may be gone (``Follower._looks_at``).
TAKEOVER_PASSES = 6


class FollowUpMetrics:
    """The follow-up's metrics, on the daemon's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.training_again = Histogram(
            "resilienced_notice_to_training_seconds", "Seconds from the interruption notice to the "
            "first step the requeued run trained again (the trainer's resume record).",
            buckets=TRAINING_BUCKETS, registry=registry)
        self.fallbacks = Counter(
            "resilienced_recovery_fallbacks", "Runs moved to the next capacity because their recovery "
            "stalled, by capacity moved from and to and the stage that stalled (reason).",
            ["from", "to", "reason"], registry=registry)
        self.recovering = Gauge(
            "resilienced_runs_recovering", "Runs followed after a requeue and not training again yet, "
            "by stage (stuck: no move left).", ["stage"], registry=registry)
        self.overdue = Gauge(
            "resilienced_runs_overdue", "Runs not training again within their bound: their stage "
            "passed its bound, or they are stuck.", registry=registry)
        self.ends = Counter(
            "resilienced_recoveries", "Follow-ups that ended or gave up, by outcome (resumed, stuck, "
            "superseded).", ["outcome"], registry=registry)
        for stage in GAUGE_STAGES:
            self.recovering.labels(stage=stage)
        for outcome in ("resumed", "stuck", "superseded"):
            self.ends.labels(outcome=outcome)


class Follower:
    """Follows requeued runs until they train again (see the module docstring).

    Args:
        store: the follow-up records.
        cluster: where Events go.  progress: the looks at a run's stages.
        mover: the fallback's decision and its application (``recovery.move``), and the move claim.
        objects: S3, where the trainer's resume records are (None: training cannot be seen).
        replica: this daemon replica's name (the claims' holder).
    """

    def __init__(self, *, store: FollowUpStore, cluster: Cluster, progress: Progress,
                 mover: Mover, objects: ObjectStore | None,
                 options: FollowUpOptions = FollowUpOptions(), metrics: FollowUpMetrics | None = None,
                 notifier: Notifier | None = None, replica: str = "resilienced",
                 clock: Callable[[], datetime] = utcnow, ledger: LedgerKeeper | None = None) -> None:
        self.store, self.cluster, self.progress = store, cluster, progress
        self.mover, self.objects = mover, objects
        self.options, self.metrics, self.notifier = options, metrics, notifier
        self.replica, self.clock = replica, clock
        self.ledger = ledger  # the recovery's ledger when a follow-up ends (issue #43)
        self._log = log.get("resilienced.followup")

    # ------------------------------------------------------------------ for Recovery
    async def read(self, run: str) -> FollowUp | None:
        return await read_follow_up(self.store, run, logger=self._log)

    async def open(self, target: Target, *, event: Event, result: RequeueResult,
                   steps: StepResults = StepResults()) -> FollowUp | None:
        """Open the follow-up of the run ``result`` placed (call it holding the move claim);
        ``steps``: the recovery's steps so far (the checkpoint the run resumes from).

        Returns the follow-up the run has afterwards: the new one, or the one kept
        (:func:`resilienced.followup.rules.opens_new`); None when nothing was placed.
        """
        if result.refused or result.dry_run or result.capacity is Capacity.WAIT or not event.event_id:
            return None
        tries = 1
        while True:  # the move claim keeps other moves out, not a look's write of the record
            try:
                return await self._open(target, event=event, event_id=event.event_id, result=result, steps=steps)
            except RecordChanged:
                if tries >= OPEN_TRIES:
                    raise
                tries += 1

    async def _open(self, target: Target, *, event: Event, event_id: str, result: RequeueResult,
                    steps: StepResults) -> FollowUp:
        now = self.clock()
        existing = await self.read(target.run_key)
        if existing is not None and not opens_new(existing, event_id=event_id, event_time=event.time,
                                                  changed=result.changed):
            return existing
        if event.kind is Kind.CAPACITY_BLOCK_EXPIRY and event.capacity_reservation_id:
            target = replace(target, facts=replace(target.facts, exclude=tuple(dict.fromkeys(
                [*target.facts.exclude, event.capacity_reservation_id]))))
        elastic = bool(result.details.get("elastic"))
        stages = (Stage.TRAINING,) if elastic else stages_for(mode=self.options.mode, applier=result.kind)
        record = FollowUp(
            run=target.run_key, event_id=event_id, kind=event.kind.value, notice_at=event.time or now,
            opened_at=now, target=target_json(target), capacity=result.capacity.value,
            reservation_id=result.reservation_id, stages=tuple(s.value for s in stages), stage=stages[0].value,
            stage_since=now, unusable={k: v for k, v in (existing.unusable if existing else {}).items()
                                       if k in unusable_now(existing, now=now)},
            durable_step=steps.checkpoint_step, durable_world_size=steps.checkpoint_world_size,
            elastic=elastic, ledgers=existing.ledgers if existing is not None else (),
            bought={**(existing.bought if existing is not None else {}), **bought_by(result)},
            version=existing.version if existing is not None else None)
        record = await self._save(record)
        if existing is not None and not existing.ended:  # one record per run: the new one replaced it
            self._count_end("superseded")
            self._log.info("follow-up superseded", run=existing.run, event_id=existing.event_id,
                           by=event.event_id, stage=existing.stage)
        self._log.info("follow-up opened", run=record.run, event_id=record.event_id, capacity=record.where,
                       stages=list(record.stages))
        return record

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Follow until cancelled: one pass every ``interval_s`` (a failed pass is logged and retried)."""
        while True:
            try:
                await self.pass_once()
            except ResilienceError as e:
                self._log.warning("follow-up pass failed", error=str(e))
            await asyncio.sleep(self.options.interval_s)

    def _looks_at(self, record: FollowUp, now: datetime) -> bool:
        """Whether this pass looks at ``record`` (see the module doc): a record this replica wrote
        last, or of no known writer, or with a move to finish, always; another replica's once it
        waited in its stage ``min(bound / 2, TAKEOVER_PASSES x interval)``.  A writer that is gone
        delays the look that sees the run train again by that much; a fallback is not delayed
        (it comes at the stage's bound)."""
        if record.looked_by in (None, self.replica) or record.moving is not None:
            return True
        wait = min(self._half_bound(record), timedelta(seconds=TAKEOVER_PASSES * self.options.interval_s))
        return now - record.stage_since >= wait

    async def pass_once(self) -> list[FollowUp]:
        """One look at every open follow-up; returns the records as they are after it."""
        now = self.clock()
        records = []
        for data, version in await self.store.all():
            try:
                records.append(FollowUp.from_json(data, version=version))
            except ValueError as e:
                self._log.warning("follow-up record unreadable", error=str(e))
        looks = asyncio.Semaphore(max(1, self.options.looks_at_once))

        async def one(record: FollowUp) -> FollowUp | None:
            if record.ended:
                if record.ended_at is not None and now - record.ended_at > self.options.keep:
                    await self.store.delete(record.run, version=record.version or "")
                    return None
                return record
            if not self._looks_at(record, now):
                return record
            async with looks:
                return await self._follow(record)

        done = await asyncio.gather(*(one(r) for r in records), return_exceptions=True)
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:  # every look finished first: none is cut off mid-move
            raise failed
        after = [r for r in done if isinstance(r, FollowUp)]
        self._gauge(after)
        if self.ledger is not None:  # every replica: each run's goodput, from its newest ledger
            self.ledger.show([r.as_json() for r in after])
        return after

    def _gauge(self, records: list[FollowUp]) -> None:
        if self.metrics is None:
            return
        now = self.clock()
        counts = dict.fromkeys(GAUGE_STAGES, 0)
        for r in records:
            if not r.ended:
                counts[State.STUCK.value if r.state == State.STUCK.value else r.stage] += 1
        for stage, n in counts.items():
            self.metrics.recovering.labels(stage=stage).set(n)
        self.metrics.overdue.set(sum(overdue(r, now=now, bounds=self.options.bounds) for r in records))

    async def _follow(self, record: FollowUp) -> FollowUp:
        """One look at one run (the record as the pass listed it); the record as it is afterwards."""
        try:
            try:
                return await self._step(record)
            except (PermanentError, ValueError, KeyError) as e:  # the run is gone, cannot be moved or
                # decided for (a fact missing): nothing more to try; said on the run and notified
                return await self._stuck(record, f"the follow-up cannot go on: {type(e).__name__}: {e}")
        except RecordChanged as e:  # another replica's look, or a requeue, wrote it first
            self._log.info("follow-up record changed meanwhile", run=record.run, error=str(e))
            return record
        except ResilienceError as e:
            self._log.warning("follow-up step failed", run=record.run, error=str(e))
            return record

    async def _claimed(self, record: FollowUp, move: Callable[[FollowUp], Awaitable[FollowUp]]) -> FollowUp:
        """``move(fresh)`` under the run's move claim, on the record read again under it and unchanged
        since the look (``record.version``); else the record as it is (the run is looked at next pass)."""
        async with self.mover.moving(record.run, holder=f"{self.replica}{FOLLOW_UP_HOLDER}",
                                     ttl=self.options.claim_ttl_s) as held:
            if not held:
                return record  # another replica moves it now, or a notice's requeue does
            fresh = await self.read(record.run)
            if fresh is None or fresh.version != record.version:
                return fresh or record
            return await move(record)  # unchanged since the look: the look's record, its stages reached too

    async def _step(self, record: FollowUp) -> FollowUp:
        if record.moving is not None:
            record = await self._claimed(record, self._move)
            if record.moving is not None or record.ended or record.state == State.STUCK.value:
                return record
        if record.state == State.STUCK.value:  # watched for training, never moved again
            seen = await self._training(record)
            return await self._act(record, seen, Judgement("resumed" if seen.reached else "wait", seen.detail))
        stored = record.stage
        while True:  # the stages one look reaches are saved with its verdict: one write, not one per stage
            seen = await self._look(record)
            verdict = judge(record, seen, now=self.clock(), bounds=self.options.bounds,
                            max_fallbacks=self.options.max_fallbacks)
            if verdict.action == "advance":
                record = self._advance(record, seen)
                continue
            return await self._act(record, seen, verdict, advanced=record.stage != stored)

    async def _act(self, record: FollowUp, seen: StageSeen, verdict: Judgement, *, advanced: bool = False) -> FollowUp:
        if verdict.action == "resumed":
            return await self._resumed(record, seen)
        if verdict.action == "fall_back":
            return await self._claimed(record, lambda fresh: self._fall_back(fresh, verdict.reason))
        if verdict.action == "stuck":
            return await self._stuck(record, verdict.reason)
        # wait: the stages reached (the next one's bound counts from now, for this replica and one that
        # takes the follow-up over) and the evidence for status; no write when neither changed
        if advanced or (record.evidence != seen.detail and self._evidence_due(record)):
            record = await self._save(replace(record, evidence=seen.detail))
        return record

    def _evidence_due(self, record: FollowUp) -> bool:
        """Whether a wait in the stage it waited in before writes its new evidence: when the record has
        none for the stage yet, or once the stage has waited half its bound (a stall nears: status
        shows why).  Before that a look's progress ("3 of 10 worker pods bound") is not written each
        time it changes (issue #45: under load a run's record was written once per pod bound)."""
        if record.evidence is None or record.state == State.STUCK.value:
            return True
        return self.clock() - record.stage_since >= self._half_bound(record)

    def _half_bound(self, record: FollowUp) -> timedelta:
        """Half the bound of the record's stage: a stall nears (evidence is written, another replica looks)."""
        return self.options.bounds.of(Stage(record.stage)) / 2

    def _advance(self, record: FollowUp, seen: StageSeen) -> FollowUp:
        """``record`` at the stage after its current one, which ``seen`` reached; not saved here (the
        look's verdict saves it, issue #45: the record was written once per stage)."""
        now = self.clock()
        stages = list(record.stages)
        following = stages[stages.index(record.stage) + 1]
        self._log.info("follow-up stage reached", run=record.run, stage=record.stage, detail=seen.detail)
        return replace(record, stage=following, stage_since=now, evidence=None,
                       reached={**record.reached, record.stage: (seen.at or now).isoformat()})

    # ------------------------------------------------------------------ looks
    async def _look(self, record: FollowUp) -> StageSeen:
        stage = Stage(record.stage)
        if stage is Stage.TRAINING:
            return await self._training(record)
        target = target_from(record.target)
        capacity = Capacity(record.capacity)
        if stage is Stage.ADMITTED:
            return await self.progress.admitted(target, capacity=capacity, reservation_id=record.reservation_id)
        return await self.progress.placed(target, capacity=capacity, reservation_id=record.reservation_id,
                                          since=record.stage_since)

    async def _training(self, record: FollowUp) -> StageSeen:
        """The first attempt that trained a step after the notice, from the trainer's resume records."""
        uri = record.target.get("checkpoint_uri")
        if not uri or self.objects is None:
            return StageSeen(False, "training cannot be seen: " + ("the run names no checkpoint URI (annotation "
                             "resilienced.io/checkpoint-uri)" if not uri else "no object store configured"))
        bucket, prefix = parse_s3_uri(uri)
        folder = f"{prefix}{resume.FOLDER}/"
        after_ms = int(record.notice_at.timestamp() * 1000)
        names = sorted(o.key for o in await self.objects.list(bucket=bucket, prefix=folder)
                       if resume.is_record_name(o.key[len(folder):]) and int(o.key[len(folder):][:13]) >= after_ms)
        short = []
        for key in names:
            try:
                found = resume.parse(await self.objects.get(bucket=bucket, key=key), where=f"s3://{bucket}/{key}")
            except ObjectNotFound:
                continue  # pruned since the listing
            except ValueError as e:
                short.append(str(e))
                continue
            why = self._short_of(record, found)
            if why is None:
                return _trains(record, found)
            short.append(why)
        detail = "no attempt has trained a step since the notice" if not names else "; ".join(short[-3:])
        return StageSeen(False, detail, facts={"attempts_after_notice": len(names)})

    def _short_of(self, record: FollowUp, found: resume.ResumeRecord) -> str | None:
        """Why an attempt does not count as the run training again (None: it counts)."""
        if found.world_size < found.min_world_size:
            return f"attempt {found.attempt_id[:8]} trained at world size {found.world_size}, below its minimum {found.min_world_size}"
        elastic = bool((record.target.get("facts") or {}).get("elastic"))
        if not elastic and record.durable_world_size and found.world_size < record.durable_world_size:
            return (f"attempt {found.attempt_id[:8]} trained at world size {found.world_size}, smaller than the "
                    f"{record.durable_world_size} the run saved at")
        return None

    # ------------------------------------------------------------------ ends and moves
    async def _resumed(self, record: FollowUp, seen: StageSeen) -> FollowUp:
        now = self.clock()
        at = seen.at or now
        record, led = await self._end(replace(
            record, state=State.RESUMED.value, ended_at=now, reason=seen.detail, evidence=None,
            reached={**record.reached, Stage.TRAINING.value: at.isoformat()},
            resumed={**seen.facts, "at": at.isoformat()}))
        seconds = record.seconds_from_notice(at)
        self._count_end("resumed")
        if self.metrics is not None:
            self.metrics.training_again.observe(max(0.0, seconds))
        message = f"run {record.run} trains again on {record.where}, {seconds:.0f}s after the notice: {seen.detail}"
        await self._event(record, REASON_TRAINING_RESUMED, message, warning=False, key="resumed")
        self._notify(record, outcome="resumed", reason=seen.detail, seconds=seconds, ledger=led)
        self._log.info("follow-up ended: training again", run=record.run, seconds_from_notice=seconds,
                       stages=record.stage_seconds(), fallbacks=len(record.fallbacks))
        return record

    async def _stuck(self, record: FollowUp, reason: str) -> FollowUp:
        record, led = await self._end(replace(record, state=State.STUCK.value, reason=reason, moving=None))
        self._count_end("stuck")
        message = (f"run {record.run} is stuck at stage {record.stage} on {record.where}: {reason}; it is no "
                   "longer moved (still watched for training)")
        await self._event(record, REASON_RECOVERY_STUCK, message, warning=True, key="stuck")
        self._notify(record, outcome="stuck", reason=reason, ledger=led)
        self._log.warning("follow-up stuck", run=record.run, stage=record.stage, reason=reason)
        return record

    async def _end(self, ended: FollowUp) -> tuple[FollowUp, Ledger | None]:
        """Save the follow-up's end with the recovery's ledger kept in it: one write (issue #45: the
        ledger was a second write after the end).  A ledger that cannot be computed (logged and
        counted by the keeper, never retried) leaves the end saved without it."""
        if self.ledger is None:
            return await self._save(ended), None
        data = ended.as_json()
        led = await self.ledger.compute(data, at=self.clock())
        if led is not None:
            ended = replace(ended, ledgers=tuple(self.ledger.with_ledger(data, led)["ledgers"]))  # type: ignore[arg-type]
        record = await self._save(ended)
        if led is not None:
            self.ledger.kept(led)
        return record, led

    async def _fall_back(self, record: FollowUp, reason: str) -> FollowUp:
        """Mark the stalled capacity unusable for the run, decide again, record the move, make it."""
        now = self.clock()
        key = stalled_key(record.capacity, record.reservation_id)
        record = replace(record, unusable={**record.unusable, key: (now + self.options.cooldown).isoformat()})
        n = len(record.fallbacks) + 1
        target = target_from(record.target, exclude=unusable_now(record, now=now))
        notice = Event(kind=Kind(record.kind), event_id=record.event_id, time=record.notice_at)
        decision = await self.mover.fallback(target, event=notice)
        if not decision.places:
            return await self._stuck(record, f"{reason}; nothing to fall back to: {decision.reason}")
        record = await self._save(replace(record, moving={
            "to": decision.as_json(), "event_id": self._fallback_event(record, n).event_id, "from": record.where,
            "from_capacity": record.capacity, "stage": record.stage, "reason": reason}))
        return await self._move(record)

    async def _move(self, record: FollowUp) -> FollowUp:
        """Apply the move ``record.moving`` names (again, if a replica died after applying it)."""
        moving = dict(record.moving or {})
        decision = _decision(moving["to"])
        target = target_from(record.target, exclude=unusable_now(record, now=self.clock()))
        event = Event(kind=Kind(record.kind), event_id=moving["event_id"], time=record.notice_at)
        result = await self.mover.apply(target, decision=decision, event=event,
                                        withdraw=(Capacity(record.capacity), record.reservation_id))
        if result.refused or result.capacity is Capacity.WAIT:
            return await self._stuck(record, f"{moving['reason']}; the move to {decision.capacity.value} "
                                             f"did not place the run: {result.reason}")
        now = self.clock()
        to = result.capacity.value + (f" {result.reservation_id}" if result.reservation_id else "")
        fallback = {"from": moving["from"], "to": to, "reason": moving["reason"], "stage": moving["stage"],
                    "at": now.isoformat()}
        record = await self._save(replace(
            record, capacity=result.capacity.value, reservation_id=result.reservation_id, moving=None,
            bought={**record.bought, **bought_by(result)},
            fallbacks=(*record.fallbacks, fallback), stage=record.stages[0], stage_since=now, reached={},
            evidence=None))
        if self.metrics is not None:
            self.metrics.fallbacks.labels(**{"from": moving.get("from_capacity", moving["from"].split()[0]),
                                             "to": result.capacity.value, "reason": moving["stage"]}).inc()
        message = (f"run {record.run}: {moving['reason']}; moved from {moving['from']} to {to} "
                   f"(fallback {len(record.fallbacks)} of at most {self.options.max_fallbacks})")
        await self._event(record, REASON_RECOVERY_STALLED, message, warning=True,
                          key=f"fallback-{len(record.fallbacks)}")
        self._notify(record, outcome="fell back", reason=message)
        self._log.warning("follow-up fell back", run=record.run, **fallback)
        return record

    # ------------------------------------------------------------------ helpers
    def _fallback_event(self, record: FollowUp, n: int) -> Event:
        return Event(kind=Kind(record.kind), event_id=f"{record.event_id}/fallback-{n}", time=record.notice_at)

    async def _save(self, record: FollowUp) -> FollowUp:
        record = replace(record, looked_by=self.replica)
        version = await self.store.put(record.run, record.as_json(), version=record.version)
        if version is None:
            raise RecordChanged(f"the follow-up of {record.run} was changed by another replica; looked at again "
                                "next pass", delay=self.options.interval_s)
        return replace(record, version=version)

    def _count_end(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.ends.labels(outcome=outcome).inc()

    async def _event(self, record: FollowUp, reason: str, message: str, *, warning: bool, key: str) -> None:
        try:
            await self.cluster.record(target_from(record.target), reason=reason, message=message, warning=warning,
                                      once=f"{record.event_id}/{record.run}/{key}")
        except ResilienceError as e:  # an Event is a courtesy: the follow-up itself is recorded
            self._log.warning("recording an event failed", run=record.run, reason=reason, error=str(e))

    def _notify(self, record: FollowUp, *, outcome: str, reason: str, seconds: float | None = None,
                ledger: Ledger | None = None) -> None:
        if self.notifier is None:
            return
        facts = record.target.get("facts") or {}
        resumed = record.resumed or {}
        self.notifier.submit({
            "event_id": record.event_id, "kind": record.kind, "time": self.clock().isoformat(),
            "instances": list(facts.get("instance_ids") or [record.target.get("instance_id")]),
            "run": record.run, "drained": None,
            "checkpoint_step": resumed.get("resumed_from_step", record.durable_step), "durable": None,
            "steps_lost": None, "capacity": record.where, "capacity_reason": reason, "outcome": outcome,
            "reason": reason, "stage": record.stage,
            "seconds_from_notice": round(seconds) if seconds is not None else None,
            **(notification_facts(ledger) if outcome in ("resumed", "stuck") else {})})


def bought_by(result: RequeueResult) -> dict[str, JsonValue]:
    """The Capacity Block a move bought, by its reservation id -> its offering (the ledger's price)."""
    offering = result.decision.offering if result.decision is not None else None
    if offering is None or not result.reservation_id:
        return {}
    return {result.reservation_id: result.decision.as_json()["offering"]}  # type: ignore[union-attr]


def _trains(record: FollowUp, found: resume.ResumeRecord) -> StageSeen:
    at = datetime.fromtimestamp(found.started_at_unix, tz=timezone.utc)
    step = ("from scratch" if found.resumed_from_step is None else f"from step {found.resumed_from_step}")
    behind = ""
    if record.durable_step is not None and (found.resumed_from_step or 0) < record.durable_step:
        behind = f", older than the durable step {record.durable_step}"
    return StageSeen(True, f"attempt {found.attempt_id[:8]} trained step {found.first_step} at world size "
                           f"{found.world_size}, resumed {step}{behind}", at=at,
                     facts={"resumed_from_step": found.resumed_from_step, "world_size": found.world_size,
                            "attempt_id": found.attempt_id})


def _decision(data: Mapping[str, Any]) -> CapacityDecision:
    """The decision a follow-up record's ``moving.to`` holds (``CapacityDecision.as_json``)."""
    return CapacityDecision(capacity=Capacity(data["capacity"]), reason=str(data.get("reason") or ""),
                            reservation_id=data.get("reservation_id"))
