"""Fixtures for intake tests: queues with a DLQ on moto, an open SqsQueue, consumers, responders."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from resilienced.aws.sqs import SqsQueue
from resilienced.doubles import MemoryClaims
from resilienced.consumer.loop import Consumer
from resilienced.local.aws import MotoServer
from resilienced.ops.metrics import Metrics
from resilienced.model import Outcome, Plan, Result
from resilienced.settings import IntakeSettings, QueueSettings

from .queues import MAX_RECEIVE_COUNT, REGION, Queues, make_queues

__all__ = ["MAX_RECEIVE_COUNT", "REGION", "Queues", "make_queues"]


@pytest.fixture
def queues(aws: MotoServer) -> Queues:
    return make_queues(aws)


@pytest.fixture
async def sqs_queue(queues: Queues) -> AsyncIterator[SqsQueue]:
    async with SqsQueue.open(queue_url=queues.url, region=REGION, endpoint_url=queues.endpoint_url) as queue:
        yield queue


def queue_settings(queues: Queues, **overrides: Any) -> QueueSettings:
    base = QueueSettings(queue_url=queues.url, region=REGION, endpoint_url=queues.endpoint_url,
                         wait_seconds=1, visibility_timeout=30, shutdown_timeout=5)
    return replace(base, **overrides)


@pytest.fixture
def make_consumer(queues: Queues, sqs_queue: SqsQueue) -> Callable[..., Consumer]:
    def make(responder: Any, *, claims: Any = None, max_receive_count: int | None = MAX_RECEIVE_COUNT,
             intake: IntakeSettings | None = None, queue: Any = None, replica: str | None = None,
             clock: Any = None, **settings: Any) -> Consumer:
        # clock None: the payloads are recorded (time 2024-01-01), judged as of their own time;
        # the stale/future tests pass the clock they judge at.
        return Consumer(queue=queue or sqs_queue, responder=responder, claims=claims if claims is not None else MemoryClaims(),
                        queue_settings=queue_settings(queues, **settings),
                        intake_settings=intake or IntakeSettings(), max_receive_count=max_receive_count,
                        metrics=Metrics(), replica=replica, clock=clock)
    return make


# --------------------------------------------------------------------------- responders (the seam)
@dataclass
class Recorder:
    """A responder that records each plan it is given and reports it done."""

    plans: list[Plan] = field(default_factory=list)

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        self.plans.append(plan)
        return Outcome(result=Result.DONE, event=plan.event, plan=plan, reason="recorded")


class Gate:
    """A responder that holds each plan until the test opens its instance's gate.

    ``entered`` lists the instance ids whose plan is being held; ``cancelled`` those whose
    handling was cancelled while held (shutdown).
    """

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}
        self.changed = asyncio.Event()

    def gate(self, instance: str) -> asyncio.Event:
        return self._gates.setdefault(instance, asyncio.Event())

    def open(self, instance: str) -> None:
        self.gate(instance).set()

    async def wait_entered(self, count: int) -> None:
        while len(self.entered) < count:
            self.changed.clear()
            await self.changed.wait()

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        instance = plan.instance_ids[0]
        self.entered.append(instance)
        self.changed.set()
        try:
            await self.gate(instance).wait()
        except asyncio.CancelledError:
            self.cancelled.append(instance)
            raise
        self.finished.append(instance)
        return Outcome(result=Result.DONE, event=plan.event, plan=plan, reason="gate opened")


async def eventually(condition: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Poll ``condition`` until truthy (a bounded wait for an observable state, not a sleep)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
