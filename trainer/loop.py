"""The per-rank train function of ``python -m trainer``: a user of ``trainer.resilience.Checkpointer``.

``ray_train_fn`` is what Ray Train runs in every worker; ``run`` is the same loop for any
runtime (the local launcher calls it in each of its processes).  The default process group is
already initialised by the caller (Ray Train's ``TorchConfig``, or the local launcher).

The loop is the one docs/your-trainer.md asks of any script: build the model (FSDP2) and
AdamW, ``restore`` the state, train a step, ``after_step``, and ``finish`` at the end.  Saving,
the agreement between ranks and the deadline plan are the checkpointer's; what is left here is
the model, the data (a pure function of seed and step), the RNG seeding of a rank with nothing
to restore, and rank 0's journal files.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointStore
from trainer.config import TrainConfig
from trainer.data import loss_weight, rank_batch, step_seed
from trainer.errors import EXIT_CRASHED, CheckpointError
from trainer.journal import Journal
from trainer.model import build_model, shard_model
from trainer.resilience import COLLECTIVE_TIMEOUT, Checkpointer
from trainer.runtime import attempt_counter

__all__ = ["COLLECTIVE_TIMEOUT", "ray_train_fn", "run"]

log = logging.getLogger(__name__)


def ray_train_fn(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``."""
    run(TrainConfig.from_dict(config))


def _checkpointer(cfg: TrainConfig) -> type[Checkpointer]:
    """``Checkpointer``, or with ``--crash-at`` (a test hook) one whose store ends every rank at
    that phase of that step's commit (``CheckpointStore.at_phase``)."""
    if cfg.crash_at is None:
        return Checkpointer
    phase_at, step_at = cfg.crash_at

    class CrashingStore(CheckpointStore):
        def at_phase(self, phase: str, step: int) -> None:
            if phase == phase_at and step == step_at:
                logging.shutdown()
                os._exit(EXIT_CRASHED)

    return type("CrashingCheckpointer", (Checkpointer,), {"store_type": CrashingStore})


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


class RunSeed:
    """The run's seed, saved with the state: a checkpoint of another seed is refused on load."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["seed"] != self.seed:
            raise CheckpointError(f"saved by a run with seed {state_dict['seed']}, this run has seed {self.seed}")


def _train_step(cfg: TrainConfig, model, optimizer, *, step: int, device: torch.device) -> float:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs, targets = rank_batch(
        seed=cfg.seed, step=step, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len,
        vocab_size=cfg.model.vocab_size, rank=rank, world_size=world_size,
    )
    model.train()
    loss = model.loss(inputs.to(device), targets.to(device))
    weight = loss_weight(cfg.batch_size, rank, world_size)  # 1.0 unless the batch splits unevenly
    if weight != 1.0:
        loss = loss * weight
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    return float(mean.item()) / world_size


def run(cfg: TrainConfig) -> int:
    """Train one attempt of the run on this rank; returns the last step trained."""
    # One intra-op thread: the same reduction order in every run (and ranks do not fight over
    # the cores).  The ops used here are deterministic on CPU; torch's deterministic mode is not
    # switched on because it costs about a second of imports per rank.
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = _device(cfg)
    journal = Journal(metrics_out=cfg.metrics_out, events_out=cfg.events_out, enabled=rank == 0)
    p = cfg.preemption
    ckpt = _checkpointer(cfg)(
        cfg.checkpoint_dir, every=cfg.checkpoint_every, keep=cfg.keep, async_save=cfg.async_save,
        total_steps=cfg.steps,
        save_margin_factor=p.save_margin_factor, save_margin_s=p.save_margin_s,
        sigterm_grace_s=p.sigterm_grace_s, no_deadline_s=p.no_deadline_s,
        teardown_timeout_s=p.teardown_timeout_s, on_event=journal.event,
        min_world_size=cfg.min_workers,
    )
    box = [attempt_counter(cfg.checkpoint_dir) if rank == 0 else 0]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    attempt = box[0]

    model = shard_model(build_model(cfg.model, seed=cfg.seed).to(device), device_type=device.type,
                        world_size=world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    state = {"model": model, "optim": optimizer, "run": RunSeed(cfg.seed)}
    _seed_process_rngs(cfg.seed, 0, rank)
    step = ckpt.restore(state)
    if step and not ckpt.rng_restored:  # resharded: no RNG state for this rank layout
        _seed_process_rngs(cfg.seed, step, rank)
    journal.event("started", world_size=world_size, attempt=attempt,
                  resumed_from_step=step if ckpt.restored_from is not None else None)
    started = time.perf_counter()
    while step < cfg.steps:
        loss = _train_step(cfg, model, optimizer, step=step + 1, device=device)
        step += 1
        journal.metric(step=step, loss=loss, world_size=world_size, attempt=attempt)
        pad = cfg.step_seconds_now() - (time.perf_counter() - started)
        if pad > 0:
            time.sleep(pad)
        ckpt.after_step(step, state, metrics={"loss": loss})
        started = time.perf_counter()
    ckpt.finish(state)
    journal.event("finished", step=step)
    return step
