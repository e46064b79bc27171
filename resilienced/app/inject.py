"""``resilienced inject``: put events where AWS would, for game days (as AWS FIS does).

- ``--queue-url URL``: each FILE's content is sent as one SQS message body, unchanged (any
  body: an EventBridge event, an SNS notification, the direct ASG form, or garbage to test
  the DLQ).
- ``--event-bus NAME``: each FILE must hold an EventBridge event (or an SNS notification of
  one); it is sent with PutEvents (Source, DetailType, Detail, Resources, Time) so that the
  bus's rules match it as they would the real one.  EventBridge assigns a new id.  Note: real
  AWS refuses PutEvents with an ``aws.*`` source (only AWS services may send those): use this
  against moto or LocalStack, and ``--queue-url`` (or AWS FIS) against AWS.

``--fresh`` stamps each event with a new id and the current time (so deadlines are in the
future).  Every file is read and checked before anything is sent: a bad file sends nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path


from resilienced.intake import pipeline as intake
from resilienced.intake import validate
from resilienced.aws.clients import open_client
from resilienced.aws.errors import translate
from resilienced.aws.sqs import SqsQueue
from resilienced.clock import utcnow
from resilienced.errors import BackendUnavailable, ConfigError, EventError
from resilienced.model import Envelope, JsonValue, Wrapping
from resilienced.settings import QueueSettings


def configure(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--queue-url", metavar="URL", help="send each file's content as an SQS message body")
    target.add_argument("--event-bus", metavar="NAME", help="PutEvents each file's event on this bus")
    parser.add_argument("--fresh", action="store_true",
                        help="give each event a new id and the current time")
    parser.add_argument("files", nargs="+", metavar="FILE", help="a file holding one event")
    QueueSettings.add_arguments(parser, only=("region", "endpoint_url"))


def main(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    queue = QueueSettings.from_args(argparse.Namespace(
        queue_url=args.queue_url, region=args.region, endpoint_url=args.endpoint_url), environ)
    queue.validate(require_queue=False)
    region = queue.effective_region
    if region is None:
        raise ConfigError("--region", "not set (flag --region or env RESILIENCED_REGION / AWS_REGION)")
    bodies = [(name, _read(name)) for name in args.files]
    if args.event_bus:
        entries = [(name, entry(name, body, bus=args.event_bus, fresh=args.fresh))
                   for name, body in bodies]
        sent = asyncio.run(_put_events(entries, region=region, endpoint_url=queue.endpoint_url))
    else:
        messages = [(name, refresh(name, body) if args.fresh else body.decode("utf-8", "replace"))
                    for name, body in bodies]
        sent = asyncio.run(_send(messages, queue_url=args.queue_url, region=region,
                                 endpoint_url=queue.endpoint_url))
    for name, ident in sent:
        print(f"{name}\t{ident}")
    return 0


def _read(name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except OSError as e:
        raise ConfigError(name, f"cannot read: {e.strerror or e}") from None


def _eventbridge(name: str, body: bytes) -> Envelope:
    try:
        envelope = intake.decode(body)
    except EventError as e:
        raise ConfigError(name, f"not an EventBridge event: {e}") from None
    if envelope.wrapping is Wrapping.ASG_DIRECT or intake.is_asg_direct(envelope):
        raise ConfigError(name, "not an EventBridge event: a direct ASG lifecycle message "
                                "(send it with --queue-url)")
    for field, value in (("source", envelope.source), ("detail-type", envelope.detail_type)):
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"not an EventBridge event: {field} missing or not a string")
    if not isinstance(envelope.detail, dict):
        raise ConfigError(name, "not an EventBridge event: detail missing or not an object")
    return envelope


def entry(name: str, body: bytes, *, bus: str, fresh: bool) -> dict[str, JsonValue]:
    """The PutEvents entry for one file (ConfigError when the file is not an EventBridge event)."""
    envelope = _eventbridge(name, body)
    item: dict[str, JsonValue] = {"EventBusName": bus, "Source": envelope.source,
                            "DetailType": envelope.detail_type, "Detail": json.dumps(envelope.detail)}
    if envelope.resources is not None:
        if not isinstance(envelope.resources, list) or not all(isinstance(r, str) for r in envelope.resources):
            raise ConfigError(name, "resources: expected a list of strings")
        item["Resources"] = envelope.resources
    if not fresh:
        try:
            item["Time"] = validate.iso_time(envelope.time, field="time")
        except EventError as e:
            raise ConfigError(name, f"{e} (pass --fresh to stamp the current time)") from None
    return item


def refresh(name: str, body: bytes) -> str:
    """The body with a new id and the current time (EventBridge form only)."""
    envelope = _eventbridge(name, body)
    if envelope.wrapping is not Wrapping.EVENTBRIDGE:
        raise ConfigError(name, "--fresh rewrites EventBridge events only, not SNS notifications")
    event = dict(envelope.raw)
    event["id"] = str(uuid.uuid4())
    event["time"] = utcnow().strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps(event)


async def _send(messages: Sequence[tuple[str, str]], *, queue_url: str, region: str,
                endpoint_url: str | None) -> list[tuple[str, str]]:
    async with SqsQueue.open(queue_url=queue_url, region=region, endpoint_url=endpoint_url) as queue:
        return [(name, await queue.send(body)) for name, body in messages]


async def _put_events(entries: Sequence[tuple[str, dict[str, JsonValue]]], *, region: str,
                      endpoint_url: str | None) -> list[tuple[str, str]]:
    sent = []
    async with open_client("events", region=region, endpoint_url=endpoint_url) as client:
        for name, item in entries:
            try:
                response = await client.put_events(Entries=[item])
            except Exception as e:
                raise translate(e, backend="events", operation="PutEvents") from e
            result = response["Entries"][0]
            if response.get("FailedEntryCount") or "EventId" not in result:
                raise BackendUnavailable("events", f"{name}: PutEvents refused it: "
                                                   f"{result.get('ErrorCode')}: {result.get('ErrorMessage')}")
            sent.append((name, result["EventId"]))
    return sent

