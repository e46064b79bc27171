"""The preemption-aware checkpointer: the public API any Ray Train (or torch.distributed) loop adopts.

::

    from trainer.resilience import Checkpointer

    state = {"model": model, "optim": optim, "sched": sched}
    ckpt = Checkpointer(config["checkpoint_dir"], every=50)
    step = ckpt.restore(state)                      # steps already trained (0: nothing saved)
    while step < config["steps"]:
        loss = train_one_step(model, optim, step + 1)
        sched.step()
        step += 1
        ckpt.after_step(step, state, metrics={"loss": loss})
    ckpt.finish(state)

One :class:`Checkpointer` per rank, made inside the train function once ``torch.distributed``
is initialised (Ray Train's ``TorchTrainer`` does it; torchrun too), or with no process group at
all (one process).  Everything it writes under ``root`` is the layout the daemon verifies
(``step-<N>/``, ``manifest.json`` last; docs/durability.md).  ``python -m trainer`` is a user of
this class; docs/your-trainer.md is the guide for your own script.

Also public: :func:`write_manifest` and :func:`verify`, for checkpoints written some other way.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import torch.distributed as dist

from trainer.checkpoint import (
    CheckpointStore,
    Committed,
    Manifest,
    PendingSave,
    prune,
    verify,
    write_manifest,
)
from trainer import resize, restarts, resume
from trainer.config import PreemptionConfig
from trainer.data import batch_share, loss_weight
from trainer.errors import CheckpointError, CorruptCheckpoint, UsageError
from trainer.preemption import SIGTERM, Agreed, Agreement, DeadlinePlan, NoticeClock
from trainer.runtime import Runtime, detect_runtime
from trainer.state import RESERVED, dcp_entries

__all__ = ["Checkpointer", "Manifest", "batch_share", "loss_weight", "verify", "write_manifest"]

log = logging.getLogger(__name__)

#: Timeout of the checkpointer's gloo groups: long enough for a slow save, short enough that a
#: lost peer does not hang a rank for Ray's default of 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

_DEFAULTS = PreemptionConfig()

#: ``on_event(name, **fields)``: what the checkpointer did (``checkpoint_committed``, ...).
EventHook = Callable[..., None]


class Checkpointer:
    """Saves the training state every ``every`` steps and at a preemption notice; resumes it.

    Args:
        root: the checkpoint root on storage every rank shares (the FSx mount).
        every: periodic checkpoint every this many steps (0: none; the preemption and final
            saves happen anyway).
        keep: committed checkpoints kept; older ones are deleted after each commit.
        async_save: write periodic checkpoints with ``dcp.async_save`` (training goes on; the
            commit happens at the first ``after_step`` once every rank's files are written).
            Preemption and final saves are always synchronous.
        total_steps: the run's last step, when the loop knows it: ``after_step(total_steps)``
            then leaves the save to :meth:`finish` (reason ``final``, not ``periodic``) and,
            after a notice, returns instead of waiting to be torn down, so the run can finish.
        save_margin_factor, save_margin_s: the time kept for the last save before a deadline
            is the slowest save of this attempt times the factor plus the seconds (1.5, 2 s).
        sigterm_grace_s: deadline assumed after a SIGTERM that came without one (25 s).
        no_deadline_s: deadline assumed when Ray reports a preemption without one (90 s).
        teardown_timeout_s: after the last save, how long past the deadline to wait for Ray's
            teardown before failing, so that Ray restarts the run anyway (120 s).
        agree_interval_s: before any notice, the ranks poll and agree at most about this often
            (every ``k`` steps, ``k`` = this / the mean of the last 5 steps, fixed by rank 0 at each
            boundary; steps of this long or longer agree every step).  0.5 s: Ray Train's
            watcher hears a drain every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` (0.5 s) at
            best, so agreeing more often hears it little sooner and costs every step.  After a
            notice they agree after every step.
        on_event: called as ``on_event(name, **fields)`` on every rank for ``checkpoint_committed``
            (step, reason, path, save_seconds), ``checkpoint_rejected`` (path, why),
            ``preemption_notice`` (step, deadline_ms, source), ``resize_requested`` (step),
            ``waiting_for_teardown`` (step) and, on rank 0 of an elastic run's new worker group,
            ``restarted`` (seconds, kind, world_size, phases, decision: ``trainer.restarts``).
        min_world_size: the smallest world size the run trains at (an elastic run's minimum;
            None: this attempt's world size, a fixed-size run).  Written in the resume record
            (``trainer.resume``) rank 0 leaves under ``root`` when the attempt trains its first
            step: the daemon reads it to see the run train again after a requeue.

    Raises:
        UsageError: a bad argument.  CheckpointError: ``root`` is not writable on some rank.
    """

    #: The collaborators a Checkpointer makes: what commits checkpoints, and the per-step
    #: agreement of the ranks.  A test or a benchmark fills these seams with a subclass (one
    #: that crashes at a phase of a commit, ``CheckpointStore.at_phase``; one that counts the
    #: agreements); training code has no reason to.
    store_type: ClassVar[type[CheckpointStore]] = CheckpointStore
    agreement_type: ClassVar[type[Agreement]] = Agreement

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        every: int = 0,
        keep: int = 3,
        async_save: bool = False,
        total_steps: int | None = None,
        save_margin_factor: float = _DEFAULTS.save_margin_factor,
        save_margin_s: float = _DEFAULTS.save_margin_s,
        sigterm_grace_s: float = _DEFAULTS.sigterm_grace_s,
        no_deadline_s: float = _DEFAULTS.no_deadline_s,
        teardown_timeout_s: float = _DEFAULTS.teardown_timeout_s,
        agree_interval_s: float = 0.5,
        on_event: EventHook | None = None,
        min_world_size: int | None = None,
    ) -> None:
        self._marks = {"checkpointer_init": time.time()}  # this (re)start's milestones (trainer.restarts)
        if min_world_size is not None and (not isinstance(min_world_size, int) or isinstance(min_world_size, bool)
                                           or min_world_size < 1):
            raise UsageError(f"min_world_size must be a positive int or None, got {min_world_size!r}")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
            raise UsageError(f"total_steps must be a positive int or None, got {total_steps!r}")
        _check_args(every=every, keep=keep, save_margin_factor=save_margin_factor, save_margin_s=save_margin_s,
                    sigterm_grace_s=sigterm_grace_s, no_deadline_s=no_deadline_s,
                    teardown_timeout_s=teardown_timeout_s, agree_interval_s=agree_interval_s)
        self.root = Path(root)
        self.every, self.keep, self.async_save, self.total_steps = every, keep, async_save, total_steps
        self._grace = {"sigterm": sigterm_grace_s, "no_deadline": no_deadline_s, "teardown": teardown_timeout_s}
        self._agree_interval_s = agree_interval_s
        self._next_boundary = 0  # the step of the next agreement (0: the first after_step)
        self._event = on_event or (lambda name, **fields: None)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        # Checkpoint collectives run on their own gloo group (async saves run them in a background
        # thread); the per-step agreement has another one: neither ever interleaves with the
        # other or with training's collectives (NCCL or gloo on the default group).
        ckpt_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if distributed else None
        control_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if distributed else None
        self._store = self.store_type(root=self.root, rank=self.rank, world_size=self.world_size,
                                      group=ckpt_group)
        self._agreement = self.agreement_type(group=control_group, world_size=self.world_size)
        self._plan = DeadlinePlan(margin_factor=save_margin_factor, margin_s=save_margin_s)
        self._check_root_writable(ckpt_group)
        self._runtime: Runtime = detect_runtime()
        if not self._runtime.install_sigterm():
            log.info(f"SIGTERM flag not installed; Ray's drain is the only notice rank={self.rank}")
        self.step: int | None = None
        """Steps trained so far (None until :meth:`restore`)."""
        self.restored_from: Path | None = None
        """The checkpoint :meth:`restore` loaded (None: it found none)."""
        self.rng_restored = False
        """Whether :meth:`restore` restored this rank's RNG states (same world size only)."""
        self._last_saved: int | None = None
        self._pending: PendingSave | None = None
        self._finished = False
        self._noticed = False
        self._source = ""
        self._deadline_ms: int | None = None
        self._clock = NoticeClock(sigterm_grace_s=sigterm_grace_s, no_deadline_s=no_deadline_s)
        self._resize_id: str | None = None  # rank 0: the resize request it found (trainer.resize)
        self._metrics: dict[str, Any] = {}
        self._entries_key: tuple[tuple[str, int], ...] = ()
        self._entries: dict[str, Any] = {}
        self._left = time.perf_counter()  # when the last call returned: a step starts there
        self._marks["checkpointer_ready"] = time.time()
        self._min_world_size = min_world_size
        self._resume_written = False

    # ------------------------------------------------------------------ the API
    def restore(self, state: Mapping[str, Any]) -> int:
        """Load the newest checkpoint that verifies into ``state``; the steps it holds (0: none).

        Collective: every rank calls it and gets the same number.  Checkpoints that do not
        verify (torn, partial) are skipped with the reason logged, and deleted.
        """
        if self.step is not None:
            raise UsageError("restore() was called already; call it once, before the first after_step()")
        entries = self._entries_of(state)
        self._marks["restore_start"] = time.time()
        point, rejected = self._store.broadcast_resume()
        for r in rejected:
            if self.rank == 0:
                log.warning(f"rejected checkpoint path={r.path} why={r.why!r}")
            self._event("checkpoint_rejected", path=str(r.path), why=r.why)
        step = 0
        if point is not None:
            progress = {"step": -1}
            self.rng_restored = self._store.load(point, {**entries, RESERVED: progress})
            if progress["step"] != point.manifest.step:
                raise CorruptCheckpoint(
                    str(point.path), f"the checkpoint holds step {progress['step']}, its manifest says {point.manifest.step}"
                )
            step = point.manifest.step
            self.restored_from = point.path
            log.info(f"restored step={step} path={point.path} world_size={point.manifest.world_size}")
        self.step = step
        self._last_saved = step if point is not None else None
        self._marks["restore_end"] = time.time()
        self._left = time.perf_counter()
        return step

    def after_step(self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None) -> None:
        """Call after every optimizer step with the steps trained so far (collective).

        Saves every ``every`` steps; at a preemption notice saves at once, keeps training while
        the deadline leaves room for a step and a save, then saves the last step and does not
        return (it waits to be torn down).
        """
        self._check_step(step)
        if "first_step" not in self._marks:
            self._measure_restart()
        entries = self._entries_of(state)
        previous, self.step = self.step, step
        if not self._resume_written:
            self._write_resume_record(step, restored=previous if self.restored_from is not None else None)
        self._metrics = dict(metrics or {})
        last = self.total_steps is not None and step >= self.total_steps  # finish() saves it
        if self._noticed or step >= self._next_boundary:
            agreed = self._agree(step)
            # what one more step costs: the step (all since the last return, padding included)
            # and this boundary (the poll and the agreement), not a save made after it
            self._plan.record_step(time.perf_counter() - self._left)
            self._next_boundary = agreed.next_step
            if self._pending is not None and not agreed.async_writing:
                self._commit_pending()
            stop = self._on_notice(agreed, entries) if agreed.notice else agreed.stop
            if self._noticed and stop and not last:
                self._hold(entries)
            if agreed.resize and not self._noticed and not last:
                self._hold_for_resize(entries)
        else:
            self._plan.record_step(time.perf_counter() - self._left)
        if self.every and not (self._noticed or last) and step // self.every > (previous or 0) // self.every:
            self._periodic_save(entries)
        self._left = time.perf_counter()

    def finish(self, state: Mapping[str, Any]) -> None:
        """The final save (unless this step is saved already); waits for any async save."""
        if self.step is None:
            raise UsageError("finish() before restore(); call restore(state) first")
        entries = self._entries_of(state)
        self._save_now("final", entries)
        self._finished = True

    def _measure_restart(self) -> None:
        """Rank 0, at the first step of this group: what its (re)start cost, when Ray Train's
        controller started a clock for it (``trainer.elastic.ElasticCallback``; ``trainer.restarts``)."""
        self._marks["first_step"] = time.time()
        if self.rank != 0:
            return
        try:
            cost = restarts.measure(self.root, marks=self._marks, world_size=self.world_size)
        except OSError as e:  # a figure, never a reason to stop training
            log.warning(f"restart not measured error={e!r}")
            return
        if cost is not None:
            self._event("restarted", seconds=cost["seconds"], kind=cost["kind"], world_size=self.world_size,
                        phases=cost["phases"], decision=cost["decision"])
            log.info(f"restart measured seconds={cost['seconds']} kind={cost['kind']} phases={cost['phases']}")

    def _write_resume_record(self, step: int, *, restored: int | None) -> None:
        """Rank 0, at the attempt's first step: the resume record (``trainer.resume``).  A failed
        write is logged, never fatal: the record only tells the daemon the run trains again."""
        self._resume_written = True
        if self.rank != 0:
            return
        record = resume.ResumeRecord(
            attempt_id=resume.new_attempt_id(),
            resumed_from_step=restored, first_step=step, world_size=self.world_size,
            min_world_size=self._min_world_size or self.world_size,
            started_at_unix=time.time())
        try:
            resume.write(self.root, record)
        except OSError as e:
            log.warning(f"resume record not written root={self.root} error={e.strerror or e}")

    # ------------------------------------------------------------------ checks
    def _check_step(self, step: int) -> None:
        if self.step is None:
            raise UsageError("after_step() before restore(); call restore(state) first (it returns the step to go on from)")
        if self._finished:
            raise UsageError("after_step() after finish()")
        if not isinstance(step, int) or isinstance(step, bool):
            raise UsageError(f"after_step(step={step!r}): step must be an int (optimizer steps trained so far)")
        if step <= self.step:
            raise UsageError(
                f"after_step(step={step}): the step does not advance (the last was {self.step}); pass the "
                "number of optimizer steps trained so far, which grows by one per call"
            )

    def _entries_of(self, state: Mapping[str, Any]) -> dict[str, Any]:
        key = tuple((k, id(v)) for k, v in state.items()) if isinstance(state, Mapping) else ()
        if not key or key != self._entries_key:
            self._entries = dcp_entries(dict(state) if isinstance(state, Mapping) else state)
            self._entries_key = key
        return self._entries

    def _check_root_writable(self, group: dist.ProcessGroup | None) -> None:
        """Every rank makes ``root`` and writes a probe file there; all raise if one cannot."""
        problem = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            problem = f"{type(e).__name__}: {e.strerror or e}"
        problems = [problem]
        if self.world_size > 1:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=group)
        failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if failed:
            rank, why = failed[0]
            raise CheckpointError(f"checkpoint root {self.root} is not writable (rank {rank}: {why})")

    # ------------------------------------------------------------------ the step boundary
    def _agree(self, step: int) -> Agreed:
        info = self._runtime.preemption_info()
        deadline_ms = self._clock.deadline_ms(info, agreed_ms=self._deadline_ms)
        stop = self._noticed and not self._plan.room_for_another_step(now=time.time(), deadline_ms=self._deadline_ms)
        if self.rank == 0:
            self._resize_id = resize.pending(self.root)
        agreed = self._agreement.agree(
            ray_notice=info is not None, sigterm=SIGTERM.received_at is not None,
            deadline_ms=deadline_ms, stop=stop,
            async_writing=self._pending is not None and not self._pending.written(), step=step,
            propose_next=self._propose_next(step) if self.rank == 0 else 0,
            resize=self._resize_id is not None,
        )
        if agreed.step_min != agreed.step_max:
            raise UsageError(
                f"ranks disagree on the step: after_step() was called with steps {agreed.step_min} to "
                f"{agreed.step_max} at the same boundary (this rank: {step}); every rank must pass the same number"
            )
        return agreed

    def _propose_next(self, step: int) -> int:
        """Rank 0: the step of the next boundary (``DeadlinePlan.next_boundary``); after a notice, the next step."""
        if self._noticed:
            return step + 1
        return self._plan.next_boundary(step, interval_s=self._agree_interval_s)

    def _on_notice(self, agreed: Agreed, entries: dict[str, Any]) -> bool:
        """Take the agreed notice in; whether every rank is to stop training now."""
        self._deadline_ms = agreed.deadline_ms
        if agreed.ray_notice:
            self._source = "ray"  # a drain ends in Ray's teardown, whatever came first
        if self._noticed:
            return agreed.stop
        self._noticed = True
        self._source = agreed.source
        self._event("preemption_notice", step=self.step, deadline_ms=self._deadline_ms, source=agreed.source)
        log.warning(f"preemption notice step={self.step} deadline_ms={self._deadline_ms} source={agreed.source}")
        self._save_now("preemption", entries)  # at once: the notice is best effort
        room = self._plan.room_for_another_step(now=time.time(), deadline_ms=self._deadline_ms)
        return self._agreement.agree_stop(not room, step=self.step or 0)

    def _hold(self, entries: dict[str, Any]) -> NoReturn:
        """Save the step if it is not saved, then train nothing more: wait to be torn down."""
        self._save_now("preemption", entries, saved=self._held)
        log.warning(f"saved; training no further step before the deadline step={self.step}")
        # A Ray drain ends in Ray's teardown; a bare SIGTERM asked this process to go.
        self._runtime.wait_for_teardown(
            deadline_ms=self._deadline_ms, timeout_s=self._grace["teardown"] if self._source == "ray" else 0.0,
        )

    def _hold_for_resize(self, entries: dict[str, Any]) -> NoReturn:
        """Ray Train is about to resize the run: save this step, answer, wait to be torn down."""
        log.warning(f"Ray Train resizes the run: saving before the restart step={self.step}")
        self._event("resize_requested", step=self.step)
        # answered as soon as the step is committed, before it is reported: Ray Train's controller
        # waits for the answer and consumes no report meanwhile, so a report could block (its
        # queue holds one) and the answer would never come
        self._save_now("resize", entries, saved=self._answer_resize)
        self._runtime.wait_for_teardown(deadline_ms=None, timeout_s=self._grace["teardown"])

    def _held(self) -> None:
        """The last save is committed: say so before anything else (reporting it, answering a
        resize), because from then on the teardown may come at any moment and end this process."""
        self._event("waiting_for_teardown", step=self.step)

    def _answer_resize(self) -> None:
        self._held()  # recorded before the answer: the controller tears the group down once answered
        if self._resize_id is not None:  # rank 0
            resize.answer(self.root, request_id=self._resize_id, step=self.step or 0)

    # ------------------------------------------------------------------ saving
    def _commit(self, pending: PendingSave, *, saved: Callable[[], None] | None = None) -> Committed:
        committed = self._store.commit(pending)
        self._last_saved = committed.step
        if pending.future is None:  # only synchronous saves say how long a save blocks
            self._plan.record_save(committed.save_seconds)
        self._event("checkpoint_committed", step=committed.step, reason=committed.reason,
                    path=str(committed.path), save_seconds=committed.save_seconds)
        if saved is not None:
            saved()
        self._runtime.report(committed, metrics={**self._metrics, "step": committed.step, "reason": committed.reason})
        if self.rank == 0:
            prune(self.root, keep=self.keep)
        return committed

    def _commit_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._commit(pending)

    def _save_now(self, reason: str, entries: dict[str, Any], *, saved: Callable[[], None] | None = None) -> None:
        """Synchronous save of the current step, unless it is saved already; ``saved()`` once it is
        committed (before it is reported)."""
        self._commit_pending()
        if self._last_saved == self.step:
            if saved is not None:
                saved()
            return
        assert self.step is not None
        self._commit(self._store.start(self._dcp_state(entries), step=self.step, reason=reason), saved=saved)

    def _periodic_save(self, entries: dict[str, Any]) -> None:
        self._commit_pending()
        assert self.step is not None
        pending = self._store.start(self._dcp_state(entries), step=self.step, reason="periodic",
                                    use_async=self.async_save)
        if pending.future is None:
            self._commit(pending)
        else:
            self._pending = pending

    def _dcp_state(self, entries: dict[str, Any]) -> dict[str, Any]:
        return {**entries, RESERVED: {"step": self.step}}


def _check_args(**values: float) -> None:
    for name in ("every", "keep"):
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{name} must be an int, got {value!r}")
    if values["every"] < 0:
        raise UsageError(f"every must be >= 0 (0: no periodic checkpoint), got {values['every']}")
    if values["keep"] < 1:
        raise UsageError(f"keep must be >= 1, got {values['keep']}")
    if not values["save_margin_factor"] >= 1.0:
        raise UsageError(f"save_margin_factor must be >= 1, got {values['save_margin_factor']}")
    if not values["save_margin_s"] >= 0.0:
        raise UsageError(f"save_margin_s must be >= 0, got {values['save_margin_s']}")
    if not 0 <= values["agree_interval_s"] < float("inf"):
        raise UsageError(f"agree_interval_s must be >= 0 seconds, got {values['agree_interval_s']}")
    for name in ("sigterm_grace_s", "no_deadline_s", "teardown_timeout_s"):
        if not 0 < values[name] < float("inf"):
            raise UsageError(f"{name} must be a positive number of seconds, got {values[name]}")
