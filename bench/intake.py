"""Intake benchmark: events through moto's SQS, against a bare receive+delete loop in the same run.

    python bench/intake.py [--events 10000] [--concurrency 10]

Two queues on one moto server (a child process on 127.0.0.1) get the same N events (a mix of
every kind), streamed in by a producer that keeps each queue at most ``--depth`` deep (moto's
SQS scans the whole queue on every call).  The baseline drains one with a bare aiobotocore loop -- receive 10 (long poll),
delete each message, at most ``concurrency`` deletes in flight, the next receive not waiting
for them -- the transport's limit for this consumer's shape.  resilienced drains the other with
its real consumer loop (decode, validate, parse, plan, claim, PlanLogger, ack, decision log
line rendered as JSON, metrics).  Printed: events/s for both and their ratio (target >= 0.8),
the CPU time this (client) process spent per event in each loop (the producer included in both),
p50/p99 of receive-to-decided latency (receive returned -> message deleted), and the idle RSS
of a ``resilienced run`` process.  Figures go to docs/benchmarks.md (## Intake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from aiobotocore.session import get_session

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resilienced import log  # noqa: E402
from resilienced.aws.sqs import SqsQueue  # noqa: E402
from resilienced.doubles import MemoryClaims  # noqa: E402
from resilienced.consumer.loop import Consumer  # noqa: E402
from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer, free_port  # noqa: E402
from resilienced.recovery.plan_only import PlanLogger  # noqa: E402
from resilienced.settings import IntakeSettings, QueueSettings  # noqa: E402

REGION = "us-east-1"


def events(count: int) -> list[str]:
    """A mix of every kind, each with its own id, stamped now (the daemon acknowledges stale
    notices without acting: a benchmark of old ones would measure only that)."""
    now = datetime.now(timezone.utc)
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    window = (now + timedelta(days=1)).strftime("%a, %d %b %Y %H:%M:%S GMT")

    def envelope(detail_type, detail, source="aws.ec2"):
        return {"version": "0", "id": str(uuid.uuid4()), "detail-type": detail_type, "source": source,
                "account": "123456789012", "time": stamp, "region": REGION,
                "resources": [], "detail": detail}
    shapes = [
        lambda i: envelope("EC2 Spot Instance Interruption Warning",
                           {"instance-id": f"i-{i:017x}", "instance-action": "terminate"}),
        lambda i: envelope("EC2 Instance Rebalance Recommendation", {"instance-id": f"i-{i:017x}"}),
        lambda i: envelope("EC2 Instance State-change Notification", {"instance-id": f"i-{i:017x}",
                                                                      "state": "running"}),
        lambda i: envelope("AWS Health Event", {
            "service": "EC2", "eventTypeCategory": "scheduledChange", "startTime": window,
            "affectedEntities": [{"entityValue": f"i-{i:017x}"}]}, source="aws.health"),
        lambda i: envelope("EC2 Instance-terminate Lifecycle Action", {
            "LifecycleActionToken": str(uuid.uuid4()), "AutoScalingGroupName": "g", "LifecycleHookName": "h",
            "EC2InstanceId": f"i-{i:017x}", "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING"},
            source="aws.autoscaling"),
    ]
    return [json.dumps(shapes[i % len(shapes)](i)) for i in range(count)]


class Producer:
    """Streams the events onto a queue, keeping at most ``depth`` unconsumed.

    moto's SQS scans the whole queue on every receive (a receive of 10 from 2,000 messages
    takes seconds), so 10,000 events are streamed through a shallow queue -- as in production,
    where the queue is almost always nearly empty -- rather than loaded up front.
    """

    def __init__(self, client, url: str, bodies: list[str], depth: int) -> None:
        self.client, self.url, self.bodies, self.depth = client, url, bodies, depth
        self.consumed = 0
        self._changed = asyncio.Event()

    def took(self) -> None:
        self.consumed += 1
        self._changed.set()

    async def run(self) -> None:
        sent = 0
        while sent < len(self.bodies):
            if sent - self.consumed + 10 > self.depth:
                self._changed.clear()
                await self._changed.wait()
                continue
            entries = [{"Id": str(n), "MessageBody": body} for n, body in enumerate(self.bodies[sent:sent + 10])]
            await self.client.send_message_batch(QueueUrl=self.url, Entries=entries)
            sent += len(entries)


async def baseline(client, url: str, count: int, concurrency: int,
                   producer: Producer) -> tuple[float, list[float]]:
    """Bare receive + delete; deletes pipelined (at most ``concurrency``) like the consumer's handlers."""
    latencies: list[float] = []
    pending: set[asyncio.Task] = set()
    slot_freed = asyncio.Event()

    async def delete(message: dict, received: float) -> None:
        await client.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
        latencies.append(time.perf_counter() - received)
        producer.took()

    def finished(task: asyncio.Task) -> None:
        pending.discard(task)
        slot_freed.set()

    start = time.perf_counter()
    feeding = asyncio.create_task(producer.run())
    taken = 0
    while taken < count:
        free = concurrency - len(pending)
        if free <= 0:
            slot_freed.clear()
            await slot_freed.wait()
            continue
        response = await client.receive_message(QueueUrl=url, MaxNumberOfMessages=min(10, free),
                                                WaitTimeSeconds=1, VisibilityTimeout=60)
        received = time.perf_counter()
        for message in response.get("Messages", []):
            taken += 1
            task = asyncio.create_task(delete(message, received))
            pending.add(task)
            task.add_done_callback(finished)
    await asyncio.gather(*pending, feeding)
    return time.perf_counter() - start, latencies


