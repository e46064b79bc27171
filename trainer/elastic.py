"""Elastic runs on Ray Train 2.60: the controller side (``ElasticCallback``) and its config.

``ScalingConfig(num_workers=(min, max))`` makes Ray Train use its ``ElasticScalingPolicy``
(ray/train/v2/_internal/execution/scaling_policy/elastic.py, Ray 2.60.0).  What that does, read
from the source:

* **After a preemption** (``TrainController._handle_preempting_state``: the deadline passed or
  every rank exited) the run goes to ``RestartingState`` and the policy decides the size from the
  resources the ``AutoscalingCoordinator`` reserved for it: every *alive* node's resources
  (``_update_cluster_node_resources``), divided by one worker's, at most ``max``; fewer than
  ``min``: it waits.  Nothing else is waited for, so the survivors restart at the smaller size
  as soon as the lost node is gone.
* **Growing back**: while the group runs, every ``elastic_resize_monitor_interval_s`` (60 s by
  default) the policy counts again; more workers fit: ``ResizingState``, then
  ``_execute_resize_decision`` shuts the whole group down and starts a larger one (a restart,
  not a hot add).
* The coordinator refreshes its view of the nodes every ``TICK_INTERVAL_S`` = 20 s
  (ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py); a node that died
  or joined is seen up to 20 s late, and a restart decided on the stale view tries to place a
  worker on the dead node (and waits ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s, to fail).

``ElasticCallback`` (a Ray Train ``ControllerCallback``, and a ``WorkerGroupCallback`` for the
milestones of a group's start; passed in ``RunConfig(callbacks=...)``) closes the gaps without
changing Ray:

1. when the run restarts after a preemption, it waits (at most ``node_gone_timeout_s``) until
   the preempted nodes are no longer alive, then has the coordinator look at the cluster again
   (``get_reserved_resources(..., recompute=True)``): the decision is made on the nodes that
   are really there;
2. while the run is smaller than ``max``, it has the coordinator look again every
   ``refresh_interval_s`` (2 s), so a joining node counts at the next resize consideration;
3. before a resize of a *running* group, it asks the ranks to save the step they are on
   (``trainer.resize``: a request file under the checkpoint root, answered by
   ``Checkpointer.after_step``) and waits for the answer (at most ``save_timeout_s``): the larger
   group resumes from that step, no step is trained twice;
4. once the preempted nodes are gone, it decides whether to shrink now or to wait for the
   replacement (``trainer.replacement``: the daemon's estimate of when the replacement joins, in
   the GCS KV, against what a restart cost this run, ``trainer.restarts``); to wait, it holds the
   restart (at most until the expected join plus one restart, and ``max_wait_s``) until the
   cluster holds ``max`` workers again, so that Ray Train restarts once, at full size;
5. it starts the clock of every (re)start when a size is decided (``trainer.restarts``), which
   rank 0's ``Checkpointer`` stops after the group's first step.

The callback runs in Ray Train's controller actor: the checkpoint root must be readable and
writable there too (the FSx mount on the head as on the workers).  Its hooks never raise: a
failure is logged and the run goes on as Ray would run it without the callback.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    ReschedulingState,
    ResizingState,
    RestartingState,
    RunningState,
    SchedulingState,
)

from trainer import replacement, resize, restarts

log = logging.getLogger(__name__)

#: The requester id this callback uses to make the coordinator tick; it reserves nothing.
_TICK_REQUESTER = "trainer.elastic"


class ElasticCallback(ControllerCallback, WorkerGroupCallback):
    """Ray Train controller callback of an elastic run whose ranks use ``Checkpointer``.

    Args:
        root: the run's checkpoint root (the ``Checkpointer``'s).
        max_workers: the run's ``max`` (``ScalingConfig.num_workers[1]``).
        save_timeout_s: how long a resize waits for the ranks' save before it goes on.
        node_gone_timeout_s: how long a restart after a preemption waits for the preempted
            nodes to be gone.
        refresh_interval_s: while the run is short of ``max``, how often the coordinator is
            made to look at the cluster again.
        resize_interval_s: the run's ``elastic_resize_monitor_interval_s`` (what a replacement
            waits, on average half of it, before the run grows onto it).
        max_wait_s: the longest a restart waits for a replacement, whatever the estimate.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_workers: int, save_timeout_s: float = 60.0,
                 node_gone_timeout_s: float = 60.0, refresh_interval_s: float = 2.0,
                 resize_interval_s: float = 60.0, max_wait_s: float = 600.0) -> None:
        self.root = str(root)
        self.max_workers = max_workers
        self.save_timeout_s = save_timeout_s
        self.node_gone_timeout_s = node_gone_timeout_s
        self.refresh_interval_s = refresh_interval_s
        self.resize_interval_s = resize_interval_s
        self.max_wait_s = max_wait_s
        self._workers = 0
        self._per_worker: dict[str, float] = {"CPU": 1.0}
        self._resizing_running = False
        self._last_refresh = float("-inf")
        self._decision: dict[str, Any] | None = None

    # ------------------------------------------------------------------ Ray Train's hooks
    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> None:
        self._workers = num_workers
        per_worker = getattr(scaling_config, "_resources_per_worker_not_none", None)
        if isinstance(per_worker, dict) and per_worker:
            self._per_worker = {k: float(v) for k, v in per_worker.items() if v}
        return None

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        try:
            if isinstance(current_state, SchedulingState):
                self._resizing_running = isinstance(previous_state, ResizingState)
                self._start_clock(previous_state, current_state)
            elif isinstance(current_state, (RestartingState, ReschedulingState)) \
                    and type(previous_state) is not type(current_state):
                error = getattr(current_state, "training_failed_error", None)
                self._wait_for_preempted_nodes(error)
                try:
                    self._decide_and_maybe_wait(error)
                except Exception:  # no decision: the run restarts as Ray Train decides (shrinks)
                    log.warning("elastic callback: shrink-or-wait decision failed", exc_info=True)
                self._refresh(force=True)
            elif isinstance(current_state, RunningState) and self._workers < self.max_workers:
                self._refresh()
        except Exception:  # never fail the run from here
            log.warning("elastic callback: state update hook failed", exc_info=True)

    def before_controller_execute_resize_decision(self, resize_decision: Any) -> None:
        if not self._resizing_running:
            return  # no running group: nobody to save
        self._resizing_running = False
        try:
            self._save_before_resize(int(resize_decision.num_workers))
        except Exception:
            log.warning("elastic callback: save before the resize failed", exc_info=True)

    # the worker group's milestones, for the restart clock (trainer.restarts)
    def before_worker_group_start(self, worker_group_context: Any) -> None:
        self._mark("group_start")

    def before_init_train_context(self, workers: Any) -> dict[str, list[Any]]:
        self._mark("actors_ready")  # placement group ready, worker actors created
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._mark("group_ready")  # train context and torch process group set up on every worker

    def after_worker_group_training_start(self, worker_group: Any) -> None:
        self._mark("launched")

    # ------------------------------------------------------------------ the work
    def _start_clock(self, previous_state: Any, current_state: Any) -> None:
        kind = ("resize" if isinstance(previous_state, ResizingState)
                else "start" if isinstance(previous_state, InitializingState) else "restart")
        workers = getattr(getattr(current_state, "scaling_decision", None), "num_workers", None)
        restarts.begin(self.root, kind=kind, workers=int(workers or 0), decision=self._decision)
        self._decision = None

    def _mark(self, name: str) -> None:
        try:
            restarts.mark(self.root, name)
        except Exception:
            log.warning(f"elastic callback: restart clock mark {name} failed", exc_info=True)

    def _save_before_resize(self, workers: int) -> None:
        request_id = uuid.uuid4().hex
        asked = time.monotonic()
        resize.request(self.root, request_id=request_id, workers=workers)
        try:
            while time.monotonic() - asked < self.save_timeout_s:
                step = resize.answered(self.root, request_id)
                if step is not None:
                    log.info(f"elastic: saved before the resize step={step} "
                             f"seconds={time.monotonic() - asked:.1f} workers={self._workers}->{workers}")
                    return
                time.sleep(0.1)
            log.warning(f"elastic: no save before the resize; resizing anyway (steps since the last "
                        f"checkpoint will be trained again) timeout_s={self.save_timeout_s:.0f}")
        finally:
            resize.clear(self.root)

    def _wait_for_preempted_nodes(self, error: Any) -> None:
        nodes = set(_preempted(error))
        if not nodes:
            return
        started = time.monotonic()
        end = started + self.node_gone_timeout_s
        while time.monotonic() < end:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if not nodes & alive:
                log.info(f"elastic: the preempted nodes are gone waited_s={time.monotonic() - started:.1f}")
                return
            time.sleep(0.25)
        log.warning(f"elastic: preempted nodes still alive; restarting anyway nodes={sorted(nodes & alive)} "
                    f"timeout_s={self.node_gone_timeout_s:.0f}")

    def _decide_and_maybe_wait(self, error: Any) -> None:
        """Shrink now, or hold the restart until the replacement joins (``trainer.replacement``)."""
        lost = _preempted(error)
        if not lost:
            return
        ranks = sum(len(r) for r in lost.values())
        decision = replacement.decide(
            now=time.time(), expected=self._expected(lost), restart_s=restarts.last_cost(self.root),
            survivors=max(self._workers - ranks, 1), resize_interval_s=self.resize_interval_s,
            max_wait_s=self.max_wait_s)
        log.info(f"elastic: {decision.reason}")
        self._decision = {"choice": "wait" if decision.wait else "shrink", "reason": decision.reason}
        if decision.wait_until is None:
            return
        started = time.time()
        outcome = replacement.wait_for_replacement(
            until=decision.wait_until, room=lambda: self._workers_that_fit() >= self.max_workers,
            still_expected=lambda: all(e.at is not None for e in self._expected(lost)))
        waited = round(time.time() - started, 1)
        self._decision.update(waited_s=waited, outcome=outcome)
        if outcome == "joined":
            log.info(f"elastic: the replacement joined; restarting at full size waited_s={waited}")
        else:
            log.warning(f"elastic: the replacement is {outcome}; restarting at the smaller size waited_s={waited}")

    def _expected(self, lost: dict[str, Any]) -> list[replacement.Expected]:
        from ray.experimental import internal_kv

        return [replacement.Expected.parse(node, internal_kv._internal_kv_get(
            replacement.key(node), namespace=replacement.NAMESPACE)) for node in lost]

    def _workers_that_fit(self) -> int:
        """Workers the alive nodes' resources hold (as the elastic policy counts them)."""
        total = 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources") or {}
            total += int(min(resources.get(k, 0.0) // v for k, v in self._per_worker.items()))
        return total

    def _refresh(self, *, force: bool = False) -> None:
        """Make the AutoscalingCoordinator look at the cluster now (it does every 20 s)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < self.refresh_interval_s:
            return
        self._last_refresh = now
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.get_reserved_resources.remote(_TICK_REQUESTER, recompute=True), timeout=5)


def _preempted(error: Any) -> dict[str, Any]:
    """{preempted node id (hex): its ranks} of a preemption error ({}: not a preemption)."""
    info = getattr(error, "preemption_info", None)
    return dict(getattr(info, "preempted_node_to_ranks", None) or {})


def scaling_kwargs(*, min_workers: int | None, max_workers: int, resize_interval_s: float) -> dict[str, Any]:
    """``ScalingConfig`` arguments: ``num_workers`` fixed, or ``(min, max)`` with the interval."""
    if min_workers is None:
        return {"num_workers": max_workers}
    return {"num_workers": (min_workers, max_workers), "elastic_resize_monitor_interval_s": resize_interval_s}


__all__ = ["ElasticCallback", "scaling_kwargs"]

