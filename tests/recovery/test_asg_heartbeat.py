"""ASG terminate hooks wait for the save: RecordLifecycleActionHeartbeat while the recovery works,
CompleteLifecycleAction after.

Auto Scaling is a stand-in over HTTP (moto 5.2.5 implements neither call): a fault proxy answers
both in the query protocol's XML, as Auto Scaling does, and records each request with its
parameters and time; once the action is completed it answers a heartbeat or a second completion
with the ``ValidationError`` "No active Lifecycle Action found ..." Auto Scaling gives.  The
client is the daemon's own (aiobotocore) through ``resilienced.aws.autoscaling.Lifecycle``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qs

import pytest
from aiobotocore.session import get_session
from aiohttp import web

from handlers.asg_lifecycle import LifecycleAction
from resilienced.aws.autoscaling import Lifecycle
from resilienced.model import Result
from resilienced.recovery.heartbeat import hook_kept_alive
from tests.support.faultproxy import FaultProxy, aws_action

from .conftest import REGION, instance, put_checkpoint
from .test_recovery import World, body, plan_of, world  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

TOKEN = "b4dd0f5b-0ef2-4479-9dad-6c55f027000e"
XMLNS = "http://autoscaling.amazonaws.com/doc/2011-01-01/"


class AutoScaling:
    """The two lifecycle calls, answered from a pending action; every request recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], float]] = []
        self.completed = False

    def respond(self, request: web.Request, raw: bytes) -> tuple[int, str]:
        params = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
        action = params.pop("Action")
        params.pop("Version", None)
        self.calls.append((action, params, time.monotonic()))
        if self.completed:
            return 400, (f'<ErrorResponse xmlns="{XMLNS}"><Error><Type>Sender</Type><Code>ValidationError</Code>'
                         f"<Message>No active Lifecycle Action found with instance ID {params.get('InstanceId')}"
                         "</Message></Error><RequestId>0</RequestId></ErrorResponse>")
        self.completed = action == "CompleteLifecycleAction"
        return 200, (f'<{action}Response xmlns="{XMLNS}"><{action}Result/><ResponseMetadata><RequestId>0'
                     f"</RequestId></ResponseMetadata></{action}Response>")

    def of(self, action: str) -> list[tuple[dict[str, str], float]]:
        return [(params, at) for name, params, at in self.calls if name == action]


@pytest.fixture
async def asg() -> AsyncIterator[tuple[AutoScaling, FaultProxy, Any]]:
    stand_in = AutoScaling()
    proxy = await FaultProxy("http://127.0.0.1:9").start()  # nothing behind it: every call is answered here
    proxy.handle(stand_in.respond, match=aws_action("RecordLifecycleActionHeartbeat", "CompleteLifecycleAction"))
    try:
        async with get_session().create_client("autoscaling", region_name=REGION, endpoint_url=proxy.url,
                                               aws_access_key_id="x", aws_secret_access_key="x") as client:
            yield stand_in, proxy, client
    finally:
        await proxy.stop()


def _detail(instance_id: str) -> dict[str, str]:
    return {"LifecycleActionToken": TOKEN, "AutoScalingGroupName": "gpu-asg", "LifecycleHookName": "drain-first",
            "EC2InstanceId": instance_id, "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING"}


def _plan(instance_id: str) -> Any:
    return plan_of(body("EC2 Instance-terminate Lifecycle Action", _detail(instance_id),
                        when=datetime.now(timezone.utc), source="aws.autoscaling"))


EXPECTED = {"LifecycleHookName": "drain-first", "AutoScalingGroupName": "gpu-asg",
            "LifecycleActionToken": TOKEN}


