"""Rank functions for ``tests.support.ranks.run_ranks``: examples/resilient_train.py without Ray.

They run in the rank processes (imported there by name), so they live in a module of their
own that imports only torch, the trainer and the example.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import resilient_train as example  # noqa: E402

from trainer.errors import EXIT_CRASHED  # noqa: E402
from tests.support.crashing import crashing  # noqa: E402
from trainer.resilience import Checkpointer  # noqa: E402


def config(root: Path, losses: Path, *, steps: int, wrap: str = "fsdp2", every: int = 0, **more: Any) -> dict:
    """The example's train_loop_config."""
    return {"checkpoint_dir": str(root), "losses_out": str(losses), "steps": steps, "every": every,
            "keep": 100, "wrap": wrap, "seed": 0, "step_seconds": 0.0, **more}


def train(rank: int, world_size: int, cfg: dict) -> None:
    """The example's train function, as it is."""
    example.train_func(cfg)


def train_and_crash(rank: int, world_size: int, cfg: dict, phase: str, step: int) -> None:
    """The example's train function, every rank exiting abruptly at a save phase of a step."""

    example.Checkpointer = crashing(phase, step, die=lambda: os._exit(EXIT_CRASHED))
    example.train_func(cfg)


def disagree_on_the_step(rank: int, world_size: int, root: str) -> None:
    """Rank r says it trained 1 + r steps."""
    import torch

    state = {"model": torch.nn.Linear(2, 2)}
    ckpt = Checkpointer(root)
    ckpt.restore(state)
    ckpt.after_step(1 + rank, state)
