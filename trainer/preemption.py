"""The per-step preemption decision, agreed by every rank, and the deadline plan.

Two sources can announce a preemption:

* **Ray** (``source: "ray"``): the daemon (or ``ray start --block`` on SIGTERM, or an
  autoscaler) drains a node with reason PREEMPTION and a deadline; Ray Train's preemption
  watcher polls the GCS every ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` (the launcher sets 0.5 s
  unless it is set already; Ray's default is 5 s) and hands a ``PreemptionInfo(deadline_ms, ...)``
  to every worker, which each rank reads locally (``trainer.runtime.RayRuntime``).
* **SIGTERM** (``source: "sigterm"``): a flag set by a signal handler in this process (local
  mode; on Ray workers the handler is installed on the actor's main thread).  The deadline is
  the time of the signal plus ``--sigterm-grace-s``.

At every step boundary (every ``k`` steps before a notice, see ``trainer.resilience``) each rank
contributes its view to one small all-reduce (MAX over a float64
vector) on a dedicated gloo group, so every rank acts on the same step with the same deadline:
``[ray notice, sigterm, -deadline_ms, stop, async save still writing, step, -step, next, resize]``
(step and -step say whether every rank is at the same step; ``next`` is rank 0's proposal for the
step of the next boundary, the others send 0; ``resize``: rank 0 found a request to save before
Ray Train resizes an elastic run, ``trainer.resize``).

**The margin.**  After a notice the run saves at once (the notice is best effort: the node may go
earlier than announced), then keeps training while, for every rank,

    now + step_estimate + save_budget <= deadline
    step_estimate = the slowest of the last 5 step boundaries (step + agreement + padding)
    save_budget   = max(save seconds measured in this attempt) * save_margin_factor + save_margin_s

(defaults 1.5 and 2 s).  When that no longer holds on some rank, every rank saves the step it is
on (if it trained any step since the last save) and then trains nothing more: it waits to be
torn down, because a step trained after the last save would be lost and trained twice.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_NO_DEADLINE = 1e18  # encodes "no deadline" in the MAX all-reduce (as -1e18)


class SigtermFlag:
    """Set by SIGTERM; remembers when the first one arrived (unix seconds)."""

    def __init__(self) -> None:
        self.received_at: float | None = None
        self.installed = False

    def handler(self, signum: int, frame: object) -> None:
        if self.received_at is None:
            self.received_at = time.time()

    def clear(self) -> None:
        self.received_at = None


#: The process-wide flag (a signal handler is per process).
SIGTERM = SigtermFlag()


def install_sigterm_flag() -> bool:
    """Make SIGTERM set :data:`SIGTERM` instead of ending the process; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, SIGTERM.handler)
    SIGTERM.installed = True
    return True


@dataclass(frozen=True)
class Agreed:
    """What every rank agreed on at one step boundary."""

    ray_notice: bool
    sigterm: bool
    deadline_ms: int | None
    stop: bool
    async_writing: bool
    step_min: int = 0
    step_max: int = 0
    next_step: int = 0
    resize: bool = False

    @property
    def notice(self) -> bool:
        return self.ray_notice or self.sigterm

    @property
    def source(self) -> str:
        return "ray" if self.ray_notice else "sigterm"


class Agreement:
    """One MAX all-reduce per step boundary over a gloo group (cheap: nine float64)."""

    def __init__(self, *, group: dist.ProcessGroup | None, world_size: int) -> None:
        self._group = group
        self._world_size = world_size

    def agree(
        self,
        *,
        ray_notice: bool,
        sigterm: bool,
        deadline_ms: float | None,
        stop: bool = False,
        async_writing: bool = False,
        step: int = 0,
        propose_next: int = 0,
        resize: bool = False,
    ) -> Agreed:
        vec = torch.tensor(
            [
                float(ray_notice),
                float(sigterm),
                -(deadline_ms if deadline_ms is not None else _NO_DEADLINE),
                float(stop),
                float(async_writing),
                float(step),
                -float(step),
                float(propose_next),
                float(resize),
            ],
            dtype=torch.float64,
        )
        if self._world_size > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self._group)
        v = vec.tolist()
        deadline = None if -v[2] >= _NO_DEADLINE else int(-v[2])
        return Agreed(
            ray_notice=v[0] > 0, sigterm=v[1] > 0, deadline_ms=deadline, stop=v[3] > 0,
            async_writing=v[4] > 0, step_min=int(-v[6]), step_max=int(v[5]), next_step=int(v[7]),
            resize=v[8] > 0,
        )

    def agree_stop(self, stop: bool, *, step: int = 0) -> bool:
        """Whether any rank wants to stop (a second, stop-only agreement after a save)."""
        return self.agree(ray_notice=False, sigterm=False, deadline_ms=None, stop=stop, step=step).stop


