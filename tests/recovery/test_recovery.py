"""The responder end to end on the Kubernetes side: locate -> drain -> durable in S3 -> requeue.

Real parts: the emulated Kubernetes API over HTTP (with the manifests' RBAC) through
kubernetes_asyncio and resilienced's watch caches, Lease claims, S3 on moto server, the KubeRay
requeuer.  The Ray cluster of a KubeRay deployment cannot run here, so its GCS is a recording
stand-in (:class:`RecordingGcs`); the drain through a real GCS is in test_kubernetes_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from botocore.stub import Stubber
from prometheus_client import CollectorRegistry
from aiobotocore.session import get_session

from resilienced.intake import pipeline as intake
from resilienced.aws.s3 import S3Store
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.errors import BackendUnavailable, PermanentError, TemporaryError
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.leases import KubeLeaseClaims
from resilienced.kube.marks import EVENT_ANNOTATION, TAINT_KEY
from resilienced.model import Result, Target
from resilienced.ports import CapacityReservation, RayNode
from resilienced.ray.cluster import INSTANCE_ID_LABEL, RayModeCluster
from resilienced.doubles import MemoryClaims
from handlers.asg_lifecycle import LifecycleAction
from resilienced.aws.autoscaling import Lifecycle
from resilienced.recovery.responder import Recovery, RecoveryMetrics, RecoveryOptions
from resilienced.requeue.router import ReportingRequeuer, RequeueRouter
from resilienced.recovery.move import Mover
from resilienced.ray.replacement import ReplacementAnnouncer
from resilienced.settings import IntakeSettings
from tests.kube.conftest import LOCAL_BOUND_S, eventually
from tests.support.kubeapi import KubeApiServer
from tests.support.kubeoptions import FAST

from .conftest import DAEMON_NS, NS, REGION, RecordingGcs, instance, put_checkpoint, ray_nodes, seed_world

pytestmark = pytest.mark.integration

BLOCK = "cr-0123456789abcdef0"


def block(*, available: int = 2, reservation: str = BLOCK) -> CapacityReservation:
    now = datetime.now(timezone.utc)
    return CapacityReservation(reservation_id=reservation, instance_type="p5.48xlarge",
                               availability_zone="us-east-1a", reservation_type="capacity-block",
                               state="active", available_instances=available, total_instances=2,
                               start=now - timedelta(hours=1), end=now + timedelta(days=2))


def body(detail_type: str, detail: dict[str, Any], *, when: datetime, source: str = "aws.ec2",
         event_id: str = "7e9d2f6c-0000-4000-8000-000000000001") -> str:
    return json.dumps({"version": "0", "id": event_id, "detail-type": detail_type, "source": source,
                       "account": "123456789012", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
                       "region": REGION, "resources": [], "detail": detail})


def plan_of(text: str) -> Any:
    reading = intake.read(text, IntakeSettings())
    assert reading.plan.actionable, reading.plan.reason
    return reading.plan


class World:
    """The responder wired as the daemon wires it in kubernetes mode (GCS aside)."""

    def __init__(self, *, api: Any, kubeapi: KubeApiServer, s3: Any, capacity: StaticCapacity,
                 policy: CapacityPolicy, grace: float = 30.0) -> None:
        self.kubeapi = kubeapi
        self.s3 = s3
        self.gcs = RecordingGcs(ray_nodes())
        self.cluster = KubeCluster(api, ray_control_factory=lambda addr, tok: self.gcs,
                                   replica="replica-a", options=FAST)
        self.claims = KubeLeaseClaims(api, namespace=DAEMON_NS)
        self.capacity = capacity
        self.planner = CapacityPlanner(source=capacity, policy=policy)
        self.recovery = Recovery(
            cluster=self.cluster, claims=self.claims, ray_control=self.cluster.ray_control,
            store=S3Store(client=s3),
            mover=Mover(planner=self.planner, requeue=ReportingRequeuer(RequeueRouter(api), cluster=self.cluster),
                        replacements=ReplacementAnnouncer(self.cluster.ray_control, priors={})), capacity=capacity,
            options=RecoveryOptions(durable_grace_seconds=grace, durable_poll_seconds=0.1))

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kubeapi.list("events", namespace=None) if e.get("reason") == reason]


@pytest.fixture
async def world(api: Any, kubeapi: KubeApiServer, s3: Any) -> AsyncIterator[World]:
    seed_world(kubeapi, gcs_port=6379)
    w = World(api=api, kubeapi=kubeapi, s3=s3, capacity=StaticCapacity([block()]),
              policy=CapacityPolicy(interruption_threshold=1))
    await w.cluster.start()
    try:
        yield w
    finally:
        await w.cluster.stop()


async def save_after_the_drain(world: World, *, step: int, drains: int = 1) -> None:
    """Play the trainer and FSx: once the drain is seen (``drains`` of them: every worker told), a
    checkpoint lands in S3."""
    await eventually(lambda: len(world.gcs.drains) >= drains, what=f"{drains} drain(s)")
    await put_checkpoint(world.s3, step=step, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"rank0" * 100, "__1_0.distcp": b"rank1" * 90, ".metadata": b"m"})


def selectors(obj: dict[str, Any], path: str) -> list[dict[str, str]]:
    spec = obj["spec"] if path == "cluster" else obj["spec"]["rayClusterSpec"]
    return [g["template"]["spec"].get("nodeSelector", {}) for g in spec["workerGroupSpecs"]]


async def test_a_node_already_draining_is_reported_and_counted_as_such(world: World) -> None:
    """GCS answers ``already_draining`` (ports.DrainResult) for a node that drains with an earlier
    deadline: the signal step reports and counts that outcome, not ``accepted``."""
    registry = CollectorRegistry()
    world.recovery.metrics = RecoveryMetrics(registry)
    world.gcs.outcome = "already_draining"
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"},
                        when=datetime.now(timezone.utc)))
    saver = asyncio.create_task(save_after_the_drain(world, step=4))
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    await saver

    assert outcome.result is Result.DONE, outcome.reason
    assert outcome.details["runs"][0]["signal"]["drained"] == {"01" * 28: "already_draining"}
    drains = {o: registry.get_sample_value("resilienced_drains_total", {"outcome": o})
              for o in ("accepted", "already_draining")}
    assert drains == {"accepted": 0.0, "already_draining": 1.0}


async def test_a_spot_notice_drains_the_worker_waits_for_s3_then_moves_the_whole_gang(world: World) -> None:
    now = datetime.now(timezone.utc)
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"}, when=now))
    saver = asyncio.create_task(save_after_the_drain(world, step=37))
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    await saver

    assert outcome.result is Result.DONE, outcome.reason
    # the worker on n1 is drained with the notice's deadline; the head on n0 is left alone
    assert [(node_id, deadline) for node_id, deadline, _ in world.gcs.drains] == [("01" * 28, plan.deadline)]
    taints = world.kubeapi.get("nodes", "n1")["spec"]["taints"]
    assert [t["key"] for t in taints] == ["resilienced.io/interruption"] and taints[0]["effect"] == "NoSchedule"
    run = outcome.details["runs"][0]
    assert run["run"] == f"{NS}/train" and run["durable"]["step"] == 37 and run["durable"]["verified"]
    # the whole gang moves to the Capacity Block: every worker group of the RayJob and its RayCluster
    wanted = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK}
    for obj, path in ((world.kubeapi.get("rayjobs", "train", namespace=NS), "job"),
                      (world.kubeapi.get("rayclusters", "train-rc", namespace=NS), "cluster")):
        assert all(s.items() >= wanted.items() for s in selectors(obj, path)), selectors(obj, path)
    assert {p["metadata"]["name"] for p in world.kubeapi.list("pods", namespace=NS)} == {"train-head"}
    for reason in ("Draining", "CheckpointDurable", "Requeued"):
        assert world.events(reason), f"no {reason} Event"


async def test_the_same_event_again_from_another_replica_changes_nothing(world: World) -> None:
    now = datetime.now(timezone.utc)
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"}, when=now))
    saver = asyncio.create_task(save_after_the_drain(world, step=5))
    assert (await world.recovery.act(plan, holder="replica-a/m1")).result is Result.DONE
    await saver
    writes_before = {k: v for k, v in world.kubeapi.counts().items() if k[0] in ("patch", "delete", "create")}

    again = await world.recovery.act(plan, holder="replica-b/m2")

    # the gang already left n1 (its pods were deleted for KubeRay to recreate elsewhere): no run now,
    # and the event's done run claim says it was handled (a duplicate, not decided again; issue #45)
    assert again.result is Result.DUPLICATE and "already handled by replica-a/m1" in again.reason, again.reason
    assert "runs no Ray pods" in again.details["unresolved"][instance(1)]
    assert len(world.gcs.drains) == 1
    writes_after = {k: v for k, v in world.kubeapi.counts().items() if k[0] in ("patch", "delete", "create")}
    assert writes_after == writes_before  # no taint, Event, patch or pod deletion the second time


async def test_two_replicas_on_one_event_at_once_act_once(world: World) -> None:
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"},
                        when=datetime.now(timezone.utc)))
    saver = asyncio.create_task(save_after_the_drain(world, step=9))
    results = await asyncio.gather(world.recovery.act(plan, holder="replica-a/m1"),
                                   world.recovery.act(plan, holder="replica-b/m2"), return_exceptions=True)
    await saver
    done = [r for r in results if not isinstance(r, BaseException)]
    retry = [r for r in results if isinstance(r, TemporaryError)]
    assert len(done) == 1 and done[0].result is Result.DONE and len(retry) == 1, results
    assert "being handled by replica-" in str(retry[0])
    assert len(world.gcs.drains) == 1


async def test_a_run_done_for_an_event_is_skipped_when_the_event_comes_back(world: World) -> None:
    plan = plan_of(body("EC2 Instance Rebalance Recommendation", {"instance-id": instance(2)},
                        when=datetime.now(timezone.utc)))  # policy notify: an Event, nothing else
    first = await world.recovery.act(plan, holder="replica-a/m1")
    second = await world.recovery.act(plan, holder="replica-b/m7")
    assert first.details["runs"][0]["notify"] == "RebalanceRecommendation"
    assert second.details["runs"][0]["skipped"] == "already done for this event by replica-a/m1"
    # once, on the RayJob only, naming the instance and its Node (issue #45: the run is what its owner
    # watches; nothing is done to the Node for a notify-only notice, and Karpenter marks Nodes itself)
    recorded = world.events("RebalanceRecommendation")
    assert [e["involvedObject"]["kind"] for e in recorded] == ["RayJob"]
    assert recorded[0]["message"].endswith(f"[instances: {instance(2)} on Node n2]"), recorded[0]["message"]
    assert all(e.get("count", 1) == 1 for e in recorded) and world.gcs.drains == []


async def test_nothing_durable_by_the_deadline_records_the_newest_checkpoint_before_the_notice(
        world: World) -> None:
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=10)
    await put_checkpoint(world.s3, step=10, saved=long_ago - timedelta(minutes=5), files={"a": b"x" * 10})
    await put_checkpoint(world.s3, step=12, saved=long_ago, files={"a": b"y" * 10}, manifest=False)
    # a notice whose deadline has passed: the drain still goes out, nothing new can arrive
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(2), "instance-action": "terminate"}, when=long_ago))
    world.recovery.options = RecoveryOptions(durable_grace_seconds=0, durable_poll_seconds=0.1)

    outcome = await world.recovery.act(plan, holder="replica-a/m1")

    durable = outcome.details["runs"][0]["durable"]
    assert durable["verified"] is False and durable["resume_step"] == 10 and durable["steps_lost"] >= 2
    warning = world.events("CheckpointNotDurable")
    assert warning and warning[0]["type"] == "Warning" and "step 10" in warning[0]["message"]


async def test_an_instance_gone_without_notice_is_requeued_from_the_newest_durable_checkpoint(
        world: World) -> None:
    now = datetime.now(timezone.utc)
    await put_checkpoint(world.s3, step=20, saved=now - timedelta(seconds=90), files={"a": b"1" * 7})
    await put_checkpoint(world.s3, step=30, saved=now - timedelta(seconds=30), files={"a": b"2" * 7})
    plan = plan_of(body("EC2 Instance State-change Notification",
                        {"instance-id": instance(1), "state": "terminated"}, when=now))

    outcome = await world.recovery.act(plan, holder="replica-a/m1")

    assert world.gcs.drains == []  # nothing to drain: the instance is gone
    run = outcome.details["runs"][0]
    assert run["resume"]["resume_step"] == 30 and 25 <= run["resume"]["checkpoint_age_s"] <= 40
    # a state change is not counted as a Spot interruption of the pool (it may be anyone's
    # termination), so with one threshold-1 pool the run stays on Spot, where it already is
    assert run["requeue"]["capacity"] == "spot"
    assert world.events("ResumePoint")


async def test_a_capacity_block_expiry_moves_the_run_off_the_block(api: Any, kubeapi: KubeApiServer,
                                                                  s3: Any) -> None:
    seed_world(kubeapi, gcs_port=6379)
    for name, n in (("n1", 1), ("n2", 2)):  # the workers run in the expiring block
        kubeapi.patch("nodes", name, {"metadata": {"labels": {
            "karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK}}})
    capacity = StaticCapacity([block()], instances={BLOCK: [instance(1), instance(2)]})
    world = World(api=api, kubeapi=kubeapi, s3=s3, capacity=capacity,
                  policy=CapacityPolicy(interruption_threshold=1), grace=0)
    await world.cluster.start()
    try:
        end = datetime.now(timezone.utc) + timedelta(minutes=40)
        plan = plan_of(body("Capacity Block Reservation Expiration Warning",
                            {"capacity-reservation-id": BLOCK, "end-date": end.strftime("%Y-%m-%dT%H:%M:%S.000Z")},
                            when=datetime.now(timezone.utc)))
        assert plan.deadline == end.replace(microsecond=0) - timedelta(minutes=30)
        saver = asyncio.create_task(save_after_the_drain(world, step=3))
        outcome = await world.recovery.act(plan, holder="replica-a/m1")
        await saver
    finally:
        await world.cluster.stop()

    assert sorted(d[0] for d in world.gcs.drains) == ["01" * 28, "02" * 28]  # both, as one gang
    run = outcome.details["runs"][0]
    assert sorted(run["instances"]) == [instance(1), instance(2)]
    assert run["requeue"]["capacity"] in ("spot", "on-demand")
    job = kubeapi.get("rayjobs", "train", namespace=NS)
    assert all(BLOCK not in s.values() and s.get("karpenter.sh/capacity-type") != "reserved"
               for s in selectors(job, "job"))


@pytest.mark.parametrize(("nodepool", "lead"), [(True, 40), (False, 30)],
                         ids=["Karpenter's nodes: its 40 min", "nodes of no NodePool: EC2's 30 min"])
async def test_a_block_expiry_drains_by_the_time_its_nodes_are_taken(api: Any, kubeapi: KubeApiServer, s3: Any,
                                                                      nodepool: bool, lead: int) -> None:
    # Karpenter (aws/karpenter-provider-aws v1.6+, capacityReservationExpirationPeriod in
    # pkg/apis/v1/ec2nodeclass_status.go, v1.14.1) deletes the NodeClaims of a block 40 min before its
    # end and drains the nodes then; EC2 terminates at 30 min.  The drain deadline the ranks get, and
    # the taint, say when the run's own nodes go.
    seed_world(kubeapi, gcs_port=6379)
    for name in ("n1", "n2"):
        labels = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK,
                  "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
        if nodepool:
            labels["karpenter.sh/nodepool"] = "blocks"
        kubeapi.patch("nodes", name, {"metadata": {"labels": labels}})
    capacity = StaticCapacity([block(reservation="cr-0fedcba9876543210")],
                              instances={BLOCK: [instance(1), instance(2)]})
    world = World(api=api, kubeapi=kubeapi, s3=s3, capacity=capacity,
                  policy=CapacityPolicy(interruption_threshold=1), grace=0)
    await world.cluster.start()
    try:
        end = (datetime.now(timezone.utc) + timedelta(minutes=45)).replace(microsecond=0)
        plan = plan_of(body("Capacity Block Reservation Expiration Warning",
                            {"capacity-reservation-id": BLOCK, "end-date": end.strftime("%Y-%m-%dT%H:%M:%SZ")},
                            when=datetime.now(timezone.utc)))
        saver = asyncio.create_task(save_after_the_drain(world, step=3))
        await world.recovery.act(plan, holder="replica-a/m1")
        await saver
    finally:
        await world.cluster.stop()
    assert {d[1] for d in world.gcs.drains} == {end - timedelta(minutes=lead)}
    taint = next(t for t in kubeapi.get("nodes", "n1")["spec"]["taints"] if t["key"] == "resilienced.io/interruption")
    assert taint["effect"] == "NoSchedule"
    assert kubeapi.get("nodes", "n1")["metadata"]["annotations"]["resilienced.io/interruption-deadline"] == \
        (end - timedelta(minutes=lead)).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- ASG lifecycle hooks
ASG_DETAIL = {"LifecycleActionToken": "b4dd0f5b-0ef2-4479-9dad-6c55f027000e", "AutoScalingGroupName": "gpu-asg",
              "LifecycleHookName": "drain-first", "EC2InstanceId": instance(7),
              "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING"}
EXPECTED = {"LifecycleHookName": "drain-first", "AutoScalingGroupName": "gpu-asg",
            "LifecycleActionToken": "b4dd0f5b-0ef2-4479-9dad-6c55f027000e",
            "LifecycleActionResult": "CONTINUE", "InstanceId": instance(7)}


@pytest.fixture
async def autoscaling() -> AsyncIterator[Any]:
    async with get_session().create_client("autoscaling", region_name=REGION, aws_access_key_id="x",
                                           aws_secret_access_key="x") as client:
        yield client


async def test_an_asg_hook_is_completed_even_when_no_ray_run_is_on_the_instance(world: World,
                                                                              autoscaling: Any) -> None:
    plan = plan_of(body("EC2 Instance-terminate Lifecycle Action", ASG_DETAIL,
                        when=datetime.now(timezone.utc), source="aws.autoscaling"))
    world.recovery.lifecycle = Lifecycle(autoscaling)
    with Stubber(autoscaling) as stub:
        stub.add_response("complete_lifecycle_action", {}, EXPECTED)
        outcome = await world.recovery.act(plan, holder="replica-a/m1")
        stub.assert_no_pending_responses()
    assert outcome.result is Result.NOT_ACTIONABLE
    assert outcome.details["lifecycle"] == "completed (CONTINUE)"
    assert instance(7) in outcome.details["unresolved"]


@pytest.mark.parametrize(("code", "message", "expected"), [
    ("ValidationError", "No active Lifecycle Action found with instance ID i-0", "already completed or timed out"),
    ("Throttling", "Rate exceeded", BackendUnavailable),
    ("AccessDenied", "not authorized", PermanentError),
], ids=["already-completed-is-done", "throttled-is-temporary", "denied-is-permanent"])
async def test_completing_a_hook_translates_what_auto_scaling_answers(autoscaling: Any, code: str, message: str,
                                                                      expected: Any) -> None:
    lifecycle = Lifecycle(autoscaling)
    action = LifecycleAction(lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                             lifecycle_hook_name="drain-first", auto_scaling_group_name="gpu-asg",
                             lifecycle_action_token=ASG_DETAIL["LifecycleActionToken"])
    with Stubber(autoscaling) as stub:
        stub.add_client_error("complete_lifecycle_action", service_error_code=code, service_message=message,
                              http_status_code=400, expected_params=EXPECTED)
        if isinstance(expected, str):
            assert await lifecycle.complete(action, instance_id=instance(7)) == expected
        else:
            with pytest.raises(expected):
                await lifecycle.complete(action, instance_id=instance(7))


class Gate:
    """A ``Requeuer`` in front of another that lets a requeue go on once ``n`` are in it at once (or
    after ``wait_s``): two moves of one run overlap when nothing keeps them apart."""

    def __init__(self, inner: Any, *, n: int = 2, wait_s: float = 2.0) -> None:
        self.inner, self.n, self.wait_s = inner, n, wait_s
        self.entered = 0
        self.all_in = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def requeue(self, target: Any, **kwargs: Any) -> Any:
        self.entered += 1
        if self.entered >= self.n:
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), self.wait_s)
        except asyncio.TimeoutError:
            pass
        return await self.inner.requeue(target, **kwargs)


async def test_two_notices_of_one_run_at_once_move_it_once_without_the_follow_up(api: Any, world: World) -> None:
    """``--follow-up false`` (no follower): a run's two workers' notices handled at once (a Spot
    pool is reclaimed at once) make one move of the run, not two.  Seen on the real control plane
    (tests/cluster/test_mass.py): without the follow-up the requeue step took no move claim, so
    each notice of a gang moved it (two ``Requeued`` Events per run, the Workload reactivated by the
    second while the first was steering it)."""
    gate = Gate(RequeueRouter(api))
    world.recovery.mover = Mover(planner=world.planner, requeue=ReportingRequeuer(gate, cluster=world.cluster),
                                 replacements=ReplacementAnnouncer(world.cluster.ray_control, priors={}))
    now = datetime.now(timezone.utc)
    plans = [plan_of(body("EC2 Spot Instance Interruption Warning",
                          {"instance-id": instance(i), "instance-action": "terminate"}, when=now,
                          event_id=f"7e9d2f6c-0000-4000-8000-00000000010{i}")) for i in (1, 2)]
    saver = asyncio.create_task(save_after_the_drain(world, step=11))
    results = await asyncio.gather(*(world.recovery.act(p, holder=f"replica-a/m{i}") for i, p in enumerate(plans)),
                                   return_exceptions=True)
    await saver
    for plan, got in zip(plans, results):
        if isinstance(got, TemporaryError):  # the other notice was moving the run: its redelivery
            assert "being moved" in str(got), got
            got = await world.recovery.act(plan, holder="replica-a/again")
        assert not isinstance(got, BaseException) and got.result in (Result.DONE, Result.NOT_ACTIONABLE), got
    assert gate.entered >= 1
    on_the_run = [e for e in world.events("Requeued") if e["involvedObject"]["kind"] == "RayJob"]
    assert len(on_the_run) == 1, [e.get("message") for e in on_the_run]
    counts = world.kubeapi.counts()
    assert (counts[("patch", "rayjobs.ray.io")], counts[("delete", "pods")]) == (1, 2), counts  # one move


def spot_notice(i: int, *, when: datetime, event_id: str | None = None) -> Any:
    return plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(i), "instance-action": "terminate"}, when=when,
                        event_id=event_id or f"7e9d2f6c-0000-4000-8000-00000000020{i}"))


async def test_a_gangs_notices_in_one_replica_are_handled_as_one(world: World) -> None:
    """Issue #45: the two workers' notices of one run, in flight in one replica at once, are one
    handling: the first leads (its run claim, its move claim, one Event per step on the run), the
    second joins (its own Node cordoned, its Ray node drained, its instance in the move) and shares
    the outcome; it writes no claim and no Event of its own.  The consumer takes no event claim for
    either: the leader's run claim stands for its event claim, and the joiner has none."""
    now = datetime.now(timezone.utc)
    first, second = spot_notice(1, when=now), spot_notice(2, when=now)
    assert not await world.recovery.needs_event_claim(first)  # nothing under way: it leads, under its run claim
    # the trainer saves once both workers were told
    saver = asyncio.create_task(save_after_the_drain(world, step=13, drains=2))
    leading = asyncio.create_task(world.recovery.act(first, holder="replica-a/m1"))
    await eventually(lambda: world.recovery.waves.current(f"{NS}/train") is not None, what="the leader's wave")
    assert not await world.recovery.needs_event_claim(second)  # its run is under way here: it joins
    joining = await world.recovery.act(second, holder="replica-a/m2")
    led = await leading
    await saver
    assert led.result is Result.DONE and joining.result is Result.DONE, (led.reason, joining.reason)
    assert joining.details["runs"][0]["joined"] == first.event.event_id
    assert sorted(d[0] for d in world.gcs.drains) == ["01" * 28, "02" * 28]
    assert all(any(t["key"] == "resilienced.io/interruption" for t in world.kubeapi.get("nodes", n)["spec"]["taints"])
               for n in ("n1", "n2"))
    assert led.details["runs"][0]["instances"] == [instance(1), instance(2)]  # the move took both
    keys = sorted(l["metadata"]["annotations"]["resilienced.io/claim-key"]
                  for l in world.kubeapi.list("leases", namespace=DAEMON_NS))
    assert keys == [f"run/{first.event.event_id}/{NS}/train"], keys  # the move claim was released
    for reason in ("Draining", "CheckpointDurable", "Requeued"):
        on_job = [e for e in world.events(reason) if e["involvedObject"]["kind"] == "RayJob"]
        assert len(on_job) == 1, (reason, on_job)
    counts = world.kubeapi.counts()
    assert counts[("patch", "rayjobs.ray.io")] == 1 and counts[("patch", "nodes")] == 2, counts


