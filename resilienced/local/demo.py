"""``resilienced demo``: the intake end to end on an embedded moto, over the packaged samples.

1. start moto in server mode (:class:`~resilienced.local.aws.MotoServer`) on 127.0.0.1;
2. create an SQS queue with a DLQ (redrive policy, maxReceiveCount 3) and one EventBridge
   rule per event kind (source + detail-types of its handler) targeting the queue;
3. inject every sample under ``resilienced/samples``: EventBridge events through the bus
   (PutEvents, so the rules route them), the rest (the direct ASG form, the documentation
   templates, a body that is not an event) straight onto the queue, as a producer would;
4. run the daemon's consumer until the queue is empty (poison has moved to the DLQ);
5. print what was decided for each sample, and stop everything.

Nothing leaves the machine.  Actionable plans are only logged (PlanLogger).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

from aiobotocore.session import get_session

from resilienced import log
from resilienced.app import inject
from resilienced.app import replay
from resilienced.aws.sqs import SqsQueue
from resilienced.doubles import MemoryClaims
from resilienced.consumer.loop import Consumer
from resilienced.errors import ConfigError
from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer, create_queue_with_dlq, create_rules
from resilienced.model import Outcome, Verdict
from resilienced.ports import Message
from resilienced.recovery.plan_only import PlanLogger
from resilienced.settings import IntakeSettings, QueueSettings
from resilienced.intake.validate import isoformat

REGION = "us-east-1"
MAX_RECEIVE_COUNT = 3
#: How long the demo waits for the queue to empty before it gives up, in seconds.
DRAIN_LIMIT = 120.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per sample instead of a table")
    parser.add_argument("--verbose", action="store_true", help="show the daemon's log lines (stderr)")


def main(args: argparse.Namespace) -> int:
    log.configure(level="info" if args.verbose else "error", stream=sys.stderr)
    os.environ.update(FAKE_CREDENTIALS)
    with MotoServer() as moto:
        rows, dead = asyncio.run(run_demo(endpoint_url=moto.endpoint_url))
    replay.write(rows, as_json=args.json, stream=sys.stdout, columns=COLUMNS)
    if not args.json:
        print(f"\n{len(rows)} samples; {dead} message(s) in the DLQ after {MAX_RECEIVE_COUNT} receives each.")
    return 0


def samples() -> Iterator[tuple[str, bytes]]:
    """(relative name, body) of every packaged sample, in name order."""
    root = resources.files("resilienced") / "samples"
    found = []
    for folder in root.iterdir():
        if folder.is_dir():
            found.extend((f"{folder.name}/{item.name}", item) for item in folder.iterdir()
                         if item.name.endswith(".json"))
    for name, item in sorted(found, key=lambda pair: pair[0]):
        yield name, item.read_bytes()


async def run_demo(*, endpoint_url: str) -> tuple[list[dict[str, Any]], int]:
    """Set up, inject, consume until drained; return (one row per sample, DLQ size)."""
    session = get_session()
    async with session.create_client("sqs", region_name=REGION, endpoint_url=endpoint_url) as sqs, \
            session.create_client("events", region_name=REGION, endpoint_url=endpoint_url) as events:
        queue_url, dlq_url = await create_queue_with_dlq(sqs, name="resilienced-demo",
                                                         max_receive_count=MAX_RECEIVE_COUNT)
        await create_rules(events, queue_url=queue_url, sqs=sqs)
        sent = await _inject(sqs, events, queue_url)
        decisions: dict[str, tuple[Message, Outcome, Verdict]] = {}
        queue_settings = QueueSettings(queue_url=queue_url, region=REGION, endpoint_url=endpoint_url,
                                       wait_seconds=1, visibility_timeout=30, shutdown_timeout=5)
        intake_settings = IntakeSettings()
        async with SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=endpoint_url) as queue:
            consumer = Consumer(
                queue=queue, responder=PlanLogger(), claims=MemoryClaims(),
                queue_settings=queue_settings, intake_settings=intake_settings,
                max_receive_count=await queue.max_receive_count(),
                observer=lambda m, o, v, _latency: decisions.__setitem__(m.message_id, (m, o, v)),
                clock=None,  # recorded samples: each judged as of its own time, as replay does
            )
            loop = asyncio.create_task(consumer.run(), name="resilienced.demo.consumer")
            try:
                await _until_drained(sqs, queue_url, consumer)
            finally:
                consumer.stop()
                await loop
        dead = int((await sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=[
            "ApproximateNumberOfMessages"]))["Attributes"]["ApproximateNumberOfMessages"])
    return _rows(sent, decisions), dead


async def _inject(sqs: Any, events: Any, queue_url: str) -> list[tuple[str, str, str]]:
    """(sample, via, id): the EventBridge event id, or the SQS message id when sent directly."""
    sent = []
    for name, body in samples():
        try:
            item = inject.entry(name, body, bus="default", fresh=False)
        except ConfigError:
            item = None
        if item is not None:
            response = await events.put_events(Entries=[item])
            sent.append((name, "eventbridge", response["Entries"][0]["EventId"]))
        else:
            response = await sqs.send_message(QueueUrl=queue_url, MessageBody=body.decode("utf-8", "replace"))
            sent.append((name, "sqs", response["MessageId"]))
    return sent


async def _until_drained(sqs: Any, queue_url: str, consumer: Consumer) -> None:
    deadline = time.monotonic() + DRAIN_LIMIT
    while time.monotonic() < deadline:
        attributes = (await sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]))["Attributes"]
        if int(attributes["ApproximateNumberOfMessages"]) + int(
                attributes["ApproximateNumberOfMessagesNotVisible"]) == 0 and consumer.in_flight == 0:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the demo queue did not drain within {DRAIN_LIMIT:.0f}s")


def _rows(sent: list[tuple[str, str, str]],
          decisions: dict[str, tuple[Message, Outcome, Verdict]]) -> list[dict[str, Any]]:
    by_event = {o.event.event_id: (m, o, v) for m, o, v in decisions.values() if o.event}
    rows = []
    for name, via, ident in sent:
        found = decisions.get(ident) if via == "sqs" else by_event.get(ident)
        row: dict[str, Any] = {"sample": name, "via": via}
        if found is None:
            row.update(kind=None, outcome="not delivered (no rule matched)", verdict=None)
        else:
            message, outcome, verdict = found
            plan = outcome.plan
            row.update(
                kind=outcome.event.kind.value if outcome.event else None,
                outcome=outcome.result.value,
                verdict=("dead_letter -> DLQ" if verdict is Verdict.DEAD_LETTER else verdict.value),
                receives=message.receive_count,
                instance_ids=list(plan.instance_ids) if plan else [],
                deadline=isoformat(plan.deadline) if plan else None,
                steps=[s.value for s in plan.steps] if plan else [],
                reason=outcome.reason,
            )
        rows.append(row)
    return rows


COLUMNS = (("SAMPLE", "sample"), ("VIA", "via"), ("KIND", "kind"), ("OUTCOME", "outcome"),
           ("VERDICT", "verdict"), ("INSTANCES", "instance_ids"), ("STEPS", "steps"),
           ("REASON", "reason"))
