"""Long-lived asyncio tasks: owned by a :class:`Supervisor`, named, and watched, so a death is
recorded and reported, not lost.

The daemon's long-lived tasks (the consumer loop ``resilienced.consumer``, the queue pinger
``resilienced.ping``, the watch caches ``resilienced.kube.cache[<resource>]``, the Lease sweeper
``resilienced.lease-sweep``, the follow-up ``resilienced.follow-up``) are each spawned on the
daemon's supervisor, or on a :meth:`Supervisor.scope` of it that ends them with the part that
started them.  As with ``asyncio.TaskGroup``, every task has an owner that cancels it and waits
for it on the way out; unlike a TaskGroup, a task that dies does not cancel its siblings: the
supervisor logs it (``task died``, ``task exited unexpectedly``) and keeps its name and why in
:meth:`Supervisor.dead`, which ``/healthz`` reads (503 naming it, so the kubelet's livenessProbe
restarts the pod).  A task cancelled by its owner (a cache stopped, the daemon shutting down) did
not die.

:func:`spawn` starts a task nobody supervises (short-lived helpers of the local stand-ins): named
and guarded, its error logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import TypeVar

from resilienced import log
from resilienced.log import Logger

T = TypeVar("T")


class Supervisor:
    """Owns long-lived tasks: records which died and why (see the module docstring).

    Use it as an async context manager (or call :meth:`close`): on exit it cancels the tasks
    still running, newest first, and waits for each.  :meth:`scope` gives a child that owns
    the tasks spawned on it and ends them when it closes; deaths in it are recorded here.
    """

    def __init__(self, *, logger: Logger | None = None, parent: Supervisor | None = None) -> None:
        self._log: Logger = logger or (parent._log if parent is not None else log.get("resilienced.tasks"))
        self._root: Supervisor = parent._root if parent is not None else self
        self._parent = parent
        self._tasks: dict[asyncio.Task[object], Callable[[], bool] | None] = {}
        self._scopes: list[Supervisor] = []
        self._dead: dict[str, str] = {}
        self._closing = False
        if parent is not None:
            parent._scopes.append(self)

    def spawn(self, coro: Coroutine[object, None, T], *, name: str,
              may_end: Callable[[], bool] | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as the long-lived task ``name``.

        It must run until it is cancelled: an error, or a return while ``may_end()`` is not
        true (e.g. the consumer loop after stop()), is a death.
        """
        if self._closing:
            coro.close()
            raise RuntimeError(f"supervisor closed: cannot start {name}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = may_end
        task.add_done_callback(self._ended)
        return task

    def scope(self) -> Supervisor:
        """A child supervisor: its tasks end when it closes; their deaths are recorded here."""
        return Supervisor(parent=self)

    def dead(self) -> dict[str, str]:
        """Every task that died (in this supervisor or any scope of it): name -> why."""
        return dict(self._root._dead)

    def running(self) -> list[str]:
        """The names of the tasks still running here and in the scopes still open."""
        return [*(task.get_name() for task in self._tasks if not task.done()),
                *(name for scope in self._scopes for name in scope.running())]

    async def close(self) -> None:
        """Close the scopes still open and cancel the tasks still running, newest first, waiting
        until each has ended."""
        self._closing = True
        for scope in reversed(list(self._scopes)):
            await scope.close()
        for task in reversed(list(self._tasks)):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._parent is not None and self in self._parent._scopes:
            self._parent._scopes.remove(self)

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ended(self, task: asyncio.Task[object]) -> None:
        may_end = self._tasks.pop(task, None)
        if task.cancelled():  # its owner stopped it
            return
        error = task.exception()
        if error is not None:
            why = f"{type(error).__name__}: {error}"
            self._log.error("task died", task=task.get_name(), error=why, exc_info=error)
        elif self._closing or (may_end is not None and may_end()):
            return
        else:
            why = "exited unexpectedly"
            self._log.error("task exited unexpectedly", task=task.get_name())
        self._root._dead[task.get_name()] = why


def spawn(coro: Coroutine[object, None, T], *, name: str, logger: Logger | None = None) -> asyncio.Task[T]:
    """Start ``coro`` as a named task nobody supervises; its error is logged (``task died``)."""
    logger = logger or log.get("resilienced.tasks")  # the logger name of before the rename: lines unchanged
    task = asyncio.get_running_loop().create_task(coro, name=name)

    def guard(done: asyncio.Task[T]) -> None:
        if not done.cancelled() and done.exception() is not None:
            error = done.exception()
            logger.error("task died", task=done.get_name(), error=f"{type(error).__name__}: {error}",
                         exc_info=error)

    task.add_done_callback(guard)
    return task
