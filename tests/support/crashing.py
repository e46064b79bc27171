"""A :class:`~trainer.resilience.Checkpointer` whose commits end the process at one phase.

The crash tests fill the Checkpointer's seam (``Checkpointer.store_type``) with a
``CheckpointStore`` whose ``at_phase`` calls ``die()`` at (``phase``, ``step``): the phases are
``files-written``, ``manifest-torn``, ``manifest-written`` and ``committed``
(``trainer.checkpoint.CheckpointStore.at_phase``).
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.checkpoint import CheckpointStore
from trainer.resilience import Checkpointer


def crashing(phase: str, step: int, *, die: Callable[[], object]) -> type[Checkpointer]:
    """A Checkpointer class that calls ``die()`` when a commit of ``step`` reaches ``phase``."""

    class CrashingStore(CheckpointStore):
        def at_phase(self, at_phase: str, at_step: int) -> None:
            if (at_phase, at_step) == (phase, step):
                die()

    return type("CrashingCheckpointer", (Checkpointer,), {"store_type": CrashingStore})
