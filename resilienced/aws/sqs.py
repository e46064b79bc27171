"""The SQS adapter: :class:`SqsQueue` implements :class:`~resilienced.ports.Queue` on aiobotocore.

Every library error is translated at this boundary by :func:`translate` into
:class:`~resilienced.errors.BackendUnavailable` (nothing above sees a botocore or aiohttp
exception): connection and timeout errors, throttling and 5xx, and also 4xx answers such as a
missing queue or denied access, which a long-running daemon reports (logs, readiness) and
retries with backoff rather than crash on.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

import aiohttp
import botocore.exceptions
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from resilienced.errors import BackendUnavailable
from resilienced.ports import Message

BACKEND = "sqs"
_THROTTLING = {"Throttling", "ThrottlingException", "RequestThrottled", "RequestThrottledException",
               "TooManyRequestsException", "SlowDown"}


def translate(error: BaseException, *, operation: str, backend: str = BACKEND) -> BackendUnavailable:
    """The BackendUnavailable for a library error raised by an AWS call (SQS by default)."""
    if isinstance(error, BackendUnavailable):
        return error
    if isinstance(error, botocore.exceptions.ClientError):
        response = getattr(error, "response", None) or {}
        code = (response.get("Error") or {}).get("Code") or "Unknown"
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        delay = 1.0 if code in _THROTTLING else None
        text = (response.get("Error") or {}).get("Message") or str(error)
        return BackendUnavailable(backend, f"{operation}: {code} (HTTP {status}): {text}", delay=delay)
    if isinstance(error, botocore.exceptions.BotoCoreError):
        kind = "timed out" if isinstance(error, (botocore.exceptions.ConnectTimeoutError,
                                                 botocore.exceptions.ReadTimeoutError)) else "failed"
        return BackendUnavailable(backend, f"{operation} {kind}: {type(error).__name__}: {_text(error)}")
    if isinstance(error, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError)):
        return BackendUnavailable(backend, f"{operation} failed: {type(error).__name__}: {_text(error)}")
    return BackendUnavailable(backend, f"{operation} failed: unexpected {type(error).__name__}: "
                                       f"{_text(error)}")


def _text(error: BaseException) -> str:
    try:
        return str(error) or "(no message)"
    except Exception:  # a half-built library exception whose __str__ fails
        return "(no message)"


class SqsQueue:
    """One SQS queue, through an aiobotocore client owned by the caller (see :meth:`open`)."""

    def __init__(self, *, client: Any, queue_url: str) -> None:
        self._client = client
        self.queue_url = queue_url

    @classmethod
    @asynccontextmanager
    async def open(cls, *, queue_url: str, region: str | None, endpoint_url: str | None = None,
                   max_connections: int = 20) -> AsyncIterator[SqsQueue]:
        """A queue with its own client (and connection pool), closed on exit."""
        config = AioConfig(
            max_pool_connections=max_connections,
            connect_timeout=5, read_timeout=40,  # above the 20 s long poll
            retries={"mode": "standard", "max_attempts": 3},
        )
        session = get_session()
        try:
            client_cm = session.create_client("sqs", region_name=region, endpoint_url=endpoint_url,
                                              config=config)
            client = await client_cm.__aenter__()
        except Exception as e:
            raise translate(e, operation="create client") from e
        try:
            yield cls(client=client, queue_url=queue_url)
        finally:
            await client_cm.__aexit__(None, None, None)

    async def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
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


def _message(raw: dict[str, Any]) -> Message:
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
