"""The per-rank train function: set up, resume, train, save, react to a preemption notice.

``ray_train_fn`` is what Ray Train runs in every worker; ``run`` is the same loop for any
runtime (the local launcher calls it in each of its processes).  The default process group is
already initialised by the caller (Ray Train's ``TorchConfig``, or the local launcher).

Per step boundary (before training step N+1, with N steps done):

1. every rank asks the runtime for a notice (``ray.train.get_preemption_info()``: a barrier)
   and agrees with the others on notice, deadline, stop and async-save state (one all-reduce);
2. an async periodic save whose files every rank has written is committed;
3. on the first notice: save the step at once, then decide (again together) whether another
   step and a save still fit before the deadline;
4. once they do not: save the step if it is not saved yet, then wait to be torn down;
5. otherwise train step N+1 and write its metrics line (rank 0), then a periodic save if due.

After the last step: a final save (unless the step is saved already), ``finished``, and a clean
return, which marks the Ray Train run FINISHED.
"""

from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint import Checkpointer, Committed, PendingSave, TrainState, prune
from trainer.config import TrainConfig
from trainer.data import rank_batch, step_seed
from trainer.errors import EXIT_CRASHED
from trainer.journal import Journal
from trainer.model import build_model, shard_model
from trainer.preemption import SIGTERM, Agreement, DeadlinePlan
from trainer.runtime import RayRuntime, Runtime, attempt_counter

log = logging.getLogger(__name__)

#: Timeout of the gloo groups' collectives: long enough for a slow save, short enough that a
#: lost peer does not hang a rank for Ray's default of 30 minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def ray_train_fn(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``."""
    run(TrainConfig.from_dict(config), RayRuntime())


def _crash_hook(cfg: TrainConfig):
    if cfg.crash_at is None:
        return None
    phase_at, step_at = cfg.crash_at

    def hook(phase: str, step: int) -> None:
        if phase == phase_at and step == step_at:
            logging.shutdown()
            os._exit(EXIT_CRASHED)

    return hook


def _seed_process_rngs(seed: int, step: int, rank: int) -> None:
    """RNG states for a rank that has none to restore: a function of (seed, step, rank)."""
    s = step_seed(seed, step, stream=1 + rank)
    torch.manual_seed(s)
    np.random.seed(s % (2**32))
    random.seed(s)


def _device(cfg: TrainConfig) -> torch.device:
    if not cfg.use_gpu:
        return torch.device("cpu")
    import ray.train.torch  # --use-gpu needs Ray (the config refuses it in local mode)

    device = ray.train.torch.get_device()
    torch.cuda.set_device(device)
    return device


