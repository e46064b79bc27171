"""What differs between a rank on Ray Train and a rank in a local process.

The train loop talks to a :class:`Runtime` only: where the preemption notice comes from, how a
committed checkpoint is reported, how the SIGTERM flag is installed, and what "wait to be torn
down" means.

* :class:`RayRuntime`: Ray Train's preemption notice (each worker's own copy; the checkpointer's
  all-reduce makes the ranks agree),
  ``ray.train.report`` of a pointer to each committed checkpoint (the checkpoint is already on
  the shared checkpoint root), and after the last save a wait that only Ray's teardown ends (a
  clean return would mark the run FINISHED).
* :class:`LocalRuntime`: no Ray (torchrun, local processes); SIGTERM is the only notice; after
  the last save the rank waits until the deadline and then raises
  :class:`~trainer.errors.PreemptedError` (exit code 75 for ``python -m trainer``).

:func:`detect_runtime` picks one: Ray when called inside a Ray Train train function.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from trainer.checkpoint import Committed
from trainer.errors import PreemptedError
from trainer.preemption import install_sigterm_flag

log = logging.getLogger(__name__)


class Notice(Protocol):
    deadline_ms: int | None


class Runtime(Protocol):
    name: str

    def preemption_info(self) -> Notice | None:
        """The agreed preemption notice from the cluster, or None (collective where it applies)."""
        ...

    def report(self, committed: Committed, *, metrics: dict[str, Any]) -> None: ...

    def install_sigterm(self) -> bool: ...

    def wait_for_teardown(self, *, deadline_ms: int | None, timeout_s: float) -> NoReturn: ...


class RayRuntime:
    name = "ray"

    def __init__(self) -> None:
        self._read_local = _local_notice_reader()

    def preemption_info(self) -> Notice | None:
        """Ray Train's preemption notice as this worker holds it (None: no notice).

        Ray Train's watcher hands the notice to every worker (``Worker.mark_preempt``,
        ray/train/v2/_internal/execution/worker_group/worker.py, Ray 2.60.0), and
        ``ray.train.get_preemption_info()`` then broadcasts rank 0's copy through Ray
        (``broadcast_from_rank_zero``: a round trip to a synchronization actor, ~3 ms per call
        measured in bench/checkpoint.py).  The checkpointer's own all-reduce already makes every
        rank act on the same notice, so each rank reads its own copy; the public call is the
        fallback where that attribute is missing (another Ray version).
        """
        if self._read_local is not None:
            return self._read_local()
        import ray.train

        return ray.train.get_preemption_info()

    def report(self, committed: Committed, *, metrics: dict[str, Any]) -> None:
        """Report a pointer to the committed checkpoint (rank 0), metrics only (the others).

        The checkpoint itself stays where it is; Ray Train's run directory (``.ray-train`` under
        the checkpoint root) gets a small ``pointer.json``, which Ray Train manages and prunes on
        its own, so its run snapshot never names a checkpoint the trainer pruned (a new driver
        on the same run would refuse to start).
        """
        import tempfile

        import ray.train
        from ray.train import Checkpoint

        name = committed.path.name
        if ray.train.get_context().get_world_rank() != 0:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
            return
        with tempfile.TemporaryDirectory(prefix="ckpt-pointer-") as tmp:
            pointer = {"path": str(committed.path), "step": committed.step, "reason": committed.reason}
            (Path(tmp) / "pointer.json").write_text(json.dumps(pointer))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=name)

    def install_sigterm(self) -> bool:
        """Install the SIGTERM flag on this worker actor's main thread (signals need it)."""
        if install_sigterm_flag():
            return True
        try:
            import ray

            actor = ray.get_runtime_context().current_actor
            return bool(ray.get(actor.__ray_call__.remote(_install_on_actor), timeout=30))
        except Exception as e:  # best effort: Ray's drain is the primary signal
            log.warning(f"SIGTERM flag not installed on this Ray worker error={e!r}")
            return False

    def wait_for_teardown(self, *, deadline_ms: int | None, timeout_s: float) -> NoReturn:
        limit = (deadline_ms / 1000.0 if deadline_ms else time.time()) + timeout_s
        while time.time() < limit:
            time.sleep(0.5)
        raise PreemptedError(
            f"not torn down {timeout_s:.0f}s after the preemption deadline; failing so that Ray "
            "Train restarts the run from the last checkpoint"
        )


def _local_notice_reader() -> Callable[[], Notice | None] | None:
    """A reader of this worker's own copy of the notice, or None (use the public broadcast)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        get_train_context().preemption_context.preemption_info  # noqa: B018  (present here?)
    except Exception:  # not Ray 2.60's layout: the public call works everywhere
        return None
    return lambda: get_train_context().preemption_context.preemption_info


def _install_on_actor(_actor: object) -> bool:
    from trainer.preemption import install_sigterm_flag as install

    return install()


class LocalRuntime:
    name = "local"

    def preemption_info(self) -> Notice | None:
        return None

    def report(self, committed: Committed, *, metrics: dict[str, Any]) -> None:
        return None

    def install_sigterm(self) -> bool:
        return install_sigterm_flag()

    def wait_for_teardown(self, *, deadline_ms: int | None, timeout_s: float) -> NoReturn:
        if deadline_ms is not None:
            while time.time() < deadline_ms / 1000.0:
                time.sleep(0.2)
        raise PreemptedError("preempted: the last checkpoint is saved; resume by running again")


def detect_runtime() -> Runtime:
    """:class:`RayRuntime` inside a Ray Train (V2) train function, else :class:`LocalRuntime`."""
    if "ray" in sys.modules:  # a Ray Train worker has imported Ray already; nobody else pays for it
        try:
            import ray.train

            ray.train.get_context()  # RuntimeError outside a Ray Train worker
            return RayRuntime()
        except Exception:
            pass
    return LocalRuntime()


def attempt_counter(root: Path) -> int:
    """Increment and return the run's attempt number (rank 0 only), kept in ``<root>/.attempt``."""
    path = root / ".attempt"
    try:
        previous = int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        previous = 0
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".attempt.tmp")
    tmp.write_text(str(previous + 1))
    tmp.replace(path)
    return previous + 1
