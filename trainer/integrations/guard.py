"""What both framework callbacks do: hear the notice, plan the deadline, commit, hold.

A :class:`PreemptionGuard` is the :class:`~trainer.resilience.Checkpointer`'s preemption path
without its save: the framework saves (``transformers.Trainer._save_checkpoint``,
``lightning.Trainer.save_checkpoint``), the guard says when, commits what was written in the
layout the daemon verifies, and holds.  Per optimizer step the callback calls:

1. :meth:`PreemptionGuard.step_end` after the step: the reason to save this step now, if any;
   at a boundary (every ``k`` steps before a notice, every step after) every rank reads its
   notice (Ray Train's, the SIGTERM flag) and joins one all-reduce, as the Checkpointer does
   (``trainer.preemption``);
2. after the framework's save, :meth:`PreemptionGuard.committed` with the directory it wrote:
   hashes, manifest last, rename to ``step-<N>`` (``CheckpointStore.commit_written``), report to
   Ray Train, prune; then, after a notice, it holds when the deadline plan leaves no room for
   another step (it waits for Ray's teardown and does not return).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from trainer.checkpoint import CheckpointStore, Committed, ResumePoint, committed_steps, find_resume_point, prune
from trainer.config import PreemptionConfig
from trainer.errors import UsageError
from trainer.preemption import SIGTERM, Agreed, Agreement, DeadlinePlan, NoticeClock
from trainer.runtime import Runtime, detect_runtime

log = logging.getLogger(__name__)

#: Timeout of the guard's gloo groups (as the Checkpointer's).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

#: ``on_event(name, **fields)``: ``checkpoint_committed``, ``preemption_notice``, ``waiting_for_teardown``.
EventHook = Callable[..., None]


class PreemptionGuard:
    """The preemption path of one rank; made by a callback, started once training starts.

    Args:
        root: the checkpoint root (shared storage): ``step-<N>/`` directories are committed here.
        keep: committed checkpoints kept; older ones are deleted after each commit (rank 0).
        agree_interval_s: before a notice, the ranks agree about this often (as the Checkpointer).
        preemption: the deadline plan's margins and graces (``trainer.config.PreemptionConfig``).
        on_event: ``on_event(name, **fields)`` on every rank.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int = 3,
        agree_interval_s: float = 0.5,
        preemption: PreemptionConfig | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise UsageError(f"keep must be an int >= 1, got {keep!r}")
        if not 0 <= agree_interval_s < float("inf"):
            raise UsageError(f"agree_interval_s must be >= 0 seconds, got {agree_interval_s!r}")
        self.root = Path(root)
        self.keep = keep
        self.config = preemption or PreemptionConfig()
        self._agree_interval_s = agree_interval_s
        self._event = on_event or (lambda name, **fields: None)
        self.rank, self.world_size = 0, 1
        self.store: CheckpointStore | None = None
        self.step = 0
        self.last_saved: int | None = None
        self._noticed = self._just_noticed = self._stop = False
        self._source = ""
        self._deadline_ms: int | None = None
        self._next_boundary = 0
        self.boundaries = 0
        """Step boundaries so far (the agreements: bench/callbacks.py reads it)."""
        self._left = time.perf_counter()

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, step: int, resumed: bool) -> None:
        """Once per training run, on every rank, before the first step (collective)."""
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        if self.store is None:
            ckpt_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if distributed else None
            control_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if distributed else None
            self.store = CheckpointStore(root=self.root, rank=self.rank, world_size=self.world_size, group=ckpt_group)
            self._agreement = Agreement(group=control_group, world_size=self.world_size)
            self._runtime: Runtime = detect_runtime()
            if not self._runtime.install_sigterm():
                log.info(f"SIGTERM flag not installed; Ray's drain is the only notice rank={self.rank}")
        self._plan = DeadlinePlan(margin_factor=self.config.save_margin_factor, margin_s=self.config.save_margin_s)
        self._clock = NoticeClock(sigterm_grace_s=self.config.sigterm_grace_s, no_deadline_s=self.config.no_deadline_s)
        self.step = step
        self.last_saved = step if resumed else None
        newest = max(committed_steps(self.root), default=None)
        if newest is not None and newest > step:
            raise UsageError(
                f"training starts at step {step} but {self.root}/step-{newest} is committed: pass the "
                "newest checkpoint to the framework (newest_checkpoint(...), docs/your-trainer.md) so the run "
                "resumes it instead of training those steps again"
            )
        self._left = time.perf_counter()

    # ------------------------------------------------------------------ the step boundary
    def step_end(self, step: int, *, last: bool) -> str | None:
        """After optimizer step ``step``: ``"preemption"`` or ``"final"`` to save it now, else None.

        Collective at a boundary.  ``last``: the run's last step (saved as ``final``; no hold).
        """
        if step <= self.step:
            raise UsageError(f"step {step} does not advance (the last was {self.step})")
        self.step = step
        reason = None
        if self._noticed or step >= self._next_boundary:
            self.boundaries += 1
            agreed = self._agree(step)
            self._plan.record_step(time.perf_counter() - self._left)
            self._next_boundary = agreed.next_step
            if agreed.notice:
                reason = self._take_notice(agreed)
            if self._noticed and agreed.stop:
                self._stop, reason = True, "preemption"
        else:
            self._plan.record_step(time.perf_counter() - self._left)
        if last:
            reason = "final"
        self._left = time.perf_counter()
        return reason

    def _agree(self, step: int) -> Agreed:
        info = self._runtime.preemption_info()
        stop = self._noticed and not self._plan.room_for_another_step(now=time.time(), deadline_ms=self._deadline_ms)
        agreed = self._agreement.agree(
            ray_notice=info is not None, sigterm=SIGTERM.received_at is not None,
            deadline_ms=self._clock.deadline_ms(info, agreed_ms=self._deadline_ms), stop=stop, step=step,
            propose_next=self._propose_next(step) if self.rank == 0 else 0,
        )
        if agreed.step_min != agreed.step_max:
            raise UsageError(f"ranks disagree on the step: steps {agreed.step_min} to {agreed.step_max} at the "
                             f"same boundary (this rank: {step})")
        return agreed

    def _propose_next(self, step: int) -> int:
        """Rank 0: the step of the next boundary (``DeadlinePlan.next_boundary``); after a notice, the next step."""
        if self._noticed:
            return step + 1
        return self._plan.next_boundary(step, interval_s=self._agree_interval_s)

    def _take_notice(self, agreed: Agreed) -> str | None:
        self._deadline_ms = agreed.deadline_ms
        if agreed.ray_notice:
            self._source = "ray"  # a drain ends in Ray's teardown, whatever came first
        if self._noticed:
            return None
        self._noticed = self._just_noticed = True
        self._source = agreed.source
        self._event("preemption_notice", step=self.step, deadline_ms=self._deadline_ms, source=agreed.source)
        log.warning(f"preemption notice step={self.step} deadline_ms={self._deadline_ms} source={agreed.source}")
        return "preemption"  # at once: the notice is best effort

    # ------------------------------------------------------------------ after the framework's save
    def committed(self, written: Path, *, step: int, reason: str, started: float,
                  metrics: Mapping[str, Any] | None = None, last: bool = False) -> Committed:
        """Commit what the framework wrote into ``written`` as ``step-<step>`` (collective), report
        it, prune; after a notice, hold when no further step fits before the deadline."""
        assert self.store is not None, "start() first"
        committed = self.store.commit_written(written, step=step, reason=reason, started=started)
        self.last_saved = committed.step
        self._plan.record_save(committed.save_seconds)
        self._event("checkpoint_committed", step=committed.step, reason=committed.reason,
                    path=str(committed.path), save_seconds=committed.save_seconds)
        self._runtime.report(committed, metrics={**dict(metrics or {}), "step": committed.step,
                                                 "reason": committed.reason})
        if self.rank == 0:
            prune(self.root, keep=self.keep)
        if self._noticed and not last:
            if self._just_noticed:
                self._just_noticed = False
                room = self._plan.room_for_another_step(now=time.time(), deadline_ms=self._deadline_ms)
                self._stop = self._agreement.agree_stop(not room, step=step) or self._stop
            if self._stop:
                self.hold()
        self._left = time.perf_counter()
        return committed

    def discard(self, written: Path) -> None:
        """A second save of a step already committed: rank 0 removes it once every rank wrote (collective)."""
        assert self.store is not None, "start() first"
        self.store.barrier()
        if self.rank == 0:
            shutil.rmtree(written, ignore_errors=True)

    def hold(self) -> NoReturn:
        """Train nothing more: wait for Ray's teardown (or, outside Ray, raise at the deadline)."""
        self._event("waiting_for_teardown", step=self.step)
        log.warning(f"saved; training no further step before the deadline step={self.step}")
        self._runtime.wait_for_teardown(
            deadline_ms=self._deadline_ms,
            timeout_s=self.config.teardown_timeout_s if self._source == "ray" else 0.0,
        )


def resume_point(root: str | Path) -> ResumePoint | None:
    """The newest checkpoint under ``root`` that verifies, the same on every rank (collective).

    Rank 0 scans (newest first; checkpoints that do not verify are logged and deleted, as
    :meth:`~trainer.resilience.Checkpointer.restore` does) and broadcasts its answer over the
    default process group; without one, this process scans alone.
    """
    root = Path(root)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    answer: list[Any] = [None]
    if rank == 0:
        point, rejected = find_resume_point(root)
        for r in rejected:
            log.warning(f"rejected checkpoint path={r.path} why={r.why!r}")
        answer = [point]
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]
