"""Scenario 5's trainer: rank functions for ``tests.support.ranks.run_ranks`` (gloo, no Ray).

They run in the rank processes (imported there by name), so this module imports only torch and
the trainer. The trainer is :class:`trainer.resilience.Checkpointer` as a user's loop drives it:
a model whose every parameter holds the number of steps trained (so a resume shows which step it
loaded), a periodic save every ``every`` steps, and a SIGKILL of the rank at one phase of the save
of step ``at``:

``shard-mid-write``  inside ``dcp.save``: after the ``1 + nth``-th tensor of this rank's shard file
                     is on disk (torch's ``filesystem._write_item``, wrapped here)
``files-written``    every rank: shards and RNG files durable, no manifest (the Checkpointer's
                     ``CheckpointStore.at_phase``, filled by ``tests.support.crashing``)
``manifest-torn``    rank 0: ``manifest.json.tmp`` written, not renamed
``manifest-written`` rank 0: ``manifest.json`` in place, ``step-<at>.partial`` not renamed
``async-in-flight``  ``async_save``: the background write of step ``at`` holds after the
                     ``1 + nth``-th tensor; training goes on; the rank is killed after step ``at + 1``
``committed``        every rank, right after the rename (the control: the checkpoint is whole)

A rank not killed by its own phase (rank 1 at a rank-0 phase) is waiting in a collective;
``run_ranks`` kills it once rank 0 is dead, as the loss of a gang member would.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch

from tests.support.crashing import crashing
from trainer.resilience import Checkpointer

#: phases of a save, in the order they happen; ``committed`` is the control
PHASES = ("shard-mid-write", "files-written", "manifest-torn", "manifest-written", "async-in-flight", "committed")
HOOK_PHASES = {"files-written", "manifest-torn", "manifest-written", "committed"}
_LAYERS = 8
#: set once an async save's write is held (the main thread kills the rank only then)
HELD = threading.Event()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(_LAYERS)))


def _train_step(model: torch.nn.Module, step: int) -> None:
    """"Training": every parameter becomes ``step`` (what a resume loaded is then visible)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wrap_shard_writes(at: int, nth: int, *, hold: bool) -> None:
    """After the ``1 + nth``-th tensor of a ``step-<at>.partial`` shard: SIGKILL, or hold forever."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item
    written = [0]
    HELD.clear()

    def write_item(transforms: Any, stream: Any, data: Any, item: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(transforms, stream, data, item, *args, **kwargs)
        if f"step-{at}.partial" in str(getattr(stream, "name", "")) and isinstance(data, torch.Tensor):
            written[0] += 1
            if written[0] == 1 + nth:
                stream.flush()  # the bytes written so far are in the file, as a kill leaves them
                if hold:
                    HELD.set()
                    threading.Event().wait()  # the save stays in flight until the process dies
                _die()
        return result

    filesystem._write_item = write_item


def train_and_die(rank: int, world_size: int, root: str, phase: str, at: int, every: int, nth: int) -> None:
    """Train from what ``root`` holds, saving every ``every`` steps; SIGKILLed at ``phase`` of step ``at``."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
    in_flight = phase == "async-in-flight"
    if phase in ("shard-mid-write", "async-in-flight"):
        _wrap_shard_writes(at, nth, hold=in_flight)

    kind = crashing(phase, at, die=_die) if phase in HOOK_PHASES else Checkpointer
    model = _model()
    state = {"model": model}
    ckpt = kind(root, every=every, keep=100, async_save=in_flight, agree_interval_s=0.0)
    step = ckpt.restore(state)
    while step < at + 1:
        step += 1
        _train_step(model, step)
        ckpt.after_step(step, state)
        if in_flight and step == at + 1:
            if not HELD.wait(timeout=120):
                raise AssertionError(f"rank {rank}: the async save of step {at} never wrote a tensor")
            _die()  # step ``at``'s files are still being written (held above)
    raise AssertionError(f"rank {rank} was not killed at {phase} of step {at}")


def resume_and_go_on(rank: int, world_size: int, roots: list[str]) -> list[dict[str, Any]]:
    """For each root in turn (one trainer restarted per root, in the same processes): restore,
    check the weights are the step restored, train one more step, finish.

    Returns per root the step restored, the checkpoints rejected (``[name, why]``), whether
    every parameter held the restored step, and the step of the final save.
    """
    return [_resume(root) for root in roots]


def _resume(root: str) -> dict[str, Any]:
    rejected: list[list[str]] = []

    def on_event(name: str, **fields: Any) -> None:
        if name == "checkpoint_rejected":
            rejected.append([os.path.basename(fields["path"]), fields["why"]])

    model = _model()
    state = {"model": model}
    ckpt = Checkpointer(root, keep=100, agree_interval_s=0.0, on_event=on_event)
    step = ckpt.restore(state)
    weights_ok = all(bool(torch.all(p == float(step))) for p in model.parameters())
    _train_step(model, step + 1)
    ckpt.after_step(step + 1, state)
    ckpt.finish(state)
    return {"step": step, "rejected": rejected, "weights_ok": weights_ok, "final": step + 1}
