"""Rank functions for ``tests.support.ranks.run_ranks``: python -m trainer's step at any world size,
and a Checkpointer asked to save before a resize.

They run in the rank processes (imported there by name), so they import only torch and the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer import resize
from trainer.errors import PreemptedError


def train_steps(rank: int, world_size: int, steps: int, batch_size: int) -> dict[str, Any]:
    """``steps`` optimizer steps of python -m trainer's model (FSDP2, no dropout) on this world.

    Returns the losses (the mean over the global batch, the same on every rank).
    """
    import torch
    from trainer.config import ModelConfig, TrainConfig
    from trainer.loop import _train_step
    from trainer.model import build_model, shard_model

    torch.set_num_threads(1)
    cfg = TrainConfig(checkpoint_dir=Path("/nonexistent"), num_workers=world_size, batch_size=batch_size,
                      model=ModelConfig(d_model=32, n_heads=4, seq_len=16, dropout=0.0))
    model = shard_model(build_model(cfg.model, seed=0), device_type="cpu", world_size=world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    losses = [_train_step(cfg, model, optim, step=s, device=torch.device("cpu")) for s in range(1, steps + 1)]
    return {"losses": losses}


def resize_at(rank: int, world_size: int, root: str, steps: int, request_after: int) -> dict[str, Any]:
    """Train a linear model; once step ``request_after`` is done rank 0 plays Ray Train's
    controller and asks for a save before a resize (``trainer.resize.request``)."""
    import torch

    from trainer.resilience import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    events: list[tuple[str, int | None]] = []  # (event, the step answered when it was recorded)
    ckpt = Checkpointer(root, agree_interval_s=0.0,
                        on_event=lambda name, **f: events.append((name, resize.answered(root, "req-1"))))
    step = restored = ckpt.restore(state)
    trained = []
    try:
        while step < steps:
            model(torch.ones(2, 4)).sum().backward()
            optim.step()
            optim.zero_grad()
            step += 1
            trained.append(step)
            if rank == 0 and step == request_after:
                resize.request(root, request_id="req-1", workers=3)
            ckpt.after_step(step, state)
        ckpt.finish(state)
        outcome = "finished"
    except PreemptedError:  # outside Ray, "wait to be torn down" ends in PreemptedError at once
        outcome = "held"
    return {"outcome": outcome, "restored": restored, "trained": trained,
            "events": [name for name, _ in events], "answered": resize.answered(root, "req-1"),
            "answered_at_event": {name: answered for name, answered in events}}


def train_segment(rank: int, world_size: int, root: str, stop: int, dtype: str, batch: int) -> dict[str, Any]:
    """python -m trainer's model (FSDP2, no dropout, global batch ``batch``) in ``dtype``: restore the
    newest checkpoint under ``root`` (DCP reshards it to this world size), train up to step
    ``stop``, save it.  Returns the losses by step.
    """
    import torch
    from trainer.config import ModelConfig, TrainConfig
    from trainer.loop import _train_step
    from trainer.model import build_model, shard_model
    from trainer.resilience import Checkpointer

    torch.set_num_threads(1)
    torch.set_default_dtype(getattr(torch, dtype))
    cfg = TrainConfig(checkpoint_dir=Path(root), num_workers=world_size, batch_size=batch,
                      model=ModelConfig(d_model=32, n_heads=4, seq_len=16, dropout=0.0))
    model = shard_model(build_model(cfg.model, seed=0), device_type="cpu", world_size=world_size)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    state = {"model": model, "optim": optim}
    ckpt = Checkpointer(root, total_steps=stop)
    step = ckpt.restore(state)
    losses = {}
    while step < stop:
        step += 1
        losses[step] = _train_step(cfg, model, optim, step=step, device=torch.device("cpu"))
        ckpt.after_step(step, state)
    ckpt.finish(state)
    return {"losses": losses}