async def daemon(endpoint: str, url: str, count: int, concurrency: int,
                 producer: Producer) -> tuple[float, list[float]]:
    latencies: list[float] = []
    done = asyncio.Event()

    def observe(message, outcome, verdict, latency) -> None:
        latencies.append(latency)
        producer.took()
        if len(latencies) >= count:
            done.set()

    settings = QueueSettings(queue_url=url, region=REGION, endpoint_url=endpoint, wait_seconds=1,
                             concurrency=concurrency, visibility_timeout=60)
    async with SqsQueue.open(queue_url=url, region=REGION, endpoint_url=endpoint,
                             max_connections=concurrency * 2 + 4) as queue:
        consumer = Consumer(queue=queue, responder=PlanLogger(), claims=MemoryClaims(),
                            queue_settings=settings, intake_settings=IntakeSettings(),
                            max_receive_count=None, observer=observe)
        start = time.perf_counter()
        feeding = asyncio.create_task(producer.run())
        loop = asyncio.create_task(consumer.run())
        await done.wait()
        elapsed = time.perf_counter() - start
        await feeding
        consumer.stop()
        await loop
    return elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def idle_rss(endpoint: str, url: str, settle: float) -> float:
    """VmRSS (MiB) of `resilienced run` once ready and idle on an empty queue."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "resilienced", "run", "--queue-url", url, "--endpoint-url",
                             endpoint, "--region", REGION, "--allow-no-dlq", "--http-host", "127.0.0.1",
                             "--http-port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        time.sleep(settle)
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def measure(endpoint: str, count: int, concurrency: int, depth: int) -> dict:
    session = get_session()
    async with session.create_client("sqs", region_name=REGION, endpoint_url=endpoint) as client, \
            session.create_client("sqs", region_name=REGION, endpoint_url=endpoint) as feeder:
        urls = {}
        for name in ("bench-baseline", "bench-daemon", "bench-idle"):
            urls[name] = (await client.create_queue(QueueName=name))["QueueUrl"]
        cpu = time.process_time()
        base_s, base_lat = await baseline(client, urls["bench-baseline"], count, concurrency,
                                          Producer(feeder, urls["bench-baseline"], events(count), depth))
        base_cpu = time.process_time() - cpu
        cpu = time.process_time()
        ours_s, ours_lat = await daemon(endpoint, urls["bench-daemon"], count, concurrency,
                                        Producer(feeder, urls["bench-daemon"], events(count), depth))
        ours_cpu = time.process_time() - cpu
    return {"base_s": base_s, "base_lat": base_lat, "ours_s": ours_s, "ours_lat": ours_lat,
            "base_cpu": base_cpu, "ours_cpu": ours_cpu, "idle_url": urls["bench-idle"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--depth", type=int, default=30, help="most unconsumed messages on the queue")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle time before reading RSS")
    args = parser.parse_args()
    os.environ.update(FAKE_CREDENTIALS)
    log.configure(level="info", stream=open(os.devnull, "w"))  # decision lines rendered, not shown
    with MotoServer() as moto:
        result = asyncio.run(measure(moto.endpoint_url, args.events, args.concurrency, args.depth))
        rss = idle_rss(moto.endpoint_url, result["idle_url"], args.idle_seconds)
    n = args.events
    base_rate, ours_rate = n / result["base_s"], n / result["ours_s"]
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    print(f"machine: {platform.machine()}, nproc {os.cpu_count()}, {platform.python_implementation()} "
          f"{platform.python_version()}, moto server on 127.0.0.1 (same machine)")
    print(f"events: {n} (mixed kinds) streamed through a queue at most {args.depth} deep, "
          f"concurrency {args.concurrency}, receives of up to 10")
    us = lambda cpu: f"{cpu / n * 1e6:.0f} µs"  # noqa: E731
    print("| loop | events/s | p50 receive-to-decided | p99 receive-to-decided | client CPU per event |")
    print("|---|---|---|---|---|")
    print(f"| bare aiobotocore receive+delete (baseline) | {base_rate:.0f} | "
          f"{ms(percentile(result['base_lat'], 50))} | {ms(percentile(result['base_lat'], 99))} | "
          f"{us(result['base_cpu'])} |")
    print(f"| resilienced consumer | {ours_rate:.0f} | {ms(percentile(result['ours_lat'], 50))} | "
          f"{ms(percentile(result['ours_lat'], 99))} | {us(result['ours_cpu'])} |")
    print(f"ratio resilienced / baseline: {ours_rate / base_rate:.2f} (target >= 0.8)")
    print(f"idle RSS of `resilienced run`: {rss:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