# --------------------------------------------------------------------------- the heartbeats alone
async def test_heartbeats_go_at_once_then_every_interval_while_the_work_runs_and_stop_after(asg: Any) -> None:
    stand_in, _, client = asg
    lifecycle = Lifecycle(client, heartbeat_seconds=0.2)
    started = time.monotonic()
    async with hook_kept_alive(lifecycle, _plan(instance(7))) as beats:
        await asyncio.sleep(1.5)
    sent = stand_in.of("RecordLifecycleActionHeartbeat")
    await asyncio.sleep(0.5)
    assert len(stand_in.of("RecordLifecycleActionHeartbeat")) == len(sent)  # none after the block
    assert len(sent) >= 3 and beats == ["recorded"] * len(sent)
    times = [at for _, at in sent]
    assert times[0] - started < 1.0  # the first at once
    assert all(b - a >= 0.2 for a, b in zip(times, times[1:]))  # then one per interval, not more
    for params, _ in sent:
        assert params == {**EXPECTED, "InstanceId": instance(7)}


async def test_a_failed_heartbeat_is_retried_and_a_finished_action_ends_them(asg: Any) -> None:
    stand_in, proxy, client = asg
    proxy.fail(403, code="AccessDenied", match=aws_action("RecordLifecycleActionHeartbeat"), times=1)
    lifecycle = Lifecycle(client, heartbeat_seconds=0.1)
    async with hook_kept_alive(lifecycle, _plan(instance(7))) as beats:
        while "recorded" not in beats:
            await asyncio.sleep(0.05)
        stand_in.completed = True  # completed elsewhere (another replica) or timed out
        await asyncio.sleep(0.6)
    assert beats[0].startswith("failed: autoscaling: RecordLifecycleActionHeartbeat: AccessDenied")
    assert beats[-1] == "no longer pending" and beats.count("no longer pending") == 1
    assert "recorded" in beats


async def test_a_plan_without_a_hook_sends_no_heartbeat(asg: Any) -> None:
    stand_in, _, client = asg
    spot = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"}, when=datetime.now(timezone.utc)))
    async with hook_kept_alive(Lifecycle(client, heartbeat_seconds=0.05), spot) as beats:
        await asyncio.sleep(0.2)
    async with hook_kept_alive(None, _plan(instance(7))):
        await asyncio.sleep(0.1)
    assert beats == [] and stand_in.calls == []


# --------------------------------------------------------------------------- through the recovery
async def test_the_hook_is_kept_alive_through_a_slow_save_then_completed(world: World, asg: Any) -> None:  # noqa: F811
    """A run on the instance: the save lands 1.2 s after the drain, longer than a few heartbeat
    intervals: heartbeats all along the drain and the durable wait, CompleteLifecycleAction after the
    checkpoint was durable, no heartbeat after it."""
    stand_in, _, client = asg
    world.recovery.lifecycle = Lifecycle(client, heartbeat_seconds=0.2)
    durable_at: list[float] = []

    async def slow_save() -> None:
        while not world.gcs.drains:
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.2)
        await put_checkpoint(world.s3, step=5, saved=datetime.now(timezone.utc),
                             files={"__0_0.distcp": b"rank0" * 100, "__1_0.distcp": b"rank1" * 90, ".metadata": b"m"})
        durable_at.append(time.monotonic())

    saver = asyncio.create_task(slow_save())
    outcome = await world.recovery.act(_plan(instance(1)), holder="replica-a/m1")
    await saver
    await asyncio.sleep(0.5)

    assert outcome.result is Result.DONE, outcome.reason
    assert outcome.details["lifecycle"] == "completed (CONTINUE)"
    assert outcome.details["runs"][0]["durable"]["verified"] is True
    beats = [at for _, at in stand_in.of("RecordLifecycleActionHeartbeat")]
    [(completed, completed_at)] = stand_in.of("CompleteLifecycleAction")
    assert completed == {**EXPECTED, "InstanceId": instance(1), "LifecycleActionResult": "CONTINUE"}
    assert len([b for b in beats if b < durable_at[0]]) >= 4  # kept alive while the save was under way
    assert all(b < completed_at for b in beats)  # none after the completion
    assert outcome.details["lifecycle_heartbeats"] == len(beats)
