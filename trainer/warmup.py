"""Import what the train function needs while Ray Train is still starting the worker group.

Every (re)start of a Ray Train worker group starts new worker processes, and each imports what
the train function uses on its first call: for an FSDP2 loop with DCP checkpoints that is
``torch.distributed.fsdp`` and ``torch._dynamo`` (which ``fully_shard`` imports lazily), about
3 s of CPU per rank measured here (bench/drill.py's restarts, docs/benchmarks.md), and the
ranks then wait at their first collective for the slowest one.  :class:`WarmupCallback`
(a Ray Train ``WorkerCallback``) starts those imports in a background thread of each worker as
soon as its train context exists (``Worker.init_train_context``, ray/train/v2/_internal/
execution/worker_group/worker.py, Ray 2.60.0), while Ray Train still sets up the process group
and launches the train function: by then the modules are loaded, or half-way (Python's import
lock makes the train function wait for a module being imported instead of importing it twice).

Only modules are imported, nothing is run; a module that fails to import here is left for the
train function to import (and fail on) as it would without the callback.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Iterable

from ray.train.v2._internal.execution.callback import WorkerCallback

log = logging.getLogger(__name__)

#: What an FSDP2 train function using ``trainer.resilience.Checkpointer`` imports on its first call.
FSDP2_MODULES = ("trainer.resilience", "torch.distributed.fsdp", "torch._dynamo")


class WarmupCallback(WorkerCallback):
    """Import ``modules`` in a background thread of every worker once its train context exists."""

    def __init__(self, modules: Iterable[str] = FSDP2_MODULES) -> None:
        self.modules = tuple(modules)

    def after_init_train_context(self) -> None:
        threading.Thread(target=_import_all, args=(self.modules,), name="trainer.warmup", daemon=True).start()


def _import_all(modules: tuple[str, ...]) -> None:
    started = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # the train function imports it again and says why
            log.warning(f"warm-up import failed module={name} error={e!r}")
            return
    log.info(f"warm-up imports done seconds={time.perf_counter() - started:.2f} modules={','.join(modules)}")


__all__ = ["FSDP2_MODULES", "WarmupCallback"]
