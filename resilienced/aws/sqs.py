"""The SQS adapter: :class:`SqsQueue` implements :class:`~resilienced.ports.Queue` on aiobotocore.

Every library error is translated at this boundary by :func:`translate` (nothing above sees a
botocore or aiohttp exception), with the one rule of :mod:`resilienced.aws.errors`, and one
named exception: the daemon's own queue is never given up on.  An answer the rule calls
permanent (a missing queue, denied access, an invalid receipt handle) is raised as
:class:`~resilienced.errors.BackendUnavailable` too, marked ``refused``, which a long-running
daemon reports (logs, readiness, ``resilienced_queue_errors_total``) and retries with backoff
rather than crash on: an IAM policy or a queue being re-created gets fixed while it waits.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.aws.clients import MAX_CONNECTIONS, open_client
from resilienced.errors import BackendUnavailable
from resilienced.model import JsonValue
from resilienced.ports import Message

BACKEND = "sqs"


def translate(error: BaseException, *, operation: str, backend: str = BACKEND) -> BackendUnavailable:
    """The BackendUnavailable for a library error raised by an SQS call (see the module doc)."""
    translated = errors.translate(error, backend=backend, operation=operation)
    if isinstance(translated, BackendUnavailable):
        return translated
    # the named exception: the daemon's own queue is retried even when it refuses
    return BackendUnavailable(backend, str(translated).removeprefix(f"{backend}: ") + " (refused)")


class SqsQueue:
    """One SQS queue, through an aiobotocore client owned by the caller (see :meth:`open`)."""

    def __init__(self, *, client: AioBaseClient, queue_url: str) -> None:
        self._client = client
        self.queue_url = queue_url

    @classmethod
    @asynccontextmanager
    async def open(cls, *, queue_url: str, region: str | None, endpoint_url: str | None = None,
                   max_connections: int = MAX_CONNECTIONS) -> AsyncIterator[SqsQueue]:
        """A queue with its own client (and connection pool), closed on exit."""
        async with open_client("sqs", region=region, endpoint_url=endpoint_url,
                               max_connections=max_connections) as client:
            yield cls(client=client, queue_url=queue_url)

    async def _call(self, operation: str, **kwargs: JsonValue) -> dict[str, JsonValue]:
        try:
            return await getattr(self._client, operation)(QueueUrl=self.queue_url, **kwargs)
        except Exception as e:
            raise translate(e, operation=operation) from e

    async def receive(self, *, max_messages: int, wait_seconds: int,
                      visibility_timeout: int) -> list[Message]:
        response = await self._call(
            "receive_message", MaxNumberOfMessages=max_messages, WaitTimeSeconds=wait_seconds,
            VisibilityTimeout=visibility_timeout,
            MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
        )
        return [_message(raw) for raw in response.get("Messages", [])]

    async def delete(self, message: Message) -> None:
        await self._call("delete_message", ReceiptHandle=message.receipt_handle)

    async def change_visibility(self, message: Message, *, seconds: int) -> None:
        await self._call("change_message_visibility", ReceiptHandle=message.receipt_handle,
                         VisibilityTimeout=int(seconds))

    async def max_receive_count(self) -> int | None:
        response = await self._call("get_queue_attributes", AttributeNames=["RedrivePolicy"])
        policy = (response.get("Attributes") or {}).get("RedrivePolicy")
        if not policy:
            return None
        try:
            return int(json.loads(policy)["maxReceiveCount"])
        except (ValueError, KeyError, TypeError) as e:
            raise BackendUnavailable(BACKEND, f"unreadable RedrivePolicy {policy!r}: {e}") from e

    async def ping(self) -> None:
        await self._call("get_queue_attributes", AttributeNames=["QueueArn"])

    async def depth(self) -> dict[str, int]:
        """The queue's approximate message counts, by attribute name (ApproximateNumberOf...)."""
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                 "ApproximateNumberOfMessagesDelayed"]
        response = await self._call("get_queue_attributes", AttributeNames=names)
        attributes = response.get("Attributes") or {}
        return {name: int(attributes.get(name) or 0) for name in names}

    async def send(self, body: str) -> str:
        """Send one message (used by ``inject`` and the demo); returns its MessageId."""
        response = await self._call("send_message", MessageBody=body)
        return response["MessageId"]


def _message(raw: dict[str, JsonValue]) -> Message:
    attributes = raw.get("Attributes") or {}
    try:
        count = int(attributes.get("ApproximateReceiveCount", "1"))
    except ValueError:
        count = 1
    sent_at = None
    if "SentTimestamp" in attributes:
        try:
            sent_at = datetime.fromtimestamp(int(attributes["SentTimestamp"]) / 1000, tz=timezone.utc)
        except (ValueError, OverflowError, OSError):
            sent_at = None
    return Message(message_id=raw["MessageId"], receipt_handle=raw["ReceiptHandle"],
                   body=raw.get("Body", ""), receive_count=count, sent_at=sent_at,
                   attributes=dict(attributes))