class DeadlinePlan:
    """Whether one more step, then a save, still finishes before the deadline."""

    def __init__(self, *, margin_factor: float, margin_s: float, window: int = 5) -> None:
        if margin_factor < 1.0:
            raise ValueError(f"margin_factor must be >= 1, got {margin_factor}")
        self.margin_factor = margin_factor
        self.margin_s = margin_s
        self._saves: list[float] = []
        self._steps: collections.deque[float] = collections.deque(maxlen=window)
        self._gap = 0  # steps between the last two boundaries (0: none proposed yet)

    def record_save(self, seconds: float) -> None:
        self._saves.append(seconds)

    def record_step(self, seconds: float) -> None:
        self._steps.append(seconds)

    def save_budget_s(self) -> float:
        return max(self._saves, default=0.0) * self.margin_factor + self.margin_s

    def step_estimate_s(self) -> float:
        return max(self._steps, default=0.0)

    def mean_step_s(self) -> float:
        """The mean of the last steps (0 before any): the usual step, not the worst."""
        return sum(self._steps) / len(self._steps) if self._steps else 0.0

    def next_boundary(self, step: int, *, interval_s: float) -> int:
        """The step of the next agreement before a notice: about ``interval_s`` ahead at the mean
        step, at most twice the last gap and 1000 steps, at least the next step.

        The gap grows at most twofold per boundary (1, 2, 4, ...), so steps that were fast at
        first (a first step without the data loader's wait, a loss logger that sleeps after the
        guard's hook) cannot put the next boundary far ahead: a notice is heard within a few of
        the steps as they are now.
        """
        estimate = self.mean_step_s()
        ahead = 1 if estimate <= 0 else int(interval_s / estimate)
        self._gap = max(1, min(1000, 2 * self._gap, ahead))
        return step + self._gap

    def room_for_another_step(self, *, now: float, deadline_ms: int | None) -> bool:
        """True when ``now + step + save budget`` is not after the deadline (None: no limit)."""
        if deadline_ms is None:
            return True
        return now + self.step_estimate_s() + self.save_budget_s() <= deadline_ms / 1000.0



class NoticeClock:
    """This rank's deadline, from what it knows: Ray's notice, the SIGTERM flag, the agreed one.

    A Ray notice carries its deadline; one without gets ``no_deadline_s`` after this rank first
    saw it.  A SIGTERM gets ``sigterm_grace_s`` after the signal.  The earliest wins, and never
    one later than the deadline agreed before (``agreed_ms``).  Shared by
    :class:`trainer.resilience.Checkpointer` and the framework callbacks (trainer.integrations).
    """

    def __init__(self, *, sigterm_grace_s: float, no_deadline_s: float) -> None:
        self.sigterm_grace_s = sigterm_grace_s
        self.no_deadline_s = no_deadline_s
        self._ray_first_seen: float | None = None

    def deadline_ms(self, info: object | None, *, agreed_ms: int | None) -> float | None:
        """The earliest deadline known (unix ms), or None; ``info``: Ray's notice or None."""
        candidates = []
        if info is not None:
            deadline = getattr(info, "deadline_ms", None)
            if deadline:
                candidates.append(float(deadline))
            else:
                self._ray_first_seen = self._ray_first_seen or time.time()
                candidates.append((self._ray_first_seen + self.no_deadline_s) * 1000.0)
        if SIGTERM.received_at is not None:
            candidates.append((SIGTERM.received_at + self.sigterm_grace_s) * 1000.0)
        if agreed_ms is not None:
            candidates.append(float(agreed_ms))
        return min(candidates) if candidates else None
