"""The consumer's timing: visibility extensions, retries, backoff, claim renewals and shutdown.

These run on :class:`~tests.support.virtualtime.MemoryQueue` (SQS's visibility, receive count and
redrive semantics, held against moto's SQS in tests/intake/test_memory_queue.py) on a virtual clock
(:class:`~tests.support.virtualtime.VirtualClockLoop`): "every visibility/3 seconds" and "retry
in 2 s" are the consumer's own waits, played in their order at no wall-clock cost, so nothing
here depends on how busy the machine is.  The end-to-end consumer on moto over HTTP (routing,
SNS, duplicates, DLQ, the loop): test_consumer.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from resilienced.doubles import MemoryClaims
from resilienced.consumer.loop import Consumer
from resilienced.errors import BackendUnavailable, TemporaryError
from resilienced.ops.metrics import Metrics
from resilienced.model import Outcome, Plan, Result
from resilienced.settings import IntakeSettings, QueueSettings
from tests.support.virtualtime import MemoryQueue

from tests.intake import payloads as p
from tests.intake.conftest import Gate, Recorder

pytestmark = pytest.mark.unit


def consumer_on(queue: MemoryQueue, responder: Any, *, claims: Any = None, **settings: Any) -> Consumer:
    options = {"queue_url": "https://sqs.us-east-1.amazonaws.com/123456789012/interruptions",
               "region": "us-east-1", "wait_seconds": 1, "visibility_timeout": 30, "shutdown_timeout": 5,
               **settings}
    return Consumer(queue=queue, responder=responder, claims=claims if claims is not None else MemoryClaims(),
                    queue_settings=QueueSettings(**options), intake_settings=IntakeSettings(),
                    max_receive_count=queue.max_receives, metrics=Metrics(), clock=None)


def send(queue: MemoryQueue, event: dict) -> str:
    return queue.send(json.dumps(event))


async def run_until(consumer: Consumer, count: int, *, passes: int = 20) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for _ in range(passes):
        outcomes += await consumer.run_once()
        if len(outcomes) >= count:
            return outcomes
    raise AssertionError(f"only {len(outcomes)} of {count} messages decided in {passes} passes")


def now() -> float:
    return asyncio.get_running_loop().time()


class Failing:
    """A responder that raises the given errors in turn, then succeeds."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.at: list[float] = []

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        self.calls += 1
        self.at.append(now())
        if self.errors:
            raise self.errors.pop(0)
        return Outcome(result=Result.DONE, event=plan.event, plan=plan)


async def test_the_clock_is_virtual() -> None:
    before = now()
    await asyncio.sleep(3600)
    assert now() - before == pytest.approx(3600)


@pytest.mark.parametrize(("error", "back_after"), [(TemporaryError("kube API timed out", delay=0), 0),
                                                   (RuntimeError("a bug in the responder"), 2)],
                         ids=["temporary-error", "unexpected-exception"])
async def test_a_failing_handlers_message_comes_back_and_succeeds_later(error: Exception, back_after: float) -> None:
    """A temporary error with a delay comes back after it; an unexpected one after the visibility timeout."""
    queue = MemoryQueue()
    responder = Failing(error)
    consumer = consumer_on(queue, responder, visibility_timeout=2)
    send(queue, p.spot())
    [failed] = await run_until(consumer, 1)
    assert failed.result is Result.RETRY
    assert sum(queue.counts(now())) == 1  # kept on the queue
    [retried] = await run_until(consumer, 1)
    assert retried.result is Result.DONE
    assert responder.calls == 2 and responder.at[1] - responder.at[0] == pytest.approx(back_after, abs=1)
    assert queue.messages == {} and queue.dead == []


async def test_a_backend_failure_is_retried_with_a_backoff_that_grows_with_the_receive_count() -> None:
    """A backend that stays down (ray mode: the GCS unreachable) must not use up the redrive count
    at one receive per visibility timeout: each retry waits twice as long as the one before."""
    queue = MemoryQueue()
    down = [BackendUnavailable("ray-gcs", "127.0.0.1:6379: cannot connect") for _ in range(2)]
    responder = Failing(*down)
    consumer = consumer_on(queue, responder, visibility_timeout=1)
    send(queue, p.spot())
    outcomes = await run_until(consumer, 3)
    assert [o.result for o in outcomes] == [Result.RETRY, Result.RETRY, Result.DONE]
    assert [o.retry_delay for o in outcomes[:2]] == [1.0, 2.0]
    gaps = [b - a for a, b in zip(responder.at, responder.at[1:])]
    assert gaps == [pytest.approx(1.0, abs=0.1), pytest.approx(2.0, abs=0.1)]  # the message was away that long
    assert consumer.metrics.value("resilienced_backend_errors_total", backend="ray-gcs") == 2
    assert queue.messages == {}


