"""Long-lived asyncio tasks: named, and guarded so an unexpected exit is logged, not lost.

:func:`spawn` creates a task with a name and a done-callback that logs when it ended while
nobody asked it to (returned, or raised).  :func:`alive` tells ``/healthz`` whether every
guarded task that must run forever still does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from resilienced import log

_FOREVER: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any], *, name: str, forever: bool = True,
          may_end: Callable[[], bool] | None = None, logger: Any | None = None) -> asyncio.Task[Any]:
    """Start ``coro`` as a named task and guard it.

    An error is always logged.  A ``forever`` task that returns is logged as an unexpected exit
    unless ``may_end()`` says it was asked to (e.g. the consumer after stop()).
    """
    logger = logger or log.get("resilienced.tasks")
    task = asyncio.get_running_loop().create_task(coro, name=name)
    if forever:
        _FOREVER.add(task)

    def guard(done: asyncio.Task[Any]) -> None:
        _FOREVER.discard(done)
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            logger.error("task died", task=done.get_name(), error=f"{type(error).__name__}: {error}",
                         exc_info=error)
        elif forever and not (may_end and may_end()):
            logger.error("task exited unexpectedly", task=done.get_name())

    task.add_done_callback(guard)
    return task


def alive() -> bool:
    """False when a guarded forever-task has ended (the daemon is then not healthy)."""
    return all(not task.done() for task in _FOREVER)