class _Run:
    """The state of one rank in one attempt."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = _device(cfg)
        # Checkpoint collectives run on their own gloo group (async saves run them in a
        # background thread); the per-step agreement has a third one, so neither ever
        # interleaves with the other or with training's collectives.
        self.ckpt_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        self.control_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        self.journal = Journal(metrics_out=cfg.metrics_out, events_out=cfg.events_out, enabled=self.rank == 0)
        self.checkpointer = Checkpointer(
            root=cfg.checkpoint_dir, rank=self.rank, world_size=self.world_size,
            group=self.ckpt_group, hook=_crash_hook(cfg),
        )
        self.agreement = Agreement(group=self.control_group, world_size=self.world_size)
        self.plan = DeadlinePlan(
            margin_factor=cfg.preemption.save_margin_factor, margin_s=cfg.preemption.save_margin_s
        )
        self.attempt = self._broadcast(attempt_counter(cfg.checkpoint_dir) if self.rank == 0 else 0)

        model = build_model(cfg.model, seed=cfg.seed).to(self.device)
        self.model = shard_model(model, device_type=self.device.type, world_size=self.world_size)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
        )
        self.state = TrainState(self.model, self.optimizer)
        self.step = 0
        self.last_saved = 0
        self.pending: PendingSave | None = None

    # ---------------------------------------------------------------- helpers
    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.ckpt_group)
        return box[0]

    def _samples(self, step: int) -> int:
        return step * self.cfg.batch_size

    # ---------------------------------------------------------------- resume
    def resume(self) -> None:
        point, rejected = self.checkpointer.broadcast_resume()
        for r in rejected:
            log.warning("rejected checkpoint %s: %s", r.path, r.why)
            self.journal.event("checkpoint_rejected", path=str(r.path), why=r.why)
        if point is None:
            _seed_process_rngs(self.cfg.seed, 0, self.rank)
        else:
            progress = self.checkpointer.load(point, self.state, seed=self.cfg.seed)
            self.step = self.last_saved = point.manifest.step
            if not progress["rng_restored"]:  # resharded: no RNG state for this rank layout
                _seed_process_rngs(self.cfg.seed, self.step, self.rank)
            log.info("resumed from %s (saved by %d ranks)", point.path, point.manifest.world_size)
        self.journal.event(
            "started", world_size=self.world_size, attempt=self.attempt,
            resumed_from_step=point.manifest.step if point else None,
        )

    # ---------------------------------------------------------------- saving
    def _commit(self, pending: PendingSave) -> Committed:
        committed = self.checkpointer.commit(pending)
        self.last_saved = committed.step
        if pending.future is None:  # only synchronous saves say how long a save blocks
            self.plan.record_save(committed.save_seconds)
        self.journal.event(
            "checkpoint_committed", step=committed.step, reason=committed.reason,
            path=str(committed.path), save_seconds=committed.save_seconds,
        )
        self.runtime.report(committed, metrics={"step": committed.step, "reason": committed.reason})
        if self.rank == 0:
            prune(self.cfg.checkpoint_dir, keep=self.cfg.keep)
        return committed

    def finish_pending(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._commit(pending)

    def save_now(self, reason: str) -> None:
        """Synchronous save of the current step, unless it is saved already."""
        self.finish_pending()
        if self.last_saved == self.step:
            return
        pending = self.checkpointer.start(
            self.state, step=self.step, seed=self.cfg.seed, samples_seen=self._samples(self.step),
            reason=reason,
        )
        self._commit(pending)

    def periodic_save(self) -> None:
        self.finish_pending()
        pending = self.checkpointer.start(
            self.state, step=self.step, seed=self.cfg.seed, samples_seen=self._samples(self.step),
            reason="periodic", use_async=self.cfg.async_save,
        )
        if pending.future is None:
            self._commit(pending)
        else:
            self.pending = pending

    # ---------------------------------------------------------------- training
    def train_step(self) -> float:
        step = self.step + 1
        inputs, targets = rank_batch(
            seed=self.cfg.seed, step=step, batch_size=self.cfg.batch_size, seq_len=self.cfg.model.seq_len,
            vocab_size=self.cfg.model.vocab_size, rank=self.rank, world_size=self.world_size,
        )
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        self.model.train()
        loss = self.model.loss(inputs, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.SUM)
        self.step = step
        return float(mean.item()) / self.world_size

    # ---------------------------------------------------------------- the loop
    def loop(self) -> None:
        cfg, p = self.cfg, self.cfg.preemption
        deadline_ms: int | None = None
        noticed = False
        source = ""
        ray_first_seen: float | None = None
        while True:
            boundary = time.perf_counter()
            info = self.runtime.preemption_info()
            candidates = []
            if info is not None:
                if info.deadline_ms:
                    candidates.append(float(info.deadline_ms))
                else:
                    ray_first_seen = ray_first_seen or time.time()
                    candidates.append((ray_first_seen + p.no_deadline_s) * 1000.0)
            if SIGTERM.received_at is not None:
                candidates.append((SIGTERM.received_at + p.sigterm_grace_s) * 1000.0)
            if deadline_ms is not None:
                candidates.append(float(deadline_ms))
            local_deadline = min(candidates) if candidates else None
            stop = noticed and not self.plan.room_for_another_step(now=time.time(), deadline_ms=deadline_ms)
            agreed = self.agreement.agree(
                ray_notice=info is not None, sigterm=SIGTERM.received_at is not None,
                deadline_ms=local_deadline, stop=stop,
                async_writing=self.pending is not None and not self.pending.written(),
            )
            boundary_s = time.perf_counter() - boundary  # the notice poll and the agreement
            if self.pending is not None and not agreed.async_writing:
                self.finish_pending()
            if agreed.notice:
                deadline_ms = agreed.deadline_ms
            if agreed.ray_notice:
                source = "ray"  # a drain ends in Ray's teardown, whatever came first
            if agreed.notice and not noticed:
                noticed = True
                source = agreed.source
                self.journal.event(
                    "preemption_notice", step=self.step, deadline_ms=deadline_ms, source=agreed.source
                )
                log.warning("preemption notice at step %d, deadline %s (%s)", self.step, deadline_ms, agreed.source)
                self.save_now("preemption")  # at once: the notice is best effort
                stop = self.agreement.agree_stop(
                    not self.plan.room_for_another_step(now=time.time(), deadline_ms=deadline_ms)
                )
            else:
                stop = agreed.stop
            if noticed and stop and self.step < cfg.steps:
                self.save_now("preemption")
                self.journal.event("waiting_for_teardown", step=self.step)
                log.warning("saved step %d; training no further step before the deadline", self.step)
                # A Ray drain ends in Ray's teardown; a bare SIGTERM asked this process to go.
                self.runtime.wait_for_teardown(
                    deadline_ms=deadline_ms,
                    timeout_s=p.teardown_timeout_s if source == "ray" else 0.0,
                )
            if self.step >= cfg.steps:
                break
            started = time.perf_counter()
            loss = self.train_step()
            self.journal.metric(step=self.step, loss=loss, world_size=self.world_size, attempt=self.attempt)
            if cfg.min_step_seconds:
                pad = cfg.min_step_seconds - (boundary_s + time.perf_counter() - started)
                if pad > 0:
                    time.sleep(pad)
            # what one more step costs: its boundary and the step (not a save made in between)
            self.plan.record_step(boundary_s + time.perf_counter() - started)
            if (
                cfg.checkpoint_every
                and self.step % cfg.checkpoint_every == 0
                and self.step < cfg.steps
                and not noticed
            ):
                self.periodic_save()
        self.save_now("final")
        self.journal.event("finished", step=self.step)


def run(cfg: TrainConfig, runtime: Runtime) -> int:
    """Train one attempt of the run on this rank; returns the last step trained."""
    # One intra-op thread: the same reduction order in every run (and ranks do not fight over
    # the cores).  The ops used here are deterministic on CPU; torch's deterministic mode is not
    # switched on because it costs about a second of imports per rank.
    torch.set_num_threads(1)
    run_ = _Run(cfg, runtime)
    if not runtime.install_sigterm():
        log.info("SIGTERM flag not installed on rank %d; Ray's drain is the only notice", run_.rank)
    run_.resume()
    run_.loop()
    return run_.step