async def test_a_handler_slower_than_the_visibility_timeout_is_not_redelivered_meanwhile() -> None:
    queue = MemoryQueue()
    gate = Gate()
    consumer = consumer_on(queue, gate, visibility_timeout=2)
    send(queue, p.spot())
    handling = asyncio.create_task(consumer.run_once())
    await gate.wait_entered(1)
    started = now()
    # A competing consumer watches for ten visibility timeouts: it never gets the message, because
    # the keeper extends it every third of the timeout.
    while now() - started < 20:
        stolen = await queue.receive(max_messages=1, wait_seconds=1, visibility_timeout=1)
        assert stolen == [], f"redelivered at +{now() - started:.2f}s while its handler was still running"
    assert consumer.metrics.value("resilienced_visibility_extensions_total") >= 29
    assert queue.counts(now()) == (0, 1)
    gate.open(p.INSTANCE)
    [outcome] = await handling
    assert outcome.result is Result.DONE
    assert queue.messages == {}


async def test_without_extensions_the_message_would_come_back() -> None:
    """The check above can fail: a handler running past the visibility timeout with its keeper
    stopped is redelivered to a competitor at once."""
    queue = MemoryQueue()
    send(queue, p.spot())
    [message] = await queue.receive(max_messages=1, wait_seconds=0, visibility_timeout=2)
    await asyncio.sleep(2)
    [again] = await queue.receive(max_messages=1, wait_seconds=0, visibility_timeout=2)
    assert again.message_id == message.message_id and again.receive_count == 2


class HeldRenewal(MemoryClaims):
    """The real in-memory claim store; a renewal of an event claim (its second acquire) is held
    until the test lets it go, and every call is written down in order."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: asyncio.get_running_loop().time())
        self.calls: list[str] = []
        self.renewing = asyncio.Event()
        self.let_go = asyncio.Event()

    async def acquire(self, key, *, holder, ttl_seconds):
        renewal = any(c == f"acquire {key}" for c in self.calls)
        self.calls.append(f"acquire {key}")
        if renewal and not self.let_go.is_set():
            self.renewing.set()
            try:
                await self.let_go.wait()
            except asyncio.CancelledError:
                self.calls.append("renewal abandoned")
                raise
            self.calls.append("renewed")
        return await super().acquire(key, holder=holder, ttl_seconds=ttl_seconds)

    async def complete(self, key, *, holder, details):
        self.calls.append("complete")
        await super().complete(key, holder=holder, details=details)


async def test_a_renewal_in_flight_lands_before_the_event_claim_is_completed() -> None:
    """The message keeper renews the event claim; the completion waits for a renewal in flight
    (in ray mode one landing after it would turn the done claim back into a held one)."""
    queue, gate, claims = MemoryQueue(), Gate(), HeldRenewal()
    consumer = consumer_on(queue, gate, claims=claims, visibility_timeout=2)
    send(queue, p.spot())
    handling = asyncio.create_task(consumer.run_once())
    await gate.wait_entered(1)
    await asyncio.wait_for(claims.renewing.wait(), timeout=30)  # the keeper's renewal is held
    gate.open(p.INSTANCE)
    await asyncio.sleep(10)  # the handler is done; without the lock it would complete meanwhile
    assert "complete" not in claims.calls
    claims.let_go.set()
    [outcome] = await handling

    assert outcome.result is Result.DONE
    assert "renewal abandoned" not in claims.calls
    assert claims.calls[-2:] == ["renewed", "complete"], claims.calls
    key = next(c.split(" ", 1)[1] for c in claims.calls if c.startswith("acquire "))
    assert (await claims.get(key)).state == "done"


class TakenOver(MemoryClaims):
    """The real in-memory claim store on the loop's clock; ``lost`` is set when a renewal by the
    first holder of a key finds it held by another."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: asyncio.get_running_loop().time())
        self.first: dict[str, str] = {}
        self.lost = asyncio.Event()

    async def acquire(self, key, *, holder, ttl_seconds):
        claim = await super().acquire(key, holder=holder, ttl_seconds=ttl_seconds)
        self.first.setdefault(key, holder)
        if claim is None and holder == self.first[key]:
            self.lost.set()
        return claim


class Stalled(TakenOver):
    """...whose renewals by the first holder stall for 60 s (a stopped GCS): the claim lapses."""

    async def acquire(self, key, *, holder, ttl_seconds):
        if key in self.first and holder == self.first[key]:
            await asyncio.sleep(60)
        return await super().acquire(key, holder=holder, ttl_seconds=ttl_seconds)