async def test_a_gangs_notices_asked_at_once_reserve_one_handling_and_one_event_claim(world: World) -> None:
    """Issue #45: a gang's notices come in one receive and are dispatched at once, so each is asked
    whether it needs an event claim before any acts.  The first answered reserves the run's handling
    and needs its claim; the other joins it and needs none (before the reservation both found no
    handling yet and both took an event claim: 6 for 3 runs' 6 notices, tests/cluster/test_mass.py).
    Since the run claim stands for a one-run notice's event claim, neither needs one: the first
    answered reserves the handling and leads it under its run claim."""
    now = datetime.now(timezone.utc)
    plans = [spot_notice(1, when=now), spot_notice(2, when=now)]
    needs = await asyncio.gather(*(world.recovery.needs_event_claim(p) for p in plans))
    assert needs == [False, False], needs
    wave = world.recovery.waves.current(f"{NS}/train")
    assert wave is not None and not wave.led
    leader, joiner = (plans[0], plans[1]) if wave.event_id == plans[0].event.event_id else (plans[1], plans[0])
    saver = asyncio.create_task(save_after_the_drain(world, step=13, drains=2))
    led, joined = await asyncio.gather(world.recovery.act(leader, holder="replica-a/m1"),
                                       world.recovery.act(joiner, holder="replica-a/m2"))
    await saver
    assert led.result is Result.DONE and joined.result is Result.DONE, (led.reason, joined.reason)
    assert joined.details["runs"][0]["joined"] == leader.event.event_id
    assert sorted(led.details["runs"][0]["instances"]) == [instance(1), instance(2)]  # one move, both
    assert len(world.recovery.waves) == 0
    assert world.kubeapi.counts()[("patch", "rayjobs.ray.io")] == 1


