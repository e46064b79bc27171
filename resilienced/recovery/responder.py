"""Acting on a plan: locate the runs, signal them, wait for a durable checkpoint, requeue the gang.

:class:`Recovery` is the real :class:`~resilienced.ports.Responder`.  For one plan:

1. **locate** (:func:`~resilienced.recovery.targets.find_targets`, the path ``replay`` takes too):
   the plan's instances (for a Capacity Block expiry, the reservation's instances from EC2) ->
   the Ray Train runs on them (:meth:`Cluster.locate`), grouped per run: several instances of one
   run are one gang and are handled together;
2. per run: a notice of a run this replica handles now joins that handling (``recovery.waves``:
   its own instances cordoned and drained, added to the run's move unless it began, the outcome
   shared; no claim and no Event of its own); else it leads the run's handling, under a claim
   ``run/<event id>/<run>`` (cross-replica idempotency: a run already
   done for this event is skipped; one held by another delivery is retried later, never skipped):

   * NOTIFY: an Event on the run, nothing else;
   * SIGNAL: cordon the nodes, then drain the run's Ray nodes on those instances through the
     run's GCS with reason PREEMPTION and the event's deadline (Ray Train turns that into
     ``get_preemption_info()`` in every rank, which saves the step it is on);
   * DURABLE: wait until a checkpoint saved after the notice is in S3 (manifest and every file),
     else record the newest durable one from before the notice and the steps that costs;
   * REQUEUE: for an instance already gone (state change), find the newest durable checkpoint
     the run will resume from; move the run (``recovery.move.Mover``: decide the capacity, Spot /
     Capacity Block / On-Demand / wait, and apply it to the whole gang), under the run's move
     claim; then open the run's follow-up
     (``followup.follower.Follower``), which watches it until it trains again and falls back
     when it stalls, long after this message is deleted;

3. COMPLETE_LIFECYCLE: tell the Auto Scaling group it may go on terminating (also when no run
   was found: the instance is released either way); while step 2 goes on, heartbeats keep the
   hook waiting (``recovery.heartbeat``: its heartbeat timeout may be shorter than the save).

Every step is idempotent on its own as well (a node already draining with an earlier deadline is
not drained again; a durable checkpoint is found again at once; a requeue applied twice changes
nothing), so a retry after a partial failure redoes nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram

from handlers import asg_lifecycle, capacity_block_expiry
from resilienced import log
from resilienced.claims import HeldClaim, held_claim, not_free
from resilienced.clock import utcnow
from resilienced.recovery.durable import DurableResult, newest_durable, wait_durable
from resilienced.followup.follower import FOLLOW_UP_HOLDER, Follower
from resilienced.recovery.heartbeat import hook_kept_alive
from resilienced.recovery.move import Mover
from resilienced.recovery.steps import (
    DurableStep,
    FollowUpStep,
    NotifyStep,
    RequeueStep,
    ResumeStep,
    SignalStep,
    StepResults,
)
from resilienced.recovery.targets import Targets, find_targets
from resilienced.recovery.waves import Wave, Waves
from resilienced.errors import (
    PermanentError,
    ResilienceError,
    TemporaryError,
    backends_of,
)
from resilienced.model import Capacity, Event, JsonValue, Kind, Outcome, Plan, Result, Step, Target
from resilienced.ops.notify import Notifier
from resilienced.ports import (
    CapacitySource,
    Claim,
    ClaimStore,
    Cluster,
    CordonClaims,
    ExportTasks,
    LifecycleHooks,
    ObjectStore,
    RayControl,
)
from resilienced.ops.run_record import RunRecord
from resilienced.settings import ExportMode, QueueSettings, RecoverySettings, Settings

#: How often, and how long at most, a notice whose run another notice's delivery is handling looks
#: whether that handling has moved the run (a read each time; the handling holds the move claim from
#: its start: the save before the notice's deadline, then a few seconds of Kueue's and KubeRay's work).
MOVE_POLL_S = 1.0
MOVE_WAIT_S = 300.0
#: Between a delivery (``<replica>/<message id>``) and its event id in the holder of a move claim a
#: handling holds from its start (``Responder._lead_moving``): ``<replica>/<message id>#event=<id>``.
EVENT_MARK = "#event="

#: Reasons of the Kubernetes Events resilienced records (kubernetes mode; logged in ray mode).
REASON_NOTICE = "InterruptionNotice"
REASON_DRAINING = "Draining"
REASON_DURABLE = "CheckpointDurable"
REASON_NOT_DURABLE = "CheckpointNotDurable"
REASON_RESUME_POINT = "ResumePoint"

NOTIFY_REASONS = {Kind.REBALANCE_RECOMMENDATION: "RebalanceRecommendation"}

DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1800)


#: The settings' defaults, the options' defaults.
_RECOVERY, _QUEUE = RecoverySettings(), QueueSettings()


@dataclass(frozen=True)
class RecoveryOptions:
    """How the steps behave: ``RecoverySettings`` in the steps' terms, made by :meth:`from_settings`
    (the defaults are the settings').

    ``durable_grace_seconds``: how long after the deadline S3 is still watched (FSx may still be
    exporting what the run saved just before the node went).  ``checkpoint_ahead_seconds``: the
    drain deadline given when a plan has none (``--rebalance-policy checkpoint-ahead``).
    ``export_paths``: maps a run's checkpoint URI to the FSx paths an export task exports
    (``--export-mode task``); None: auto-export.  ``claim_ttl_seconds``: TTL of a run claim,
    renewed every third of it while its holder works (the daemon passes the queue's visibility
    timeout, as for event claims), so a killed replica's run is taken over within it.
    ``node_join_seconds``: per capacity kind, the seconds a replacement node takes to join before
    the daemon has measured any (the prior of an elastic run's replacement estimate, given to
    ``ray.replacement.ReplacementAnnouncer``).
    """

    durable_grace_seconds: float = _RECOVERY.durable_grace_seconds
    durable_poll_seconds: float = _RECOVERY.durable_poll_seconds
    checkpoint_ahead_seconds: float = _RECOVERY.checkpoint_ahead_seconds
    claim_ttl_seconds: float = float(_QUEUE.visibility_timeout)
    file_system_id: str | None = None
    export_paths: Callable[[str], Sequence[str]] | None = None
    node_join_seconds: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> RecoveryOptions:
        """The options of ``settings.recovery``; run claims live as long as the queue's visibility timeout."""
        rs = settings.recovery
        return cls(durable_grace_seconds=rs.durable_grace_seconds, durable_poll_seconds=rs.durable_poll_seconds,
                   checkpoint_ahead_seconds=rs.checkpoint_ahead_seconds,
                   claim_ttl_seconds=float(settings.queue.visibility_timeout), file_system_id=rs.fsx_file_system_id,
                   export_paths=rs.export_paths if rs.export_mode is ExportMode.TASK else None,
                   node_join_seconds=rs.node_join_priors)


class RecoveryMetrics:
    """The step metrics, on the daemon's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.drains = Counter("resilienced_drains", "Ray node drains sent, by outcome "
                              "(accepted, already_draining, rejected).", ["outcome"], registry=registry)
        self.durable = Counter("resilienced_checkpoints", "Checkpoint checks after a notice, by "
                               "outcome (durable, not_durable, no_checkpoint_uri).", ["outcome"],
                               registry=registry)
        self.notice_to_durable = Histogram(
            "resilienced_notice_to_durable_seconds",
            "Seconds from the interruption notice to a verified checkpoint in S3.",
            buckets=DURATION_BUCKETS, registry=registry)
        self.notice_to_checkpoint = Histogram(
            "resilienced_notice_to_checkpoint_seconds",
            "Seconds from the interruption notice to the save of the checkpoint that became "
            "durable (the manifest's time).", buckets=DURATION_BUCKETS, registry=registry)
        self.steps_lost = Counter("resilienced_steps_lost", "Steps repeated because the "
                                  "newest durable checkpoint predates the notice (a lower bound).",
                                  registry=registry)
        for outcome in ("accepted", "already_draining", "rejected"):
            self.drains.labels(outcome=outcome)
        for outcome in ("durable", "not_durable", "no_checkpoint_uri"):
            self.durable.labels(outcome=outcome)


#: Why :meth:`Recovery.needs_event_claim` said a plan needs no event claim: it joins its run's
#: handling in this replica (``join``), its Node's cordon decides it (``cordon``, a plan that hits no
#: run), or its one run's claim stands for the event claim (``run``).
Located = Literal["join", "cordon", "run"]


def _no_run(found: Targets) -> str:
    """The reason of a plan that hits no run: each instance's why."""
    why = "; ".join(f"{i}: {r}" for i, r in found.unresolved.items()) or "no instances to act on"
    return f"no Ray run on the affected instances ({why})"


class RunHeld(TemporaryError):
    """The run's claim for this event was not free: ``existing`` as the look found it (held by
    another delivery, or done; None: let go between the try and the look)."""

    def __init__(self, message: str, *, existing: Claim | None, delay: float) -> None:
        super().__init__(message, delay=delay)
        self.existing = existing


@dataclass
class RunReport:
    """What happened to one run (logged, kept in the claim, returned in the outcome): each step's
    typed result in ``steps`` (``recovery.steps``), JSON only in :meth:`as_json`."""

    run: str
    instances: list[str]
    steps: StepResults = StepResults()
    skipped: str | None = None
    joined: str | None = None  # the event whose handling of the run this notice joined (recovery.waves)
    record: RunRecord | None = None  # what the done claim keeps
    done: Claim | None = None  # the run's claim for this event, found done (skipped)

    def as_json(self) -> dict[str, JsonValue]:
        out: dict[str, JsonValue] = {"run": self.run, "instances": list(self.instances), **self.steps.as_json()}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.joined:
            out["joined"] = self.joined
        return out


class Recovery:
    """The responder that makes plans act.

    Args:
        cluster: where runs are found (kubernetes or ray mode).
        claims: cross-replica idempotency per (event, run).
        ray_control: the GCS adapter for a target's Ray cluster.
        store: S3, where checkpoints become durable (None: the durable step is skipped with a
            warning; never trusted).
        mover: decides and applies the move of a run (``recovery.move``; None: the requeue step
            only says it cannot act).
        capacity: the EC2 side, to find a Capacity Block's instances.
        export: FSx export tasks (``--export-mode task``); None: DRA auto-export.
        lifecycle: Auto Scaling, for terminate hooks.
        notifier: the webhook (``--notify-webhook``), told once per run handled (done or
            failed); it queues and returns at once, so it never delays the recovery.
        follower: the follow-up after the requeue (None: a recovery ends with the requeue).
    """

    def __init__(
        self,
        *,
        cluster: Cluster,
        claims: ClaimStore,
        ray_control: Callable[[Target], Awaitable[RayControl]],
        store: ObjectStore | None = None,
        mover: Mover | None = None,
        capacity: CapacitySource | None = None,
        export: ExportTasks | None = None,
        lifecycle: LifecycleHooks | None = None,
        options: RecoveryOptions = RecoveryOptions(),
        metrics: RecoveryMetrics | None = None,
        notifier: Notifier | None = None,
        follower: Follower | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.cluster = cluster
        self.claims = claims
        self.ray_control = ray_control
        self.store = store
        self.mover = mover
        self.capacity = capacity
        self.export = export
        self.lifecycle = lifecycle
        self.options = options
        self.metrics = metrics
        self.notifier = notifier
        self.follower = follower
        self.clock = clock
        self._log = log.get("resilienced.recovery")
        self.waves: Waves[RunReport] = Waves()  # the runs this replica handles now
        # what needs_event_claim located for a plan it needs no claim for, by the plan's id (the entry
        # keeps the plan alive, so no other plan has that id meanwhile), and whether the plan's cordon
        # decides it: its act follows at once and takes it (a claimed plan's act comes after the
        # claim, which may take a while: it locates again, on fresh caches and Ray node ids)
        self._located: dict[int, tuple[Plan, Targets, Located]] = {}

    # ------------------------------------------------------------------ the plan
    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        event = plan.event
        located, how = self._take_located(plan)
        if located is not None and how == "cordon":
            return await self._decide_by_cordon(plan, located)
        found = located or await find_targets(plan, cluster=self.cluster, capacity=self.capacity)
        instance_ids, runs = found.instance_ids, found.runs
        async with hook_kept_alive(self.lifecycle, plan) as beats:  # an ASG hook waits for the save
            outcomes = await asyncio.gather(*(self._run(plan, run, holder=holder) for run in runs),
                                            return_exceptions=True)
        self.settled(plan)  # a wave reserved for a run this act did not find (moved since) is dropped
        if how == "run" and len(runs) == 1:
            copy = self._copy_of(plan, outcomes[0], holder=holder)
            if copy is not None:
                return copy
        cordoned = await self._cordon_runless(plan, found)
        reports: list[JsonValue] = []
        temporary: list[TemporaryError] = []
        permanent: list[str] = []
        for run, got in zip(runs, outcomes):
            if isinstance(got, TemporaryError):
                temporary.append(got)
                reports.append({"run": run.run_key, "retry": str(got)})
            elif isinstance(got, PermanentError):
                permanent.append(f"{run.run_key}: {got}")
                reports.append({"run": run.run_key, "failed": str(got)})
                self._tell(RunRecord.of(event, run=run.run_key, instances=run.facts.instance_ids,
                                        steps=StepResults(), outcome="failed", at=self.clock(), reason=str(got)))
            elif isinstance(got, BaseException):
                raise got
            else:
                reports.append(got.as_json())
                if got.record is not None:
                    self._tell(got.record)
        lifecycle = None
        if Step.COMPLETE_LIFECYCLE in plan.steps and not temporary:
            lifecycle = await self._complete_lifecycle(plan)
        details: dict[str, JsonValue] = {"runs": reports, "unresolved": dict(found.unresolved),
                                   "instances": list[JsonValue](instance_ids)}
        if cordoned:
            details["cordoned"] = list[JsonValue](cordoned)
        if lifecycle:
            details["lifecycle"] = lifecycle
        if beats:
            details["lifecycle_heartbeats"] = beats.count("recorded")
        self._log.info("recovery", event_id=event.event_id, kind=event.kind.value, **details)
        if temporary:
            delays = [t.delay for t in temporary if t.delay is not None]
            raise TemporaryError("; ".join(str(t) for t in temporary),
                                 delay=min(delays) if delays else None,
                                 backends=tuple(b for t in temporary for b in backends_of(t)))
        if not runs and how is None and event.event_id:  # under its event claim: a copy handled through a run?
            handled = await self.claims.done(f"run/{event.event_id}/")
            if handled:
                return Outcome(result=Result.DUPLICATE, event=event, plan=plan, details=details,
                               reason=f"event {event.event_id} already handled by {handled[0].holder} "
                                      f"(run claim {handled[0].key}); its run has gone since")
        if not runs:
            return Outcome(result=Result.NOT_ACTIONABLE, event=event, plan=plan,
                           reason=_no_run(found), details=details)
        if permanent:
            return Outcome(result=Result.FAILED, event=event, plan=plan,
                           reason="; ".join(permanent), details=details)
        return Outcome(result=Result.DONE, event=event, plan=plan, details=details,
                       reason=f"{len(runs)} run(s): " + ", ".join(r.run_key for r in runs))

    # ------------------------------------------------------------------ one run
    async def needs_event_claim(self, plan: Plan) -> bool:
        """Whether ``plan`` needs the consumer's event claim (``ports.SharesClaims``).

        Not when every run it hits is handled in this replica now by a wave that does its steps
        (it joins that handling, which holds the run claim); not when it hits one run: that run's
        claim (``run/<event id>/<run>``, taken before any step, completed with the run's record)
        stands for the event claim, and a copy of the event finds it (:meth:`_copy_of`: a
        duplicate, as under the event claim; issue #45: two Lease writes fewer per run); not when
        it hits no run and its Node's cordon decides it (:meth:`_cordon_decides`).  A plan of
        several runs, a terminate hook (completed once per event) and a plan that cannot be
        located now are claimed as before.  A run it hits with no wave gets one reserved for this
        plan (``recovery.waves``), which it leads (at once, or once its claim is held), so the
        run's other notices asking meanwhile join it instead of claiming too; the consumer calls
        :meth:`settled` when a claimed delivery's handling is over.
        """
        if Step.COMPLETE_LIFECYCLE in plan.steps:
            return True
        try:
            found = await find_targets(plan, cluster=self.cluster, capacity=self.capacity)
        except Exception as e:  # noqa: BLE001 - the act meets it again (under the claim) and says why
            if not isinstance(e, ResilienceError):  # a bug: said loudly here too
                self._log.error("locating a plan failed", event_id=plan.event.event_id,
                                error=f"{type(e).__name__}: {e}", exc_info=e)
            return True
        if self._cordon_decides(plan, found):
            self._located[id(plan)] = (plan, found, "cordon")
            return False
        joins = bool(found.runs)
        for run in found.runs:  # no await from here on: one notice of a run reserves its wave
            wave = self.waves.current(run.run_key)
            if self._joins(plan, wave):
                continue
            joins = False
            if wave is None and plan.event.event_id:
                self.waves.reserve(run.run_key, event_id=plan.event.event_id, steps=plan.steps)
        if joins:
            self._located[id(plan)] = (plan, found, "join")
            return False
        if len(found.runs) == 1 and plan.event.event_id:  # its run claim stands for the event claim
            self._located[id(plan)] = (plan, found, "run")
            return False
        return True

    def settled(self, plan: Plan) -> None:
        """This delivery of ``plan`` is over, acted on or not (its event claim was another's): the
        waves reserved for it and not led are dropped, their joiners retried (``ports.SharesClaims``)."""
        if plan.event.event_id:
            self.waves.unreserve(plan.event.event_id)

    def _cordon_decides(self, plan: Plan, found: Targets) -> bool:
        """Whether the notice ``plan``, which hits no run, is decided by its cordon instead of an
        event claim (``ports.CordonClaims``, issue #45: a gang's notices handled after its move find
        their pods gone): it names one instance and cordons it, and that instance's Node is in the
        cluster's cache without resilienced's cordon (or with the one that decided this event)."""
        event_id = plan.event.event_id
        return (event_id is not None and not found.runs and len(found.instance_ids) == 1
                and Step.SIGNAL in plan.steps and isinstance(self.cluster, CordonClaims)
                and self.cluster.cordon_claimable(found.instance_ids[0], event_id=event_id))

    async def _decide_by_cordon(self, plan: Plan, found: Targets) -> Outcome:
        """Cordon the one instance of ``plan`` (which hits no run) naming its event: the cordon is the
        decision (``not_actionable``, as under an event claim); the cordon of a copy of the event
        makes this one a ``duplicate``; a Node cordoned otherwise (or gone) meanwhile sends the
        notice back to be decided under its event claim."""
        event, instance, event_id = plan.event, found.instance_ids[0], plan.event.event_id
        assert isinstance(self.cluster, CordonClaims) and event_id is not None
        bare = Target(instance_id=instance, node=None, ray_cluster=None, ray_job=None, ray_node_ids=(),
                      checkpoint_uri=None)
        got = await self.cluster.cordon_claim(instance, event_id=event_id, reason=event.kind.value,
                                              deadline=self._deadline(plan, bare))
        details: dict[str, JsonValue] = {"runs": [], "unresolved": dict(found.unresolved),
                                         "instances": [instance], "decided_by": f"cordon: {got}"}
        if got == "decided":
            return Outcome(result=Result.DUPLICATE, event=event, plan=plan, details=details,
                           reason=f"event {event.event_id} already handled: the Node of {instance} carries "
                                  "the cordon that decided it")
        if got != "cordoned":
            return Outcome(result=Result.RETRY, event=event, plan=plan, retry_delay=0, details=details,
                           reason=f"the Node of {instance} was {'cordoned for another notice' if got == 'taken' else 'gone'}"
                                  " meanwhile: the notice is decided under its event claim on its next delivery")
        details["cordoned"] = [instance]
        self._log.info("recovery", event_id=event.event_id, kind=event.kind.value, **details)
        return Outcome(result=Result.NOT_ACTIONABLE, event=event, plan=plan, details=details,
                       reason=_no_run(found))

    def _take_located(self, plan: Plan) -> tuple[Targets | None, Located | None]:
        """What :meth:`needs_event_claim` located for this very ``plan`` (once), and why it needs no
        event claim; (None, None) when it kept nothing for it (the plan is under its event claim)."""
        kept = self._located.pop(id(plan), None)
        return (kept[1], kept[2]) if kept is not None and kept[0] is plan else (None, None)

    def _copy_of(self, plan: Plan, got: RunReport | BaseException, *, holder: str) -> Outcome | None:
        """For a plan of one run whose run claim stood for its event claim: the outcome the event
        claim would have given a copy of the event (:func:`claims.not_free`, the consumer's rule):
        the run found done for the event, or held by another delivery, or held by an earlier
        delivery of this very message.  None: not a copy (the run was handled here)."""
        if isinstance(got, RunReport) and got.done is not None:
            existing: Claim | None = got.done
        elif isinstance(got, RunHeld):
            existing = got.existing
        else:
            return None
        outcome = not_free(plan, existing, holder=holder, what="the event's run",
                           held_delay=self.options.claim_ttl_seconds)
        return replace(outcome, details={"runs": [got.as_json()]}) if isinstance(got, RunReport) else outcome

    @staticmethod
    def _joins(plan: Plan, wave: Wave[RunReport] | None) -> bool:
        """Whether ``plan`` joins ``wave``: it does the plan's steps, and the plan's event is not in
        it already (a copy of an event goes the claims' way: a duplicate, or a retry)."""
        return wave is not None and wave.covers(plan.steps) and plan.event.event_id not in wave.events

    async def _run(self, plan: Plan, target: Target, *, holder: str) -> RunReport:
        """A notice of a run this replica handles now joins that handling (``recovery.waves``);
        else it leads the run's handling (:meth:`_lead`), which later notices join."""
        wave = self.waves.current(target.run_key)
        if self._joins(plan, wave):
            assert wave is not None
            return await self._join(plan, target, wave)
        if wave is not None and not self.waves.reserved_for(target.run_key, plan.event.event_id):
            # under way for fewer steps (a notify-only notice), or a copy: as before
            return await self._lead(plan, target, holder=holder, wave=None)
        async with self.waves.lead(target.run_key, event_id=plan.event.event_id, steps=plan.steps) as wave:
            report = await self._lead(plan, target, holder=holder, wave=wave)
            wave.finish(report)
            return report

    async def _join(self, plan: Plan, target: Target, wave: Wave[RunReport]) -> RunReport:
        """Join ``wave``: cordon and drain this notice's own instances, add them to the run's move
        unless it began, and share the wave's outcome; no claim and no Event of its own."""
        event = plan.event
        report = RunReport(run=target.run_key, instances=list(target.facts.instance_ids), joined=wave.event_id)
        if event.event_id:
            wave.events.add(event.event_id)
        if Step.SIGNAL in plan.steps:
            await self._signal(plan, target, report, record=False)
        in_move = wave.join(target)
        try:
            await asyncio.shield(wave.ended)
        except TemporaryError as e:
            raise TemporaryError(f"{e} (this notice joined the handling of run {target.run_key} for event "
                                 f"{wave.event_id})", delay=e.delay, backends=backends_of(e)) from e
        # without a mover nothing is moved: a notice that joined late has nothing to be left out of
        if not in_move and self.mover is not None and not self._moves_whole_gangs(target):
            raise TemporaryError(f"run {target.run_key} was being moved for event {wave.event_id} when this "
                                 "notice joined: its instances are looked at again", delay=1.0)
        return report

    async def _moved_since(self, target: Target, event: Event) -> str | None:
        """The event another notice moved ``target``'s run for after ``event`` was sent, from the
        run's follow-up record (None: not known to be moved).  A retried notice whose RayCluster
        the move's suspension deleted is then done with that move, not failed (issue #45)."""
        if self.follower is None or event.time is None:
            return None
        try:
            record = await self.follower.read(target.run_key)
        except ResilienceError:
            return None
        if record is None or record.event_id == event.event_id or record.opened_at < event.time:
            return None
        return record.event_id

    async def _moved_meanwhile(self, target: Target, event: Event) -> str | None:
        """The event another delivery moved ``target``'s run for after ``event`` (:meth:`_moved_since`),
        once the run's move claim, held by that delivery now, is let go: waited for at most
        :data:`MOVE_WAIT_S` (a live holder renews it through its save and move; a dead one's lapses
        within its TTL, and the look then finds it free), a read a second (issue #45: a gang's notices split between two replicas each led a
        handling of the run; the one that found the move claim held was retried, and each of its
        notices, its run gone by then, took an event claim of its own).  Only where a move takes the
        whole gang (kubernetes mode, not elastic: this notice's instances were in it) and the run is
        followed (its record says who moved it, and when); None: not known to be moved."""
        if self.mover is None or self.follower is None or not self._moves_whole_gangs(target):
            return None
        store, key = self.mover.claims or self.claims, self.mover.move_key(target.run_key)
        loop = asyncio.get_running_loop()
        until = loop.time() + MOVE_WAIT_S
        while True:
            try:
                held = await store.get(key)
            except ResilienceError:
                return None
            if held is None or held.state == "done":
                return await self._moved_since(target, event)
            if held.holder.endswith(FOLLOW_UP_HOLDER) or loop.time() >= until:
                return None  # a fallback of the follow-up: its own move, not this notice's (retried)
            await asyncio.sleep(min(MOVE_POLL_S, max(0.0, until - loop.time())))

    def _moves_whole_gangs(self, target: Target) -> bool:
        """Whether a move of ``target``'s run takes every worker (kubernetes mode, not elastic): a
        notice that joined after the move began is then in it all the same."""
        return self.mover is not None and self.mover.kind == "kubernetes" and target.facts.elastic is not True

    async def _cordon_runless(self, plan: Plan, found: Targets) -> list[str]:
        """Cordon the Nodes of the plan's instances that run no Ray pod of a run (any more: a notice
        handled after its run was moved finds the pods deleted, issue #45); the instances whose node
        carries the cordon (none without a Node, nor in ray mode: nothing to cordon there)."""
        if Step.SIGNAL not in plan.steps:
            return []
        lone = [i for i in found.instance_ids if i in found.unresolved]
        bare = [Target(instance_id=i, node=None, ray_cluster=None, ray_job=None, ray_node_ids=(),
                       checkpoint_uri=None) for i in lone]
        marked = await asyncio.gather(*(self.cluster.cordon(t, reason=plan.event.kind.value,
                                                             deadline=self._deadline(plan, t)) for t in bare))
        return [i for i, done in zip(lone, marked) if done]

    async def _lead(self, plan: Plan, target: Target, *, holder: str, wave: Wave[RunReport] | None) -> RunReport:
        """The run's steps under its run claim (``claims.held_claim``: renewed every third of its
        TTL while the steps go on; a replica that lost it takes no further step and does not
        complete it, docs/reliability.md, the fencing fix; a step under way when it is lost
        finishes, every step is idempotent).

        A run moved with its whole gang and followed (:meth:`_moves_early`) is led under its move
        claim instead (:meth:`_lead_moving`), unless the follow-up holds that claim now."""
        event = plan.event
        report = RunReport(run=target.run_key, instances=list(target.facts.instance_ids))
        key = f"run/{event.event_id}/{target.run_key}"
        if self._moves_early(plan, target):
            led = await self._lead_moving(plan, target, report, key=key, holder=holder, wave=wave)
            if led is not None:
                return led
        ttl = self.options.claim_ttl_seconds
        async with held_claim(self.claims, key, holder=holder, ttl_seconds=ttl, logger=self._log) as held:
            if held is None:
                existing = await self.claims.get(key)
                if existing is not None and existing.state == "done":
                    return self._done_already(report, existing)
                who = existing.holder if existing is not None else "another delivery"
                # a live holder renews its claim; a dead one's lapses within ttl: look again then, not
                # sooner (each look is a receive, and the redrive policy counts them)
                raise RunHeld(f"run {target.run_key} for event {event.event_id} is being handled by {who}",
                              existing=existing, delay=ttl)
            await self._steps(plan, target, report, held=held, moving=None, holder=holder, wave=wave)
            report.record = RunRecord.of(event, run=report.run, instances=tuple(report.instances),
                                         steps=report.steps, outcome="done", at=self.clock())
            await held.complete(report.record.as_json())  # after a renewal in flight; not when lost
        return report

    @staticmethod
    def _done_already(report: RunReport, existing: Claim) -> RunReport:
        report.skipped = f"already done for this event by {existing.holder}"
        report.done = existing
        return report

    async def _lead_moving(self, plan: Plan, target: Target, report: RunReport, *, key: str, holder: str,
                           wave: Wave[RunReport] | None) -> RunReport | None:
        """Lead the handling of a run moved with its whole gang and followed under the run's move claim
        alone, held from the start: it stands for the run claim while the steps go on, and the run
        claim (``key``) is written once, done with the run's record, before the move claim is let go
        (issue #45: two claims renewed through a long save were two Lease writes per renewal; now the
        run claim is one write instead of a create, its renewals and its completion).

        The move claim's holder is this delivery marked with its event (:data:`EVENT_MARK`), so a
        delivery that finds the claim held tells a copy of its own event (as under the run claim,
        ``claims.not_free``: a duplicate, or a retry when it is an earlier delivery of this very
        message) from another notice of the run, in another replica, which joins this handling
        there (:meth:`_join_remotely`: no claim, no Event of its own).  Holding the claim, it reads
        the run claim: found done (the handling of a copy finished, and let the move claim go,
        since this delivery looked) it is a duplicate, not a second move.  None: the follow-up holds
        the move claim now (a fallback): the run is led under its run claim, and the requeue takes
        the move claim when it gets there.  Holding the claim, it also reads the run's follow-up
        record (:meth:`_moved_since`): a notice that located its run before another notice's handling
        moved it, and took the move claim once that handling let it go, is done with that move, not
        a second one."""
        event = plan.event
        async with self._moving(target, holder, event) as moving:
            if moving is None:
                assert self.mover is not None and self.mover.claims is not None
                current = await self.mover.claims.get(self.mover.move_key(target.run_key))
                if current is None or current.state == "done":
                    raise TemporaryError(f"the move claim of run {target.run_key} was let go while looking at "
                                         "it: this notice is looked at again", delay=0)
                if current.holder.endswith(FOLLOW_UP_HOLDER):
                    return None
                delivery, mark, of_event = current.holder.rpartition(EVENT_MARK)
                if mark and of_event == event.event_id:  # a copy of this event leads the run's handling
                    raise RunHeld(f"run {target.run_key} for event {event.event_id} is being handled by {delivery}",
                                  existing=replace(current, holder=delivery), delay=self.options.claim_ttl_seconds)
                return await self._join_remotely(plan, target, report, mover=delivery if mark else current.holder)
            existing = await self.claims.get(key)
            if existing is not None:  # a copy of this event handled the run (done), or leads it the other way
                if existing.state == "done":
                    return self._done_already(report, existing)
                raise RunHeld(f"run {target.run_key} for event {event.event_id} is being handled by "
                              f"{existing.holder}", existing=existing, delay=self.options.claim_ttl_seconds)
            moved = await self._moved_since(target, event)
            if moved is not None:  # located before another notice's handling moved the run, let go since
                report.joined = moved
                report.skipped = f"the run was moved for event {moved} after this notice, with its whole gang"
                return report
            await self._steps(plan, target, report, held=moving, moving=moving, holder=holder, wave=wave)
            report.record = RunRecord.of(event, run=report.run, instances=tuple(report.instances),
                                         steps=report.steps, outcome="done", at=self.clock())
            moving.check()
            await self.claims.complete(key, holder=holder, details=report.record.as_json())
        return report

    async def _steps(self, plan: Plan, target: Target, report: RunReport, *, held: HeldClaim,
                     moving: HeldClaim | None, holder: str, wave: Wave[RunReport] | None) -> None:
        event = plan.event
        requeue = partial(self._requeue, holder=holder, wave=wave, moving=moving)
        for step, act in ((Step.NOTIFY, self._notify), (Step.SIGNAL, self._signal),
                          (Step.DURABLE, self._durable), (Step.REQUEUE, requeue)):
            if step in plan.steps:
                held.check()  # a replica that lost its claim does not take another step
                try:
                    await act(plan, target, report)
                except PermanentError as e:
                    moved = await self._moved_since(target, event)
                    if moved is None:
                        raise
                    report.skipped = f"{e}; the run was moved for event {moved} after this notice"
                    break

    def _moves_early(self, plan: Plan, target: Target) -> bool:
        """Whether this handling is led under the run's move claim, taken when it begins
        (:meth:`_lead_moving`): it moves the run, the move takes the whole gang (kubernetes mode, not
        elastic), and the run is followed (its record says who moved it, for a notice that joined
        from another replica)."""
        return (Step.REQUEUE in plan.steps and self.mover is not None and self.mover.claims is not None
                and self.follower is not None and self._moves_whole_gangs(target))

    def _moving(self, target: Target, holder: str,
                event: Event) -> contextlib.AbstractAsyncContextManager[HeldClaim | None]:
        """The run's move claim for this delivery, its holder marked with the event (:data:`EVENT_MARK`),
        whether taken at the handling's start or at the requeue: a delivery of another replica that
        finds it held tells a copy of its event from another notice the same way in both."""
        assert self.mover is not None
        return self.mover.moving(target.run_key, holder=f"{holder}{EVENT_MARK}{event.event_id}",
                                 ttl=self.options.claim_ttl_seconds)

    async def _join_remotely(self, plan: Plan, target: Target, report: RunReport, *, mover: str) -> RunReport:
        """Join the handling of the run that another notice's delivery (``mover``, in another replica)
        leads: cordon and drain this notice's own instances (both idempotent), wait until that
        handling has moved the run (:meth:`_moved_meanwhile`: its whole gang, this notice's
        instances with it) and be done with that move; no claim and no Event of its own (issue #45:
        with two replicas each led a handling of most runs); ``joined`` is the event the run was
        moved for.  Not moved (the other handling failed, or waits for capacity): retried, to lead
        then."""
        if Step.SIGNAL in plan.steps:
            await self._signal(plan, target, report, record=False)
        moved = await self._moved_meanwhile(target, plan.event)
        if moved is None:
            raise TemporaryError(f"run {target.run_key} was being handled by another notice's delivery ({mover}) "
                                 "and is not known to be moved: this notice is looked at again", delay=5.0)
        report.joined = moved
        report.skipped = (f"joined the handling of another notice of the run ({mover}); the run was moved for "
                          f"event {moved} after this notice, with its whole gang")
        return report

    def _tell(self, record: RunRecord) -> None:
        """Hand one run's record to the notifier (queued; never waits, never fails the recovery)."""
        if self.notifier is not None:
            self.notifier.submit(record.summary())

    async def _notify(self, plan: Plan, target: Target, report: RunReport) -> None:
        event = plan.event
        reason = NOTIFY_REASONS.get(event.kind, REASON_NOTICE)
        message = (f"{event.kind.value} for instance(s) {', '.join(report.instances)} "
                   f"(event {event.event_id}); policy: notify only, nothing drained")
        await self._record(target, event, reason=reason, message=message, warning=False)
        report.steps = replace(report.steps, notify=NotifyStep(reason))

    def _deadline(self, plan: Plan, target: Target) -> datetime:
        """When the run's nodes go: the plan's deadline (for an expiring block on Karpenter's nodes
        Karpenter's earlier drain), else the checkpoint-ahead time from now."""
        deadline = capacity_block_expiry.run_deadline(plan, node_shape=target.facts.node_shape)
        return deadline or (self.clock() + timedelta(seconds=self.options.checkpoint_ahead_seconds))

    async def _signal(self, plan: Plan, target: Target, report: RunReport, *, record: bool = True) -> None:
        event = plan.event
        deadline = self._deadline(plan, target)
        drained: dict[str, str] = {}

        async def drain_all() -> None:
            if not target.ray_node_ids:
                return
            ray = await self.ray_control(target)
            message = f"resilienced: {event.kind.value} {event.event_id}"
            for node_id in target.ray_node_ids:
                outcome = await self._drain(ray, node_id, deadline=deadline, message=message)
                drained[node_id] = outcome
                if self.metrics is not None:
                    self.metrics.drains.labels(outcome=outcome).inc()

        # the drain is what saves the run: it does not wait for the taint (both are idempotent)
        results = await asyncio.gather(
            drain_all(), self.cluster.cordon(target, reason=event.kind.value, deadline=deadline),
            return_exceptions=True)
        for failed in results:
            if isinstance(failed, BaseException):
                raise failed
        rejected = [n for n, o in drained.items() if o == "rejected"]
        if rejected:
            raise TemporaryError(f"GCS did not accept the drain of {', '.join(rejected)}", delay=5)
        if record:  # a notice that joined a run's handling records nothing: its leader does
            await self._record(target, event, reason=REASON_DRAINING, warning=True, message=(
            f"{event.kind.value} (event {event.event_id}): drained Ray node(s) "
            f"{', '.join(drained) or 'none on these instances'} of run {target.run_key} "
            f"with deadline {deadline.isoformat()}; every rank saves the step it is on"))
        report.steps = replace(report.steps, signal=SignalStep(deadline=deadline, drained=dict(drained)))

    async def _drain(self, ray: RayControl, node_id: str, *, deadline: datetime, message: str) -> str:
        result = await ray.drain(node_id, deadline=deadline, message=message)
        if result.outcome == "already_draining":
            return "already_draining"
        return "accepted" if result.accepted else "rejected"

    async def _durable(self, plan: Plan, target: Target, report: RunReport) -> None:
        event = plan.event
        if not target.checkpoint_uri or self.store is None:
            why = ("the run names no checkpoint URI (annotation resilienced.io/checkpoint-uri)"
                   if not target.checkpoint_uri else "no object store configured")
            await self._record(target, event, reason=REASON_NOT_DURABLE, warning=True,
                               message=f"cannot verify a checkpoint of {target.run_key}: {why}")
            if self.metrics is not None:
                self.metrics.durable.labels(outcome="no_checkpoint_uri").inc()
            report.steps = replace(report.steps, durable=DurableStep(outcome="unchecked", reason=why))
            return
        notice = event.time or self.clock()
        deadline = self._deadline(plan, target)
        export_paths = (self.options.export_paths(target.checkpoint_uri)
                        if self.export is not None and self.options.export_paths else ())
        result: DurableResult = await wait_durable(
            store=self.store, uri=target.checkpoint_uri, notice_time=notice, deadline=deadline,
            grace_seconds=self.options.durable_grace_seconds,
            poll_interval=self.options.durable_poll_seconds,
            export=self.export, file_system_id=self.options.file_system_id,
            export_paths=export_paths, export_token=f"{event.event_id}-{target.run_key}",
            clock=self.clock)
        if result.durable:
            assert result.manifest is not None
            after = (self.clock() - notice).total_seconds()
            if self.metrics is not None:
                self.metrics.durable.labels(outcome="durable").inc()
                self.metrics.notice_to_durable.observe(max(0.0, after))
                self.metrics.notice_to_checkpoint.observe(
                    max(0.0, (result.manifest.time - notice).total_seconds()))
            await self._record(target, event, reason=REASON_DURABLE, warning=False, message=(
                f"checkpoint step {result.step} of {target.run_key} is durable in "
                f"{target.checkpoint_uri} ({len(result.manifest.files)} files, "
                f"{after:.1f}s after the notice)"))
            report.steps = replace(report.steps, durable=DurableStep(
                outcome="durable", step=result.step, world_size=result.manifest.world_size,
                notice_to_durable_s=round(after, 3), export_tasks=tuple(result.export_tasks)))
            return
        if self.metrics is not None:
            self.metrics.durable.labels(outcome="not_durable").inc()
            if result.steps_lost:
                self.metrics.steps_lost.inc(result.steps_lost)
        resume = ("no durable checkpoint at all: the run starts over" if result.fallback_step is None
                  else f"it resumes from step {result.fallback_step}, repeating at least "
                       f"{result.steps_lost if result.steps_lost is not None else '?'} step(s)")
        await self._record(target, event, reason=REASON_NOT_DURABLE, warning=True, message=(
            f"no checkpoint of {target.run_key} saved after the notice became durable by the "
            f"deadline + {self.options.durable_grace_seconds:g}s ({result.reason}); {resume}"))
        report.steps = replace(report.steps, durable=DurableStep(
            outcome="not_durable", reason=result.reason, resume_step=result.fallback_step,
            steps_lost=result.steps_lost, rejected=tuple(result.rejected)))

    async def _requeue(self, plan: Plan, target: Target, report: RunReport, *, holder: str,
                       wave: Wave[RunReport] | None = None, moving: HeldClaim | None = None) -> None:
        event = plan.event
        if wave is not None:  # the notices that joined the run's handling are in its move; none after
            target = wave.begin_move(target)
            report.instances = list(target.facts.instance_ids)
        if Step.DURABLE not in plan.steps and target.checkpoint_uri and self.store is not None:
            # The instance is already gone (no notice): the run resumes from what is in S3.
            newest = await newest_durable(store=self.store, uri=target.checkpoint_uri,
                                          before=event.time)
            notice = event.time or self.clock()
            resume = (ResumeStep(resume_step=None, reason="no durable checkpoint: the run starts over")
                      if newest is None else
                      ResumeStep(resume_step=newest.step,
                                 checkpoint_age_s=round((notice - newest.time).total_seconds(), 3)))
            report.steps = replace(report.steps, resume=resume)
            await self._record(target, event, reason=REASON_RESUME_POINT, warning=True, message=(
                f"instance(s) {', '.join(report.instances)} went without a notice "
                f"({event.kind.value}); run {target.run_key} resumes from "
                + (f"step {newest.step}, saved {resume.checkpoint_age_s:.0f}s before"
                   if newest is not None else "scratch (nothing durable)")))
        if self.mover is None:
            report.steps = replace(report.steps, requeue=RequeueStep.unconfigured(
                "no capacity planner or requeuer configured"))
            return
        if moving is not None:  # held since the handling began (_moves_early)
            moving.check()
            await self._requeue_held(event, target, report)
            return
        # Under the run's move claim also without the follow-up: a gang's notices come together (a
        # Spot pool is reclaimed at once), each under its own run claim, and two moves of one run at
        # once both change it (seen on the real control plane, tests/cluster/test_mass.py: two
        # ``Requeued`` per run, the Workload reactivated by one while the other steered it).  Taken in
        # the run claims' store, the same one the follow-up's moves use.
        claim = (self._moving(target, holder, event) if self.mover.claims is not None else
                 held_claim(self.claims, self.mover.move_key(target.run_key), holder=holder, logger=self._log,
                            ttl_seconds=self.options.claim_ttl_seconds, what="move claim", release_on_cancel=False))
        async with claim as held:
            if not held:  # its follow-up (or another delivery) moves the run now
                moved = await self._moved_meanwhile(target, event)
                if moved is not None:
                    report.skipped = (f"the run was moved for event {moved} after this notice, with its whole "
                                      "gang (another notice of it, in another replica)")
                    return
                raise TemporaryError(f"run {target.run_key} is being moved by its follow-up or another "
                                     "notice now", delay=5.0)
            await self._requeue_held(event, target, report)

    async def _requeue_held(self, event: Event, target: Target, report: RunReport) -> None:
        """Move the run (``recovery.move.Mover``) and open the follow-up (holding the run's move
        claim, when following)."""
        assert self.mover is not None
        moved = await self.mover.move(target, event=event)
        result = moved.result
        report.steps = replace(report.steps, requeue=RequeueStep.of(result, replacement=moved.replacement))
        if result.capacity is Capacity.WAIT:
            delay = result.retry_after.total_seconds() if result.retry_after else None
            raise TemporaryError(f"run {target.run_key} waits for capacity: {result.reason}", delay=delay)
        if self.follower is not None:
            opened = await self.follower.open(target, event=event, result=result, steps=report.steps)
            if opened is not None:
                report.steps = replace(report.steps, follow_up=FollowUpStep(
                    event_id=opened.event_id, stage=opened.stage, stages=tuple(opened.stages),
                    capacity=opened.where))

    async def _complete_lifecycle(self, plan: Plan) -> str:
        if self.lifecycle is None:
            raise PermanentError("ASG lifecycle action: no Auto Scaling access configured")
        action = plan.event.detail
        if not isinstance(action, asg_lifecycle.LifecycleAction):
            raise PermanentError(f"a {plan.event.kind.value} event has no ASG lifecycle action to complete")
        instance = plan.instance_ids[0] if plan.instance_ids else None
        return await self.lifecycle.complete(action, instance_id=instance)

    async def _record(self, target: Target, event: Event, *, reason: str, message: str, warning: bool) -> None:
        """An Event once per (run, reason, notice): a retry or a replica taking the run over does
        not record the work already recorded again.  The key names the run too: two runs with
        pods on one Node each get their Event on it."""
        try:
            await self.cluster.record(target, reason=reason, message=message, warning=warning,
                                      once=f"{event.event_id}/{target.run_key}")
        except ResilienceError as e:  # an Event is a courtesy; the step itself is done
            self._log.warning("recording an event failed", run=target.run_key, reason=reason,
                              error=str(e))
