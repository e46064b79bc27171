"""``supervisor.Supervisor``: owns the daemon's long-lived tasks, keeps which died and why.

The daemon-level check (each long-lived task killed, ``/healthz`` 503 naming it over HTTP) is
tests/intake/test_health.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from resilienced.supervisor import Supervisor

pytestmark = pytest.mark.unit


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def error(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))


async def forever(started: list[str], name: str) -> None:
    started.append(name)
    await asyncio.Event().wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_task_that_raises_stays_recorded_dead_and_its_siblings_go_on() -> None:
    log, started = Log(), []
    failing = asyncio.Event()

    async def dies() -> None:
        await failing.wait()
        raise RuntimeError("the watch broke")

    async with Supervisor(logger=log) as supervisor:
        supervisor.spawn(forever(started, "a"), name="resilienced.ping")
        supervisor.spawn(dies(), name="resilienced.kube.cache[pods]")
        await settle()
        assert supervisor.dead() == {}
        failing.set()
        await settle()
        assert supervisor.dead() == {"resilienced.kube.cache[pods]": "RuntimeError: the watch broke"}
        await settle()  # asked again later: still dead (a done task is not forgotten)
        assert supervisor.dead() == {"resilienced.kube.cache[pods]": "RuntimeError: the watch broke"}
        assert supervisor.running() == ["resilienced.ping"]  # not cancelled with it
    assert [event for event, _ in log.lines] == ["task died"]
    assert log.lines[0][1]["task"] == "resilienced.kube.cache[pods]"


async def test_a_return_is_a_death_unless_the_task_may_end() -> None:
    log = Log()
    stopping = False

    async def returns() -> None:
        return None

    async with Supervisor(logger=log) as supervisor:
        supervisor.spawn(returns(), name="resilienced.follow-up")
        supervisor.spawn(returns(), name="resilienced.consumer", may_end=lambda: stopping)
        await settle()
        assert supervisor.dead() == {"resilienced.follow-up": "exited unexpectedly",
                                     "resilienced.consumer": "exited unexpectedly"}
        stopping = True
        supervisor.spawn(returns(), name="resilienced.consumer.2", may_end=lambda: stopping)
        await settle()
        assert "resilienced.consumer.2" not in supervisor.dead()


async def test_a_task_stopped_by_its_owner_or_the_supervisor_did_not_die() -> None:
    started: list[str] = []
    supervisor = Supervisor(logger=Log())
    mine = supervisor.spawn(forever(started, "cache"), name="resilienced.kube.cache[nodes]")
    supervisor.spawn(forever(started, "ping"), name="resilienced.ping")
    await settle()
    mine.cancel()  # Informer.stop()
    await asyncio.gather(mine, return_exceptions=True)
    await supervisor.close()
    assert supervisor.dead() == {} and supervisor.running() == []
    with pytest.raises(RuntimeError, match="supervisor closed"):
        supervisor.spawn(forever(started, "late"), name="late")


async def test_a_scope_ends_its_tasks_and_reports_its_deaths_to_the_root() -> None:
    log, started = Log(), []
    async with Supervisor(logger=log) as root:
        root.spawn(forever(started, "root"), name="root-task")
        async with root.scope() as scope:
            kept = scope.spawn(forever(started, "kept"), name="scoped")

            async def dies() -> None:
                raise ValueError("bad record")

            scope.spawn(dies(), name="resilienced.follow-up")
            await settle()
            assert root.dead() == {"resilienced.follow-up": "ValueError: bad record"}
            assert sorted(root.running()) == ["root-task", "scoped"]
        assert kept.cancelled() and root.running() == ["root-task"]
        left_open = root.scope()
        still = left_open.spawn(forever(started, "open"), name="left-open")
        await settle()
    assert still.cancelled()  # the root closed the scope left open
    assert root.dead() == {"resilienced.follow-up": "ValueError: bad record"}