async def test_a_reserved_handling_whose_notice_does_not_lead_it_sends_its_joiners_back(world: World) -> None:
    """The reserving notice did not lead the run's handling (a claimed one: its event claim was
    another delivery's; or its act found the run gone): the handling it reserved is dropped when it
    is settled, and the notice that joined it is retried, to lead it then."""
    now = datetime.now(timezone.utc)
    first, second = spot_notice(1, when=now), spot_notice(2, when=now)
    assert not await world.recovery.needs_event_claim(first)
    assert not await world.recovery.needs_event_claim(second)
    joining = asyncio.create_task(world.recovery.act(second, holder="replica-a/m2"))
    # it drained its own Ray node and waits for the leader
    await eventually(lambda: bool(world.gcs.drains), what="the joiner's drain")
    world.recovery.settled(first)
    with pytest.raises(TemporaryError, match="did not lead the handling") as err:
        await joining
    assert err.value.delay == 1.0 and world.recovery.waves.current(f"{NS}/train") is None
    assert not await world.recovery.needs_event_claim(second)  # retried: nothing under way, it leads
    assert world.recovery.waves.reserved_for(f"{NS}/train", second.event.event_id)
    world.recovery.settled(second)
    assert world.kubeapi.list("leases", namespace=DAEMON_NS) == []  # no claim was taken