async def test_a_delivery_whose_event_claim_was_taken_over_does_not_decide_the_event() -> None:
    """A replica that could not renew its event claim in time (a stalled store, a starved process)
    finds it taken over by another delivery: the holder decides, so this one's outcome is a retry
    (not a final decision: the event would be decided twice), and it leaves the claim alone."""
    queue, gate, claims = MemoryQueue(), Gate(), Stalled()
    consumer = consumer_on(queue, gate, claims=claims, visibility_timeout=2)
    send(queue, p.spot())
    handling = asyncio.create_task(consumer.run_once())
    await gate.wait_entered(1)
    [key] = claims.first
    await asyncio.sleep(3)  # past the claim's TTL (2 s): it lapsed while the renewal stalls
    other = "replica-b/another-delivery"
    assert await claims.acquire(key, holder=other, ttl_seconds=600) is not None
    await asyncio.wait_for(claims.lost.wait(), timeout=120)  # the stalled renewal finds it taken
    gate.open(p.INSTANCE)
    [outcome] = await handling

    assert outcome.result is Result.RETRY, outcome
    assert f"event claim {key} lost while handling it (taken over by {other})" in outcome.reason
    assert outcome.retry_delay == 2
    claim = await claims.get(key)
    assert (claim.holder, claim.state) == (other, "held")
    assert sum(queue.counts(now())) == 1  # the message stays on the queue for the holder to settle


async def test_a_hung_claim_renewal_does_not_stop_the_visibility_extensions() -> None:
    """A claim store that does not answer (ray mode: the GCS stopped, a call held up to 45 s)
    must not hold up the message's visibility extensions: the message would become visible and
    another replica would handle the event a second time (the campaign's gcs scenario)."""
    queue, gate, claims = MemoryQueue(), Gate(), HeldRenewal()
    consumer = consumer_on(queue, gate, claims=claims, visibility_timeout=2)
    send(queue, p.spot())
    handling = asyncio.create_task(consumer.run_once())
    await gate.wait_entered(1)
    await asyncio.wait_for(claims.renewing.wait(), timeout=30)  # the event claim's renewal hangs
    extended = consumer.metrics.value("resilienced_visibility_extensions_total")
    end = now() + 60  # a competitor watches the queue for 30 visibility timeouts
    while now() < end:
        stolen = await queue.receive(max_messages=1, wait_seconds=1, visibility_timeout=1)
        assert stolen == [], "redelivered while its handler was running and its claim renewal hung"
    assert consumer.metrics.value("resilienced_visibility_extensions_total") >= extended + 89
    claims.let_go.set()
    gate.open(p.INSTANCE)
    [outcome] = await handling
    assert outcome.result is Result.DONE
    assert "renewal abandoned" not in claims.calls
    assert queue.messages == {}


async def test_stop_mid_batch_finishes_what_it_can_within_the_shutdown_timeout_and_releases_the_rest() -> None:
    queue, gate = MemoryQueue(), Gate()
    consumer = consumer_on(queue, gate, shutdown_timeout=1.0)
    ids = [f"i-0000000000000000{n}" for n in range(1, 5)]
    for instance in ids:
        send(queue, p.spot(instance))
    loop = asyncio.create_task(consumer.run())
    await gate.wait_entered(4)
    consumer.stop()
    stopped = now()
    late = send(queue, p.spot("i-0000000000000000f"))  # arrives after stop: must not be taken
    gate.open(ids[0])
    await asyncio.sleep(0.5)
    gate.open(ids[1])  # within the shutdown timeout
    await asyncio.sleep(1)
    gate.open(ids[2])  # too late: released already
    await loop
    assert now() - stopped == pytest.approx(1.0, abs=0.6)
    assert sorted(gate.finished) == ids[:2]
    assert sorted(gate.cancelled) == ids[2:]
    # the loop's long poll was in flight when stop() came and answered with the late message:
    # given back at once, never started
    assert "i-0000000000000000f" not in gate.entered
    assert consumer.metrics.value("resilienced_released_total") == 3
    assert consumer.in_flight == 0
    back = await queue.receive(max_messages=10, wait_seconds=0, visibility_timeout=30)  # visible at once
    by_instance = {json.loads(m.body)["detail"]["instance-id"]: m for m in back}
    assert sorted(by_instance) == sorted(ids[2:] + ["i-0000000000000000f"])
    assert by_instance["i-0000000000000000f"].message_id == late


async def test_an_outage_of_the_queue_backs_off_doubling_up_to_its_bound_and_recovers() -> None:
    queue, recorder = MemoryQueue(), Recorder()
    queue.fail_receives = 7
    consumer = consumer_on(queue, recorder)
    send(queue, p.spot())
    loop = asyncio.create_task(consumer.run())
    started = now()
    while not recorder.plans:
        await asyncio.sleep(0.1)
    consumer.stop()
    await loop
    # backoff 1, 2, 4, 8, 16, 30, 30 (MAX_BACKOFF) between the failed receives
    assert now() - started == pytest.approx(1 + 2 + 4 + 8 + 16 + 30 + 30, abs=1.5)
    assert queue.receives >= 8
    assert consumer.metrics.value("resilienced_queue_errors_total", operation="receive") == 7
    assert consumer.readiness.ready()
