"""What the trainer raises on purpose.

::

    TrainerError                 base
    ├── ConfigError              a flag or environment variable that cannot work (names it)
    ├── UsageError               the Checkpointer used wrongly: a step that does not advance,
    │   │                        ranks that disagree on the step, a call after the end
    │   └── StateError           an entry of ``state`` that cannot be saved (names it)
    ├── CheckpointError          a checkpoint that cannot be written, read or trusted
    │   └── CorruptCheckpoint    a committed checkpoint whose files do not match its manifest
    └── PreemptedError           the run was preempted and this process must not go on
                                 (local mode: the exit code says "resume me")
"""

from __future__ import annotations

#: Exit code of a rank (and of ``python -m trainer --ray-address local``) that was preempted
#: after saving: EX_TEMPFAIL, "try again" (run it again to resume).
EXIT_PREEMPTED = 75
#: Exit code of a rank killed by the ``--crash-at`` test hook.
EXIT_CRASHED = 70


class TrainerError(Exception):
    """Base of every error the trainer raises on purpose."""


class ConfigError(TrainerError):
    """A flag or setting that cannot work; the message starts with its name."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message


class UsageError(TrainerError, ValueError):
    """``trainer.resilience.Checkpointer`` called in a way that cannot work; the message says how."""


class StateError(UsageError):
    """An entry of ``state`` that cannot be saved or loaded; the message starts with its name."""

    def __init__(self, name: object, message: str) -> None:
        super().__init__(f"state: {message}" if name is None else f"state[{name!r}]: {message}")
        self.name = name


class CheckpointError(TrainerError):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose manifest is missing or malformed, or whose files do not match it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


class PreemptedError(TrainerError):
    """The run saved what it could after a preemption notice; it is not finished."""
