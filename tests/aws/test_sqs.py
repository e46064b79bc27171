"""The SQS adapter: every library error becomes BackendUnavailable; real calls against moto."""

from __future__ import annotations

import asyncio

import aiohttp
import botocore.exceptions
import pytest

from resilienced.aws.sqs import SqsQueue, translate
from resilienced.errors import BackendUnavailable
from resilienced.local.aws import free_port

from tests.intake import payloads as p
from tests.intake.queues import MAX_RECEIVE_COUNT, REGION, make_queues

pytestmark = pytest.mark.integration


def every_subclass(base: type) -> list[type]:
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


BOTOCORE = every_subclass(botocore.exceptions.BotoCoreError) + every_subclass(botocore.exceptions.ClientError)
AIOHTTP = every_subclass(aiohttp.ClientError)
OTHER = [OSError, ConnectionResetError, TimeoutError, asyncio.TimeoutError, ValueError, RuntimeError]


@pytest.mark.parametrize("error_class", BOTOCORE + AIOHTTP + OTHER,
                         ids=lambda c: f"{c.__module__.split('.')[0]}.{c.__qualname__}")
def test_every_library_error_kind_is_translated(error_class):
    error = error_class.__new__(error_class)  # library errors need varied constructor arguments
    translated = translate(error, operation="receive_message")
    assert isinstance(translated, BackendUnavailable)
    assert translated.backend == "sqs"
    assert "receive_message" in str(translated)


def test_the_error_tables_are_not_empty():
    assert len(BOTOCORE) > 50 and len(AIOHTTP) > 10


@pytest.mark.parametrize("code, delay", [("ThrottlingException", 1.0), ("RequestThrottled", 1.0),
                                         ("AWS.SimpleQueueService.NonExistentQueue", None)],
                         ids=["throttling", "request-throttled", "missing-queue"])
def test_client_errors_carry_code_and_retry_delay(code, delay):
    error = botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "ReceiveMessage")
    translated = translate(error, operation="receive_message")
    assert code in str(translated) and translated.delay == delay


async def test_receive_reports_receive_count_and_sent_time(queues):
    queues.send(p.spot())
    async with SqsQueue.open(queue_url=queues.url, region=REGION, endpoint_url=queues.endpoint_url) as queue:
        [first] = await queue.receive(max_messages=10, wait_seconds=1, visibility_timeout=30)
        await queue.change_visibility(first, seconds=0)
        [second] = await queue.receive(max_messages=10, wait_seconds=1, visibility_timeout=30)
        assert (first.receive_count, second.receive_count) == (1, 2)
        assert second.sent_at is not None and second.sent_at.tzinfo is not None
        assert second.message_id == first.message_id and second.body == first.body
        await queue.delete(second)
    assert queues.counts() == (0, 0)


async def test_max_receive_count_reads_the_redrive_policy(aws):
    with_dlq = make_queues(aws, name="with-dlq")
    without = make_queues(aws, name="without-dlq", dlq=False)
    for queues, expected in ((with_dlq, MAX_RECEIVE_COUNT), (without, None)):
        async with SqsQueue.open(queue_url=queues.url, region=REGION, endpoint_url=queues.endpoint_url) as queue:
            assert await queue.max_receive_count() == expected
            await queue.ping()


async def test_a_missing_queue_is_backend_unavailable_naming_the_code(queues):
    missing = queues.url.rsplit("/", 1)[0] + "/missing"
    async with SqsQueue.open(queue_url=missing, region=REGION, endpoint_url=queues.endpoint_url) as queue:
        with pytest.raises(BackendUnavailable, match="QueueDoesNotExist|NonExistentQueue"):
            await queue.ping()


async def test_an_endpoint_nobody_listens_on_is_backend_unavailable(aws):
    endpoint = f"http://127.0.0.1:{free_port()}"
    async with SqsQueue.open(queue_url=f"{endpoint}/123456789012/q", region=REGION,
                             endpoint_url=endpoint) as queue:
        with pytest.raises(BackendUnavailable, match="EndpointConnectionError"):
            await queue.receive(max_messages=1, wait_seconds=0, visibility_timeout=30)

