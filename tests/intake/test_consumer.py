"""The consumer against moto over HTTP: EventBridge -> SQS (+DLQ) -> receive -> handle -> ack."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import boto3
import pytest

from handlers import registry
from resilienced.doubles import MemoryClaims
from resilienced.errors import BackendUnavailable, PermanentError, TemporaryError
from resilienced.model import Kind, Outcome, Plan, Result, Wrapping
from resilienced.settings import IntakeSettings

from . import payloads as p
from .conftest import MAX_RECEIVE_COUNT, REGION, Gate, Recorder, eventually, make_queues

pytestmark = pytest.mark.integration


async def run_until(consumer, count: int, *, passes: int = 20) -> list[Outcome]:
    """run_once until ``count`` outcomes (bounded number of passes)."""
    outcomes: list[Outcome] = []
    for _ in range(passes):
        outcomes += await consumer.run_once()
        if len(outcomes) >= count:
            return outcomes
    raise AssertionError(f"only {len(outcomes)} of {count} messages decided in {passes} passes")


# --------------------------------------------------------------------------- end to end
async def test_eventbridge_rules_route_every_kind_to_the_queue_and_each_is_decided(queues, make_consumer):
    events = boto3.client("events", region_name=REGION, endpoint_url=queues.endpoint_url)
    for module in registry.MODULES:
        name = f"rule-{module.KIND.value}"
        events.put_rule(Name=name, EventPattern=json.dumps(
            {"source": [module.SOURCE], "detail-type": list(module.DETAIL_TYPES)}))
        events.put_targets(Rule=name, Targets=[{"Id": "q", "Arn": queues.arn}])
    sent = [p.spot("i-00000000000000001"), p.reservation_interruption("i-00000000000000002"),
            p.block_expiry(),
            p.health(("i-00000000000000004",), start="Mon, 01 Jan 2024 06:00:00 GMT"),  # ahead of its time
            p.state_change("terminated", "i-00000000000000005"),
            p.rebalance("i-00000000000000006"), p.asg("i-00000000000000007"),
            p.state_change("pending", "i-00000000000000008"),
            p.spot("i-00000000000000009", source="custom.chaos")]  # no rule matches a custom source
    for event in sent:
        response = events.put_events(Entries=[{
            "Source": event["source"], "DetailType": event["detail-type"],
            "Detail": json.dumps(event["detail"]), "Time": event["time"]}])
        assert response["FailedEntryCount"] == 0
    recorder = Recorder()
    consumer = make_consumer(recorder)
    outcomes = await run_until(consumer, 8)
    kinds = sorted((o.event.kind.value, o.result.value) for o in outcomes)
    assert kinds == sorted([
        ("spot_interruption", "done"), ("capacity_reservation_interruption", "done"),
        ("capacity_block_expiry", "done"), ("scheduled_change", "done"), ("state_change", "done"),
        ("rebalance_recommendation", "done"), ("asg_lifecycle", "done"), ("state_change", "not_actionable")])
    assert all(o.event.account is None for o in outcomes)  # moto's EventBridge drops `account`
    assert len(recorder.plans) == 7
    assert queues.counts() == (0, 0)
    assert queues.receive_all(queues.dlq_url) == []


async def test_sns_wrapped_events_are_unwrapped(aws, queues, make_consumer):
    sns = boto3.client("sns", region_name=REGION, endpoint_url=queues.endpoint_url)
    topic = sns.create_topic(Name="interruptions")["TopicArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queues.arn)
    sns.publish(TopicArn=topic, Message=json.dumps(p.spot()))
    recorder = Recorder()
    [outcome] = await run_until(make_consumer(recorder), 1)
    assert outcome.result is Result.DONE
    assert outcome.event.wrapping is Wrapping.SNS
    assert recorder.plans[0].instance_ids == (p.INSTANCE,)


# --------------------------------------------------------------------------- idempotency
class Sharing(Recorder):
    """A responder that shares claims (``ports.SharesClaims``): every plan needs its event claim
    here; ``over`` lists each delivery the consumer said is over (``settled``)."""

    def __init__(self) -> None:
        super().__init__()
        self.over: list[str | None] = []

    async def needs_event_claim(self, plan: Plan) -> bool:
        return True

    def settled(self, plan: Plan) -> None:
        self.over.append(plan.event.event_id)


@pytest.mark.parametrize("responder", [Recorder, Sharing])
async def test_duplicates_in_one_batch_act_once(queues, make_consumer, responder):
    """With a responder that shares claims (``Recovery``, issue #45), both deliveries are said to be
    over, the duplicate's too: it reserved a run's handling when asked whether it needs its claim."""
    event = p.spot(id="dup-1")
    queues.send(event)
    queues.send(event)
    recorder = responder()
    outcomes = await run_until(make_consumer(recorder), 2)
    assert sorted(o.result.value for o in outcomes) == ["done", "duplicate"]
    assert len(recorder.plans) == 1
    assert queues.counts() == (0, 0)
    if isinstance(recorder, Sharing):
        assert recorder.over == ["dup-1", "dup-1"]


async def test_a_duplicate_after_the_event_was_handled_acts_no_more(queues, make_consumer):
    recorder = Recorder()
    consumer = make_consumer(recorder)
    queues.send(p.spot(id="dup-2"))
    assert [o.result for o in await run_until(consumer, 1)] == [Result.DONE]
    queues.send(p.spot(id="dup-2"))
    [again] = await run_until(consumer, 1)
    assert again.result is Result.DUPLICATE and "already handled" in again.reason
    assert len(recorder.plans) == 1
    assert queues.counts() == (0, 0)


async def test_a_copy_of_an_event_being_handled_elsewhere_is_dropped_while_the_original_stays(
        queues, make_consumer):
    gate = Gate()
    claims = MemoryClaims()
    holder = make_consumer(gate, claims=claims, replica="replica-a", batch_size=1)
    other = make_consumer(Recorder(), claims=claims, replica="replica-b")
    queues.send(p.spot(id="dup-3"))
    first = asyncio.create_task(holder.run_once())
    await gate.wait_entered(1)
    queues.send(p.spot(id="dup-3"))
    [copy] = await run_until(other, 1)
    assert copy.result is Result.DUPLICATE and "being handled by replica-a" in copy.reason
    assert queues.counts() == (0, 1)  # the original, in flight
    gate.open(p.INSTANCE)
    [original] = await first
    assert original.result is Result.DONE
    assert queues.counts() == (0, 0)


# --------------------------------------------------------------------------- failures
class Failing:
    """Raises the given errors on successive calls, then succeeds."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return Outcome(result=Result.DONE, event=plan.event, plan=plan)


async def test_a_permanent_failure_is_recorded_and_acknowledged(queues, make_consumer):
    consumer = make_consumer(Failing(PermanentError("no Ray cluster owns this node")))
    queues.send(p.spot())
    [outcome] = await run_until(consumer, 1)
    assert outcome.result is Result.FAILED and "no Ray cluster" in outcome.reason
    assert queues.counts() == (0, 0)
    assert consumer.metrics.value("resilienced_events_decided_total", kind="spot_interruption",
                                  outcome="failed") == 1


# --------------------------------------------------------------------------- poison
@pytest.mark.parametrize("body, result", [
    ("this is not JSON", Result.UNDECODABLE),
    (json.dumps(p.spot(source="custom.chaos")), Result.INVALID),
], ids=["undecodable", "invalid"])
async def test_poison_reaches_the_dlq_after_max_receives(queues, make_consumer, body, result):
    consumer = make_consumer(Recorder())
    queues.send(body)
    outcomes = []
    for _ in range(MAX_RECEIVE_COUNT + 3):
        outcomes += await consumer.run_once()
        if queues.counts(queues.dlq_url) != (0, 0):
            break
    assert [o.result for o in outcomes] == [result] * MAX_RECEIVE_COUNT
    assert consumer.metrics.value("resilienced_dead_lettered_total") == 1
    assert queues.counts() == (0, 0)
    dead = queues.sqs.receive_message(QueueUrl=queues.dlq_url, WaitTimeSeconds=1)["Messages"]
    assert [m["Body"] for m in dead] == [body]  # unchanged, for an operator to read


async def test_without_a_dlq_poison_is_deleted_after_the_configured_receives(aws, make_consumer):
    bare = make_queues(aws, name="no-dlq", dlq=False)
    from resilienced.aws.sqs import SqsQueue
    async with SqsQueue.open(queue_url=bare.url, region=REGION, endpoint_url=bare.endpoint_url) as queue:
        consumer = make_consumer(Recorder(), queue=queue, max_receive_count=None, max_receives_without_dlq=2)
        bare.send("[]")
        outcomes = []
        for _ in range(5):
            outcomes += await consumer.run_once()
            if bare.counts(bare.url) == (0, 0):
                break
    assert [(o.result, o.event.kind) for o in outcomes] == [(Result.UNDECODABLE, Kind.INVALID)] * 2
    assert consumer.metrics.value("resilienced_dead_lettered_total") == 1


# --------------------------------------------------------------------------- graceful stop
async def test_the_loop_handles_messages_until_stopped(queues, make_consumer):
    recorder = Recorder()
    consumer = make_consumer(recorder, concurrency=3)
    for n in range(1, 8):
        queues.send(p.spot(f"i-0000000{n}"))
    loop = asyncio.create_task(consumer.run())
    await eventually(lambda: len(recorder.plans) == 7)
    await eventually(lambda: queues.counts() == (0, 0))
    consumer.stop()
    await loop
    assert consumer.metrics.value("resilienced_released_total") == 0
    assert consumer.metrics.value("resilienced_in_flight") == 0


async def test_a_queue_that_does_not_answer_makes_the_consumer_unready(aws, queues, make_consumer):
    from resilienced.aws.sqs import SqsQueue
    from resilienced.errors import BackendUnavailable
    missing = queues.url.rsplit("/", 1)[0] + "/no-such-queue"
    async with SqsQueue.open(queue_url=missing, region=REGION, endpoint_url=queues.endpoint_url) as queue:
        consumer = make_consumer(Recorder(), queue=queue)
        with pytest.raises(BackendUnavailable, match="QueueDoesNotExist|NonExistentQueue"):
            await consumer.run_once()
    assert not consumer.readiness.ready()
    assert consumer.metrics.value("resilienced_queue_errors_total", operation="receive") == 1


# --------------------------------------------------------------------------- operations metrics
async def test_event_age_last_receive_and_backend_errors_are_measured(queues, make_consumer):
    from datetime import datetime, timedelta, timezone

    from resilienced.errors import BackendUnavailable

    consumer = make_consumer(Failing(BackendUnavailable("ray-gcs", "GCS did not answer", delay=0)))
    assert consumer.metrics.value("resilienced_last_message_received_timestamp_seconds") == 0
    sent = datetime.now(timezone.utc) - timedelta(seconds=90)  # the event was emitted 90 s ago
    queues.send(p.spot(time=sent.strftime("%Y-%m-%dT%H:%M:%SZ")))
    before = datetime.now(timezone.utc).timestamp()
    [outcome] = await run_until(consumer, 1)

    assert outcome.result is Result.RETRY
    m = consumer.metrics
    assert m.value("resilienced_backend_errors_total", backend="ray-gcs") == 1
    assert m.value("resilienced_last_message_received_timestamp_seconds") >= before - 1
    # one observation: 90 s (whole seconds in the event's time) plus the trip through moto
    assert m.value("resilienced_event_age_at_receive_seconds_count") == 1
    assert 89 <= m.value("resilienced_event_age_at_receive_seconds_sum") < 120
    assert m.value("resilienced_event_age_at_receive_seconds_bucket", le="60.0") == 0
    assert m.value("resilienced_event_age_at_receive_seconds_bucket", le="120.0") == 1


async def test_the_queue_depth_is_read_from_the_queue(queues, sqs_queue):
    queues.send(p.spot())
    queues.send(p.rebalance())
    depth = await sqs_queue.depth()
    assert depth["ApproximateNumberOfMessages"] == 2
    assert depth["ApproximateNumberOfMessagesNotVisible"] == 0


# --------------------------------------------------------------------------- stale and future
async def test_stale_and_future_notices_are_deleted_unacted_and_counted_asg_by_its_own_timeout(
        queues, make_consumer):
    """Judged at 00:10 on 2024-01-01: a Spot notice whose deadline (time + 120 s) passed more than
    --stale-after-seconds (300) ago, an ASG action past its own timeout (time + 120 s, no grace)
    and a notice from 10 min ahead are deleted without acting; the fresh ones are acted on."""
    at = datetime(2024, 1, 1, 0, 10, tzinfo=UTC)
    old = p.spot("i-00000000000000001")  # deadline 00:02, 8 min before: stale
    late = p.spot("i-00000000000000002", time="2024-01-01T00:06:00Z")  # deadline 00:08: within 5 min
    asg_gone = p.asg("i-00000000000000003", time="2024-01-01T00:07:00Z")  # timeout 00:09 passed
    asg_live = p.asg("i-00000000000000004", time="2024-01-01T00:09:00Z")  # timeout 00:11
    ahead = p.spot("i-00000000000000005", time="2024-01-01T00:20:00Z")  # 10 min in the future
    for event in (old, late, asg_gone, asg_live, ahead):
        queues.send(event)
    recorder = Recorder()
    consumer = make_consumer(recorder, clock=lambda: at)
    outcomes = await run_until(consumer, 5)

    by_instance = {o.plan.instance_ids[0]: o for o in outcomes}
    assert sorted(plan.instance_ids[0] for plan in recorder.plans) == [
        "i-00000000000000002", "i-00000000000000004"]
    stale = {i: (o.result, o.details.get("stale")) for i, o in by_instance.items() if o.details.get("stale")}
    assert stale == {"i-00000000000000001": (Result.NOT_ACTIONABLE, "past"),
                     "i-00000000000000003": (Result.NOT_ACTIONABLE, "past"),
                     "i-00000000000000005": (Result.NOT_ACTIONABLE, "future")}
    assert by_instance["i-00000000000000001"].reason == (
        "stale: its deadline 2024-01-01T00:02:00Z passed 00:08:00 before 2024-01-01T00:10:00Z "
        "(allowed: 300s, --stale-after-seconds): not acted on")
    assert by_instance["i-00000000000000003"].reason == (
        "stale: the lifecycle action's timeout 2024-01-01T00:09:00Z passed 00:01:00 before "
        "2024-01-01T00:10:00Z (allowed: 0s, --asg-deadline-seconds): not acted on")
    assert "is 00:10:00 after 2024-01-01T00:10:00Z" in by_instance["i-00000000000000005"].reason
    assert consumer.metrics.value("resilienced_stale_events_total", kind="spot_interruption", when="past") == 1
    assert consumer.metrics.value("resilienced_stale_events_total", kind="asg_lifecycle", when="past") == 1
    assert consumer.metrics.value("resilienced_stale_events_total", kind="spot_interruption", when="future") == 1
    assert queues.counts() == (0, 0)  # acknowledged: none comes back
    assert queues.receive_all(queues.dlq_url) == []


async def test_stale_after_seconds_widens_the_window(queues, make_consumer):
    queues.send(p.spot("i-00000000000000001"))  # deadline 00:02, 8 min before 00:10
    recorder = Recorder()
    consumer = make_consumer(recorder, clock=lambda: datetime(2024, 1, 1, 0, 10, tzinfo=UTC),
                             intake=IntakeSettings(stale_after_seconds=600))
    [outcome] = await run_until(consumer, 1)
    assert outcome.result is Result.DONE and len(recorder.plans) == 1
