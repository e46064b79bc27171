"""The in-memory SQS queue of the timing tests (tests/support/virtualtime.py) against moto's SQS.

The same steps through the consumer's own port (``ports.Queue``): the production adapter
(``SqsQueue``, aiobotocore over HTTP to the moto server) and ``MemoryQueue`` answer alike, so
what the timing tests conclude on the memory queue holds for SQS's visibility, receive count
and redrive behaviour.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from resilienced.aws.sqs import SqsQueue
from tests.support.virtualtime import MemoryQueue

from .queues import MAX_RECEIVE_COUNT, REGION, Queues

pytestmark = pytest.mark.integration


class Moto:
    """The moto queue behind the port, with a way to send and to count the DLQ."""

    def __init__(self, queues: Queues, port: SqsQueue) -> None:
        self.queues, self.port = queues, port

    def send(self, body: str) -> str:
        return self.queues.send(body)

    def dead(self) -> int:
        return sum(self.queues.counts(self.queues.dlq_url))


class Memory:
    def __init__(self) -> None:
        self.port = MemoryQueue(max_receives=MAX_RECEIVE_COUNT)

    def send(self, body: str) -> str:
        return self.port.send(body)

    def dead(self) -> int:
        return len(self.port.dead)


@pytest.fixture(params=["moto", "memory"])
async def queue(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield Memory()
        return
    queues: Queues = request.getfixturevalue("queues")
    async with SqsQueue.open(queue_url=queues.url, region=REGION, endpoint_url=queues.endpoint_url) as port:
        yield Moto(queues, port)


async def receive(queue: Any, *, visibility: int, wait: int = 0) -> list[Any]:
    return await queue.port.receive(max_messages=10, wait_seconds=wait, visibility_timeout=visibility)


async def test_a_received_message_is_invisible_until_released_and_each_receive_counts(queue: Any) -> None:
    queue.send(json.dumps({"n": 1}))
    [first] = await receive(queue, visibility=30)
    assert first.receive_count == 1 and json.loads(first.body) == {"n": 1}
    assert await receive(queue, visibility=30) == []
    await queue.port.change_visibility(first, seconds=0)
    [second] = await receive(queue, visibility=30)
    assert second.message_id == first.message_id and second.receive_count == 2
    await queue.port.delete(second)
    assert await receive(queue, visibility=30) == []
    assert await queue.port.max_receive_count() == MAX_RECEIVE_COUNT


async def test_the_visibility_timeout_lapses_and_an_extension_restarts_it_from_now(queue: Any) -> None:
    queue.send("a")
    [message] = await receive(queue, visibility=2)
    await asyncio.sleep(1.2)
    await queue.port.change_visibility(message, seconds=2)  # from now: until +3.2 s
    await asyncio.sleep(1.2)
    assert await receive(queue, visibility=2) == []  # +2.4 s: the first timeout would have lapsed
    await asyncio.sleep(1.3)
    [again] = await receive(queue, visibility=2, wait=1)  # +3.7 s: lapsed
    assert again.message_id == message.message_id and again.receive_count == 2


async def test_a_long_poll_returns_when_a_message_arrives(queue: Any) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    poll = asyncio.ensure_future(receive(queue, visibility=30, wait=5))
    await asyncio.sleep(0.5)
    queue.send("late")
    [message] = await poll
    assert message.body == "late" and loop.time() - started < 5


async def test_the_redrive_policy_moves_a_message_after_max_receives(queue: Any) -> None:
    queue.send("poison")
    for count in range(1, MAX_RECEIVE_COUNT + 1):
        [message] = await receive(queue, visibility=30)
        assert message.receive_count == count
        await queue.port.change_visibility(message, seconds=0)
    assert await receive(queue, visibility=30, wait=1) == []  # the next receive moves it
    assert queue.dead() == 1