async def test_a_joining_notice_is_located_once_for_the_claim_question_and_its_act(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """``needs_event_claim`` locates the plan's runs (ray mode: a GCS node list, EC2 for unlabelled
    instances); a notice that joins its run's handling is acted on at once, and its act takes what
    was found instead of locating again (a claimed one locates again after its claim, which may
    take a while)."""
    now = datetime.now(timezone.utc)
    first, second = spot_notice(1, when=now), spot_notice(2, when=now)
    assert not await world.recovery.needs_event_claim(first)  # it reserves the run's handling
    located: list[list[str]] = []
    real = world.cluster.locate

    async def counting(**kwargs: Any) -> Any:  # the real locate, counted
        located.append(list(kwargs["instance_ids"]))
        return await real(**kwargs)

    monkeypatch.setattr(world.cluster, "locate", counting)
    assert not await world.recovery.needs_event_claim(second)
    joining = asyncio.create_task(world.recovery.act(second, holder="replica-a/m2"))
    await eventually(lambda: bool(world.gcs.drains), what="the joiner's drain")
    assert located == [[instance(2)]]
    world.recovery.settled(first)  # the reserving notice did not lead: the joiner is retried
    with pytest.raises(TemporaryError, match="did not lead the handling"):
        await joining
    assert located == [[instance(2)]]


async def _pod_gone(world: World, name: str = "train-w2") -> None:
    """The run's pod on the Node deleted (Kueue suspended the job, KubeRay deleted the pods)."""
    world.kubeapi.delete("pods", name, namespace=NS)
    await eventually(lambda: world.cluster.caches.pods.get(NS, name) is None, what="the pod gone from the cache")


async def test_a_notice_that_finds_its_run_gone_is_decided_by_its_nodes_cordon_without_an_event_claim(
        world: World) -> None:
    """Issue #45: a notice handled after its run's requeue finds no Ray pod on its Node; its Spot
    Node is cordoned all the same, and that cordon (conditional on the Node's resourceVersion,
    naming the event) is its decision: no event claim is asked for, no Lease written.  The Node's
    one patch is the only write."""
    await _pod_gone(world)
    plan = spot_notice(2, when=datetime.now(timezone.utc))
    world.kubeapi.reset_log()
    assert not await world.recovery.needs_event_claim(plan)
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    assert outcome.result is Result.NOT_ACTIONABLE, outcome.reason
    assert outcome.details["cordoned"] == [instance(2)] and outcome.details["decided_by"] == "cordon: cordoned"
    stored = world.kubeapi.get("nodes", "n2")
    assert [t["key"] for t in stored["spec"].get("taints") or []] == [TAINT_KEY]
    assert stored["metadata"]["annotations"][EVENT_ANNOTATION] == plan.event.event_id
    writes = [(r.verb, r.resource) for r in world.kubeapi.requests if r.verb not in ("get", "list", "watch")]
    assert writes == [("patch", "nodes")]
    assert world.gcs.drains == [] and world.kubeapi.list("leases", namespace=DAEMON_NS) == []


async def test_two_deliveries_of_a_run_less_notice_are_decided_once_by_the_cordon(world: World) -> None:
    """EventBridge delivers at least once: two copies of the notice (two messages, one event id) in
    flight at once both find the Node cordon-free in the cache; the resourceVersion guard lets one
    cordon it, the other is a duplicate (deleted, not decided again).  A copy that comes later sees
    the event's cordon in the cache and is a duplicate without a write."""
    await _pod_gone(world)
    when = datetime.now(timezone.utc)
    one, two = spot_notice(2, when=when), spot_notice(2, when=when)
    assert one is not two and one.event.event_id == two.event.event_id
    assert not await world.recovery.needs_event_claim(one)
    assert not await world.recovery.needs_event_claim(two)
    outcomes = await asyncio.gather(world.recovery.act(one, holder="replica-a/m1"),
                                    world.recovery.act(two, holder="replica-b/m2"))
    assert sorted(o.result.value for o in outcomes) == ["duplicate", "not_actionable"], [o.reason for o in outcomes]
    await world.cluster.caches.nodes.wait_until(
        lambda c: EVENT_ANNOTATION in ((c.get(None, "n2") or {}).get("metadata", {}).get("annotations") or {}),
        timeout=LOCAL_BOUND_S)
    world.kubeapi.reset_log()
    late = spot_notice(2, when=when)
    assert not await world.recovery.needs_event_claim(late)
    outcome = await world.recovery.act(late, holder="replica-a/m3")
    assert outcome.result is Result.DUPLICATE and "carries the cordon that decided it" in outcome.reason
    assert [r for r in world.kubeapi.requests if r.verb not in ("list", "watch")] == []
    assert world.kubeapi.list("leases", namespace=DAEMON_NS) == []


async def test_a_run_less_notice_on_a_node_cordoned_for_another_notice_is_claimed_as_before(world: World) -> None:
    """Where resilienced's cordon is on the Node already (another notice's: a rebalance
    recommendation, the run's own handling), the cordon decides nothing new: the notice asks for
    its event claim and is decided under it (``not_actionable``, the Node left as it is)."""
    await _pod_gone(world)
    now = datetime.now(timezone.utc)
    target = Target(instance_id=instance(2), node="n2", ray_cluster=None, ray_job=None, ray_node_ids=(),
                    checkpoint_uri=None)
    await world.cluster.cordon(target, reason="rebalance_recommendation", deadline=None)
    await world.cluster.caches.nodes.wait_until(
        lambda c: bool((c.get(None, "n2") or {}).get("spec", {}).get("taints")), timeout=LOCAL_BOUND_S)
    plan = spot_notice(2, when=now)
    assert await world.recovery.needs_event_claim(plan)
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    assert outcome.result is Result.NOT_ACTIONABLE, outcome.reason
    assert "decided_by" not in outcome.details
    stored = world.kubeapi.get("nodes", "n2")
    assert [t["value"] for t in stored["spec"]["taints"]] == ["rebalance_recommendation"]
    assert EVENT_ANNOTATION not in (stored["metadata"].get("annotations") or {})


async def test_a_cordon_claim_that_loses_its_node_meanwhile_sends_the_notice_back_to_be_claimed(
        world: World) -> None:
    """Between the question (the cache showed the Node cordon-free) and the cordon, another notice
    cordoned it: this one is retried at once and, on its next delivery, claimed as before."""
    await _pod_gone(world)
    plan = spot_notice(2, when=datetime.now(timezone.utc))
    assert not await world.recovery.needs_event_claim(plan)
    world.kubeapi.patch("nodes", "n2", body={"spec": {"taints": [
        {"key": TAINT_KEY, "value": "rebalance_recommendation", "effect": "NoSchedule"}]}})
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    assert outcome.result is Result.RETRY and outcome.retry_delay == 0, outcome.reason
    assert "decided under its event claim" in outcome.reason
    await world.cluster.caches.nodes.wait_until(
        lambda c: bool((c.get(None, "n2") or {}).get("spec", {}).get("taints")), timeout=LOCAL_BOUND_S)
    assert await world.recovery.needs_event_claim(spot_notice(2, when=datetime.now(timezone.utc)))


async def test_a_one_run_notice_needs_no_event_claim_its_run_claim_decides_its_copies(world: World) -> None:
    """Issue #45: a notice that hits one run takes no event claim; the run claim
    (``run/<event id>/<run>``, taken before any step) stands for it.  A copy of the event (a second
    message) in flight at the same time finds the run held by the first delivery and is a
    duplicate, as under the event claim; a copy after the first finished (its run moved away, its
    Node cordoned: it is claimed) finds the event's done run claim and is a duplicate too.  The run was drained and moved once; the only claim Leases
    are the run claim (done, with the run's record) and none for the event."""
    now = datetime.now(timezone.utc)
    one, two = spot_notice(1, when=now), spot_notice(1, when=now)
    assert not await world.recovery.needs_event_claim(one)
    assert not await world.recovery.needs_event_claim(two)
    saver = asyncio.create_task(save_after_the_drain(world, step=21))
    outcomes = await asyncio.gather(world.recovery.act(one, holder="replica-a/m1"),
                                    world.recovery.act(two, holder="replica-b/m2"))
    await saver
    assert sorted(o.result.value for o in outcomes) == ["done", "duplicate"], [o.reason for o in outcomes]
    (copy,) = [o for o in outcomes if o.result is Result.DUPLICATE]
    assert "is being handled by replica-" in copy.reason
    late = spot_notice(1, when=now)
    # the move suspended the run (its pods gone) and its Node is cordoned: the copy is claimed, and
    # the done run claim of its event says it was handled
    assert await world.recovery.needs_event_claim(late)
    outcome = await world.recovery.act(late, holder="replica-b/m3")
    assert outcome.result is Result.DUPLICATE and "already handled by replica-" in outcome.reason, outcome.reason
    assert len(world.gcs.drains) == 1 and world.kubeapi.counts()[("patch", "rayjobs.ray.io")] == 1
    keys = sorted(l["metadata"]["annotations"]["resilienced.io/claim-key"]
                  for l in world.kubeapi.list("leases", namespace=DAEMON_NS))
    assert keys == [f"run/{one.event.event_id}/{NS}/train"], keys


async def test_a_one_run_notice_redelivered_while_its_first_delivery_holds_the_run_is_retried(world: World) -> None:
    """The message's visibility ran out while its first delivery still works (a slow save): the
    second delivery of the same message finds the run held under that message's own id and is kept
    (a retry after the claim's TTL), never deleted: if the first delivery dies, the event is not
    lost."""
    plan = spot_notice(1, when=datetime.now(timezone.utc))
    key = f"run/{plan.event.event_id}/{NS}/train"
    assert await world.claims.acquire(key, holder="replica-a/m1", ttl_seconds=60) is not None
    assert not await world.recovery.needs_event_claim(plan)
    outcome = await world.recovery.act(plan, holder="replica-b/m1")
    assert outcome.result is Result.RETRY and outcome.retry_delay == world.recovery.options.claim_ttl_seconds
    assert "an earlier delivery of this message (replica-a/m1)" in outcome.reason
    assert world.gcs.drains == []


async def test_a_bug_while_locating_for_the_claim_question_sends_the_plan_the_claimed_way(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """``needs_event_claim`` never raises: whatever locating raises (a bug too, not only a backend's
    failure), the plan goes the claimed way, and its act (under the event claim, where the consumer
    turns any exception into a logged retry) meets the error again."""
    plan = spot_notice(1, when=datetime.now(timezone.utc))

    async def broken(**kwargs: Any) -> Any:
        raise KeyError("metadata")  # what a bug in locating looks like

    monkeypatch.setattr(world.cluster, "locate", broken)
    assert await world.recovery.needs_event_claim(plan)
    with pytest.raises(KeyError):
        await world.recovery.act(plan, holder="replica-a/m1")
    assert world.recovery.waves.current(f"{NS}/train") is None and world.gcs.drains == []


async def test_in_ray_mode_an_instance_without_a_run_is_not_reported_cordoned() -> None:
    """Ray mode has no Node to cordon (``RayModeCluster.cordon`` does nothing): an instance that
    runs no Ray node of a run is reported unresolved, never ``cordoned``."""
    labelled = RayNode(node_id="01" * 28, address="10.0.0.5", alive=True,
                       labels={INSTANCE_ID_LABEL: instance(1)})
    gcs = RecordingGcs([labelled])
    cluster = RayModeCluster(ray=gcs, checkpoint_uri=None)

    async def control(target: Target) -> RecordingGcs:
        return gcs

    recovery = Recovery(cluster=cluster, claims=MemoryClaims(), ray_control=control)
    plan = plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(2), "instance-action": "terminate"},
                        when=datetime.now(timezone.utc)))
    outcome = await recovery.act(plan, holder="replica-a/m1")
    assert instance(2) in outcome.details["unresolved"], outcome.details
    assert "cordoned" not in outcome.details, outcome.details
    assert gcs.drains == []


async def test_an_instance_without_a_node_is_not_reported_cordoned(world: World) -> None:
    """An instance the cluster has no Node for has nothing to cordon: it is reported unresolved,
    never ``cordoned`` (``Cluster.cordon`` says whether a Node carries the cordon)."""
    outcome = await world.recovery.act(spot_notice(9, when=datetime.now(timezone.utc)), holder="replica-a/m1")
    assert instance(9) in outcome.details["unresolved"], outcome.details
    assert "cordoned" not in outcome.details, outcome.details
    assert world.gcs.drains == []
