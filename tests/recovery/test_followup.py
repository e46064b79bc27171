"""The follow-up after a requeue, on the emulated Kubernetes API with the controllers' stand-ins.

Real parts: the emulated API server over HTTP with the manifests' RBAC (so the follow-up's reads
are granted), the daemon's watch caches, Lease claims and the Lease follow-up store, the KubeRay
and Kueue requeuers, S3 on moto (the trainer's resume records).  The controllers are the
stand-ins of tests/requeue: ``KubeRaySim.scale_workers`` (KubeRay recreates the gang's pods from
the new template), ``SchedulerSim`` (kube-scheduler binds them or marks them Unschedulable),
``KueueSim`` (Kueue admits, or leaves the Workload pending when a flavor's quota is short).
Time: the follower's and the claims' clock is the test's, moved past a bound instead of sleeping.

Each stall ends in a fallback or ``stuck``, never in a false success: a Workload pending for
quota, pods unschedulable, a NodeClaim that fails to launch, a Ray Train attempt that never
starts; and a replica killed mid-follow-up leaves a run that is moved once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

from resilienced.app import cli
from resilienced.intake import pipeline as intake
from resilienced.aws.s3 import S3Store
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.errors import TemporaryError
from resilienced.followup.rules import Bounds
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.followup_store import KubeFollowUps
from resilienced.kube.leases import KubeLeaseClaims, lease_name
from resilienced.model import Result
from resilienced.ray.replacement import ReplacementAnnouncer
from resilienced.followup.follower import Follower, FollowUpMetrics, FollowUpOptions
from resilienced.recovery.move import Mover
from resilienced.recovery.responder import EVENT_MARK, Recovery, RecoveryOptions
from resilienced.requeue.kueue import KueueRequeuer
from resilienced.kube.progress import KubeProgress
from resilienced.requeue.router import ReportingRequeuer, RequeueRouter
from resilienced.settings import IntakeSettings
from tests.requeue.kuberay_sim import KubeRaySim
from tests.requeue.kueue_sim import DEFAULT_FLAVOR, FLAVORS, KueueSim, workload_for
from tests.requeue.scheduler_sim import SchedulerSim
from tests.support.kubeapi import KubeApiServer, ResourceType
from tests.kube.conftest import NODECLAIMS
from trainer import resume

from .conftest import BUCKET, DAEMON_NS, NS, RecordingGcs, instance, node, ray_nodes, seed_world
from .test_recovery import BLOCK, FAST, block

pytestmark = pytest.mark.integration

BOUND = timedelta(seconds=60)
EVENT = "7e9d2f6c-0000-4000-8000-00000000f001"
#: The holder of the move claim of replica a's delivery m1 of EVENT leading the run's handling.
LEADING = f"replica-a/m1{EVENT_MARK}{EVENT}"
LONG_AGO = timedelta(hours=1)


def state_change(when: datetime, n: int = 1, *, event_id: str = "7e9d2f6c-0000-4000-8000-00000000f001") -> Any:
    text = json.dumps({"version": "0", "id": event_id, "detail-type": "EC2 Instance State-change Notification",
                       "source": "aws.ec2", "account": "123456789012",
                       "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "region": "us-east-1", "resources": [],
                       "detail": {"instance-id": instance(n), "state": "terminated"}})
    reading = intake.read(text, IntakeSettings())
    assert reading.plan.actionable, reading.plan.reason
    return reading.plan


class Follow:
    """A daemon replica as kubernetes mode wires it, with the follow-up on a clock the test moves."""

    def __init__(self, *, api: Any, kubeapi: KubeApiServer, s3: Any, clock: list[datetime], replica: str = "a",
                 policy: CapacityPolicy | None = None, max_fallbacks: int = 2) -> None:
        self.kubeapi, self.s3, self.clock = kubeapi, s3, clock
        now: Callable[[], datetime] = lambda: clock[0]
        self.gcs = RecordingGcs(ray_nodes())
        self.cluster = KubeCluster(api, ray_control_factory=lambda addr, tok: self.gcs,
                                   replica=f"replica-{replica}", options=FAST)
        self.claims = KubeLeaseClaims(api, namespace=DAEMON_NS, clock=now)
        self.planner = CapacityPlanner(source=StaticCapacity([block()]), clock=now,
                                       policy=policy or CapacityPolicy(prefer_blocks=True))
        self.kueue = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10)
        self.requeue = ReportingRequeuer(RequeueRouter(api, kueue=self.kueue), cluster=self.cluster)
        self.registry = CollectorRegistry()
        follow_ups = KubeFollowUps(api, namespace=DAEMON_NS)
        self.mover = Mover(planner=self.planner, requeue=self.requeue, claims=self.claims, follow_ups=follow_ups,
                           replacements=ReplacementAnnouncer(self.cluster.ray_control, priors={}),
                           claim_ttl_s=30, clock=now)
        self.follower = Follower(
            store=follow_ups, cluster=self.cluster,
            progress=KubeProgress(api, kueue=self.kueue, caches=self.cluster.caches), mover=self.mover,
            objects=S3Store(client=s3), metrics=FollowUpMetrics(self.registry), replica=f"replica-{replica}",
            options=FollowUpOptions(bounds=Bounds(admitted=BOUND, scheduled=BOUND, training=BOUND),
                                    max_fallbacks=max_fallbacks, interval_s=0.05, claim_ttl_s=30),
            clock=now)
        self.recovery = Recovery(cluster=self.cluster, claims=self.claims, ray_control=self.cluster.ray_control,
                                 store=S3Store(client=s3), mover=self.mover,
                                 options=RecoveryOptions(durable_poll_seconds=0.1), follower=self.follower,
                                 clock=now)

    def later(self, delta: timedelta) -> None:
        self.clock[0] += delta

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kubeapi.list("events", namespace=None)
                if e.get("reason") == reason and (e.get("involvedObject") or {}).get("kind") == "RayJob"]

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    async def caught_up(self, timeout: float = 10.0) -> None:
        """Wait (bounded) until the daemon's caches hold what the emulated API server holds: the test's
        stand-ins write to it directly, and the follow-up's looks read the caches, which follow their
        watches a moment later (as on a real cluster, where the next pass sees it)."""
        caches = self.cluster.caches
        informers = [caches.nodes, caches.pods, caches.rayclusters, caches.rayjobs, *(caches.optional or {}).values()]

        def held(informer: Any) -> dict[tuple[str, str], str]:
            return {(o["metadata"].get("namespace") or "", o["metadata"]["name"]): o["metadata"]["resourceVersion"]
                    for o in informer.values()}

        def served(informer: Any) -> dict[tuple[str, str], str]:
            source = informer.source
            objects = self.kubeapi.list(source.resource.split(".")[0], namespace=None,
                                        label_selector=source.label_selector)
            if source.field_selector:  # the ICE Events' cache: Karpenter's Events on NodeClaims
                objects = [o for o in objects if (o.get("involvedObject") or {}).get("kind") == "NodeClaim"
                           and o.get("reason") == "InsufficientCapacityError"]
            return {(o["metadata"].get("namespace") or "", o["metadata"]["name"]): o["metadata"]["resourceVersion"]
                    for o in objects}

        await eventually(lambda: all(held(i) == served(i) for i in informers), timeout=timeout)

    async def pass_once(self) -> list[Any]:
        """The follower's pass, once the caches it reads hold what the stand-ins wrote."""
        await self.caught_up()
        return await self.follower.pass_once()

    async def record(self) -> dict[str, Any]:
        found = await self.follower.store.get(f"{NS}/train")
        assert found is not None, "no follow-up record"
        return found[0]


@pytest.fixture
async def world(api: Any, kubeapi: KubeApiServer, s3: Any) -> AsyncIterator[Follow]:
    seed_world(kubeapi, gcs_port=6379)
    w = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)])
    await w.cluster.start()
    try:
        yield w
    finally:
        await w.cluster.stop()


async def resume_record(s3: Any, *, at: datetime, step: int | None, world_size: int = 2,
                        min_world_size: int | None = None) -> None:
    """What the trainer writes when an attempt trains its first step (trainer.resume), as FSx exports it."""
    record = resume.ResumeRecord(attempt_id=resume.new_attempt_id(), resumed_from_step=step,
                                 first_step=(step or 0) + 1, world_size=world_size,
                                 min_world_size=min_world_size or world_size, started_at_unix=at.timestamp())
    await s3.put_object(Bucket=BUCKET, Key=f"runs/train/{resume.FOLDER}/{record.name}",
                        Body=json.dumps(record.as_json()).encode())


def selectors(kubeapi: KubeApiServer) -> list[str]:
    groups = kubeapi.get("rayclusters", "train-rc", namespace=NS)["spec"]["workerGroupSpecs"]
    return [g["template"]["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] for g in groups]


def worker_pods_deleted(kubeapi: KubeApiServer) -> int:
    return sum(1 for r in kubeapi.requests if r.verb == "delete" and r.resource == "pods")


async def requeued_onto_the_block(world: Follow, *, when: datetime) -> tuple[KubeRaySim, SchedulerSim]:
    """The instance of worker 1 is gone: the gang goes to the block (prefer_blocks), KubeRay
    recreates its workers there, and no Node of the block exists: they stay Unschedulable."""
    outcome = await world.recovery.act(state_change(when), holder="replica-a/m1")
    assert outcome.result is Result.DONE, outcome.reason
    run = outcome.details["runs"][0]
    assert run["requeue"]["capacity"] == "capacity-block" and run["follow_up"]["stage"] == "scheduled"
    world.kubeapi.delete("nodes", "n1")  # EC2 terminated it; its Node goes
    kuberay, scheduler = KubeRaySim(world.kubeapi, namespace=NS), SchedulerSim(world.kubeapi, namespace=NS)
    kuberay.scale_workers("train-rc")
    scheduler.step()
    return kuberay, scheduler


# --------------------------------------------------------------------------- stalls
async def test_unschedulable_pods_fall_back_to_the_next_capacity_and_the_run_trains_again(world: Follow) -> None:
    notice = world.clock[0]
    kuberay, scheduler = await requeued_onto_the_block(world, when=notice)

    (record,) = await world.pass_once()  # within the bound: it waits, says why
    assert record.state == "following" and record.stage == "scheduled"
    assert "Unschedulable" in (record.evidence or "") and "node affinity/selector" in record.evidence

    world.later(BOUND + timedelta(seconds=1))
    (record,) = await world.pass_once()
    assert record.state == "following" and record.capacity == "spot" and record.stage == "scheduled"
    assert [(f["from"], f["to"], f["stage"]) for f in record.fallbacks] == [(f"capacity-block {BLOCK}", "spot", "scheduled")]
    assert "Unschedulable" in record.fallbacks[0]["reason"]
    assert BLOCK in record.unusable  # not tried again for this run within the cool-down
    assert selectors(world.kubeapi) == ["spot"]  # the gang was moved: KubeRay recreates it on Spot
    assert world.events("RecoveryStalled") and world.metric(
        "resilienced_recovery_fallbacks_total", {"from": "capacity-block", "to": "spot", "reason": "scheduled"}) == 1

    world.kubeapi.create(node("n3", instance(3)))  # Karpenter launches a Spot node for the second worker
    kuberay.scale_workers("train-rc")
    scheduler.step()
    (record,) = await world.pass_once()
    assert record.stage == "training" and record.state == "following"  # scheduled is not the end

    await resume_record(world.s3, at=notice - timedelta(seconds=30), step=3)  # the attempt before: not it
    (record,) = await world.pass_once()
    assert record.state == "following" and "no attempt has trained a step since the notice" in record.evidence

    trained = world.clock[0] + timedelta(seconds=5)
    await resume_record(world.s3, at=trained, step=5)
    world.later(timedelta(seconds=10))
    (record,) = await world.pass_once()
    assert record.state == "resumed" and record.resumed["resumed_from_step"] == 5
    assert record.stage_seconds()["training"] == pytest.approx((trained - record.notice_at).total_seconds(), abs=1)
    assert world.events("TrainingResumed")
    assert world.metric("resilienced_notice_to_training_seconds_count") == 1
    assert world.metric("resilienced_recoveries_total", {"outcome": "resumed"}) == 1
    assert world.metric("resilienced_runs_recovering", {"stage": "scheduled"}) == 0


async def test_a_nodeclaim_that_cannot_launch_is_the_evidence_and_the_run_is_stuck_without_moves_left(
        api: Any, kubeapi: KubeApiServer, s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kubeapi.register(NODECLAIMS)
    seed_world(kubeapi, gcs_port=6379)
    world = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)], max_fallbacks=0)
    await world.cluster.start()
    try:
        await requeued_onto_the_block(world, when=world.clock[0])
        # Karpenter tried the block: EC2 answered InsufficientInstanceCapacity; it recorded an Event on
        # the NodeClaim and deleted it (kubernetes-sigs/karpenter lifecycle/launch.go, v1.x), and a
        # second NodeClaim failed to launch for another reason (Launched=False, LaunchFailed)
        kubeapi.create({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "nc1.ice", "namespace": "default"},
                        "involvedObject": {"kind": "NodeClaim", "name": "blocks-abc12", "apiVersion": "karpenter.sh/v1"},
                        "reason": "InsufficientCapacityError", "type": "Warning",
                        "lastTimestamp": (world.clock[0] + timedelta(seconds=5)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                        "message": "NodeClaim blocks-abc12 event: creating instance, insufficient capacity"})
        kubeapi.create({"apiVersion": "karpenter.sh/v1", "kind": "NodeClaim", "metadata": {"name": "blocks-def34"},
                        "spec": {"requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In",
                                                   "values": ["reserved"]}],
                                 "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "b"}},
                        "status": {"conditions": [{"type": "Launched", "status": "False", "reason": "LaunchFailed",
                                                   "message": "ReservationCapacityExceeded"}]}})
        world.later(BOUND + timedelta(seconds=1))
        (record,) = await world.pass_once()
        assert record.state == "stuck" and record.fallbacks == ()
        assert "InsufficientCapacityError" in record.reason and "blocks-def34 LaunchFailed" in record.reason
        assert selectors(kubeapi) == ["reserved"]  # not moved: no move left
        assert world.events("RecoveryStuck") and not world.events("TrainingResumed")
        assert world.metric("resilienced_runs_overdue") == 1
        assert world.metric("resilienced_runs_recovering", {"stage": "stuck"}) == 1

        world.later(BOUND)
        (again,) = await world.pass_once()  # a stuck run is watched, never moved again
        assert again.state == "stuck" and selectors(kubeapi) == ["reserved"]
        assert world.metric("resilienced_recoveries_total", {"outcome": "stuck"}) == 1

        kubeconfig = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
        code = await asyncio.to_thread(cli.main, ["status", "--kubeconfig", str(kubeconfig), "--claims-namespace",
                                                  DAEMON_NS, "--json"])
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"time"')]
        assert code == 0 and [(r["run"], r["stage"], r["training_again_s"]) for r in rows] == [(f"{NS}/train", "stuck", None)]
    finally:
        await world.cluster.stop()


async def test_an_attempt_that_never_trains_at_its_size_is_a_stall_and_a_stuck_run_that_trains_ends_resumed(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    seed_world(kubeapi, gcs_port=6379)
    world = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)], max_fallbacks=0)
    await world.cluster.start()
    try:
        notice = world.clock[0]
        block_nodes = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK,
                       "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
        for name, n in (("b1", 11), ("b2", 12)):
            obj = node(name, instance(n), capacity="reserved")
            obj["metadata"]["labels"].update(block_nodes)
            kubeapi.create(obj)
        await requeued_onto_the_block(world, when=notice)  # here the block's Nodes exist: bound
        (record,) = await world.pass_once()
        assert record.stage == "training"
        await resume_record(s3, at=notice - timedelta(seconds=20), step=3)  # the attempt before the notice
        world.later(BOUND + timedelta(seconds=1))  # no attempt since: Ray Train never started again
        (record,) = await world.pass_once()
        assert record.state == "stuck" and "no attempt has trained a step since the notice" in record.reason
        # then it restarts at one worker of the two its minimum says: not training again either
        await resume_record(s3, at=notice + timedelta(seconds=80), step=7, world_size=1, min_world_size=2)
        (record,) = await world.pass_once()
        assert record.state == "stuck" and "below its minimum 2" in (record.evidence or record.reason)
        assert not world.events("TrainingResumed")

        await resume_record(s3, at=notice + timedelta(seconds=90), step=7)  # the full gang trains again
        (record,) = await world.pass_once()
        assert record.state == "resumed" and record.resumed["world_size"] == 2
        assert world.events("TrainingResumed")
    finally:
        await world.cluster.stop()


def kueue_world(api: Any, kubeapi: KubeApiServer, s3: Any) -> Follow:
    """The run under Kueue: its RayJob in queue ``training``, its Workload admitted on Spot, the
    flavors served (start the returned replica's caches)."""
    kubeapi.register(ResourceType("kueue.x-k8s.io", ("v1beta1", "v1beta2"), "resourceflavors", "ResourceFlavor",
                                  namespaced=False))
    for name, labels in (*FLAVORS, DEFAULT_FLAVOR):
        kubeapi.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": name},
                        "spec": {"nodeLabels": labels}})
    seed_world(kubeapi, gcs_port=6379)
    job = kubeapi.get("rayjobs", "train", namespace=NS)
    job["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = "training"
    kubeapi.put(job)
    kubeapi.create(workload_for(kubeapi.get("rayjobs", "train", namespace=NS), flavor="spot"))
    return Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)])


async def test_a_workload_pending_for_quota_falls_back_to_a_flavor_with_quota(api: Any, kubeapi: KubeApiServer,
                                                                              s3: Any) -> None:
    world = kueue_world(api, kubeapi, s3)
    await world.cluster.start()
    try:
        async with KueueSim(kubeapi, namespace=NS) as kueue:
            kueue.quota_short.add("capacity-block")  # the block flavor's quota is used up
            outcome = await world.recovery.act(state_change(world.clock[0]), holder="replica-a/m1")
            run = outcome.details["runs"][0]
            assert run["requeue"]["kind"] == "kueue" and run["follow_up"]["stages"] == ["admitted", "scheduled", "training"]
            # KubeRay deleted the RayJob's cluster when Kueue suspended it (ray-operator
            # controllers/ray/rayjob_controller.go, a suspended RayJob: deleteClusterResources, v1.7.0)
            for pod in ("train-w1", "train-w2"):
                kubeapi.delete("pods", pod, namespace=NS)
            kubeapi.delete("nodes", "n1")
            await eventually(lambda: kueue.no_fit > 0)
            (record,) = await world.pass_once()
            assert record.stage == "admitted" and "insufficient unused quota" in (record.evidence or "")

            world.later(BOUND + timedelta(seconds=1))
            (record,) = await world.pass_once()
            assert [(f["from"], f["to"]) for f in record.fallbacks] == [(f"capacity-block {BLOCK}", "spot")]
            assert "admitted not reached" in record.fallbacks[0]["reason"]
            await eventually(lambda: kueue.admitted[-1:] == ["spot"])
            (record,) = await world.pass_once()
            assert record.stage == "scheduled" and "admitted" in record.reached
            assert "0 of 2 worker pod(s)" in record.evidence  # KubeRay has not made the new cluster's pods yet
            assert kueue.foreign_suspend_writes == 0
    finally:
        await world.cluster.stop()


# --------------------------------------------------------------------------- replicas
class DiesAfterTheMove:
    """A replica killed mid-follow-up: its requeue applies the move, then the replica never returns."""

    def __init__(self, inner: ReportingRequeuer) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.applied = asyncio.Event()

    async def withdraw(self, target: Any, **kwargs: Any) -> list[str]:
        return await self.inner.withdraw(target, **kwargs)

    async def requeue(self, target: Any, **kwargs: Any) -> Any:
        await self.inner.requeue(target, **kwargs)
        self.applied.set()
        await asyncio.Event().wait()  # killed here: nothing after the move is recorded


@contextlib.asynccontextmanager
async def two_replicas(api: Any, kubeapi: KubeApiServer, s3: Any) -> AsyncIterator[tuple[Follow, Follow, list[datetime]]]:
    """Two replicas (``a``, ``b``) of the daemon on one seeded world and one scripted clock."""
    seed_world(kubeapi, gcs_port=6379)
    clock = [datetime.now(timezone.utc)]
    a = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=clock, replica="a")
    b = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=clock, replica="b")
    await a.cluster.start()
    await b.cluster.start()
    try:
        yield a, b, clock
    finally:
        await a.cluster.stop()
        await b.cluster.stop()


async def test_a_replica_killed_mid_follow_up_is_taken_over_and_the_run_is_moved_once(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    async with two_replicas(api, kubeapi, s3) as (a, b, clock):
        await requeued_onto_the_block(a, when=clock[0])
        deleted = worker_pods_deleted(kubeapi)
        dying = DiesAfterTheMove(a.requeue)
        a.mover.requeue = dying
        a.later(BOUND + timedelta(seconds=1))
        killed = asyncio.create_task(a.pass_once())
        await asyncio.wait_for(dying.applied.wait(), 10)
        killed.cancel()
        await asyncio.gather(killed, return_exceptions=True)
        assert selectors(kubeapi) == ["spot"] and worker_pods_deleted(kubeapi) == deleted + 2
        assert (await a.record())["moving"]["to"]["capacity"] == "spot"  # decided, not recorded as made

        (record,) = await b.pass_once()  # a's move claim is live: b leaves the run alone
        assert record.moving is not None and record.fallbacks == ()
        with pytest.raises(TemporaryError, match="being moved by its follow-up"):  # nor does a new notice
            await b.recovery.act(state_change(clock[0], 100, event_id="7e9d2f6c-0000-4000-8000-00000000f002"),
                                 holder="replica-b/m2")

        b.later(timedelta(seconds=31))  # past the claim's TTL: b takes the follow-up over
        (record,) = await b.pass_once()
        assert record.moving is None and [(f["from"], f["to"]) for f in record.fallbacks] == [
            (f"capacity-block {BLOCK}", "spot")]
        assert record.capacity == "spot" and selectors(kubeapi) == ["spot"]
        assert worker_pods_deleted(kubeapi) == deleted + 2  # moved once: b's second application changed nothing
        assert len(b.events("RecoveryStalled")) == 1
        assert b.metric("resilienced_recovery_fallbacks_total",
                        {"from": "capacity-block", "to": "spot", "reason": "scheduled"}) == 1
        assert a.metric("resilienced_recovery_fallbacks_total",
                        {"from": "capacity-block", "to": "spot", "reason": "scheduled"}) == 0


async def test_a_notice_whose_run_another_replica_is_moving_waits_for_that_move_and_is_done_with_it(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    """Issue #45: a gang's notices split between two replicas.  The handling that began first holds
    the run's move claim from its start; a notice of the run in the other replica finds it held by
    that delivery and joins that handling there: no run claim and no Event of its own; it waits (a
    read a second) until the run is moved and, the run's record saying it was moved after this
    notice with its whole gang, is done with it: no retry (which found the run gone and claimed
    each notice again), no second move, one ``Requeued``."""
    async with two_replicas(api, kubeapi, s3) as (a, b, clock):
        key = a.mover.move_key(f"{NS}/train")
        assert await a.claims.acquire(key, holder=LEADING, ttl_seconds=30)  # a's delivery moves the run
        second = state_change(clock[0], 2, event_id="7e9d2f6c-0000-4000-8000-00000000f002")
        waiting = asyncio.create_task(b.recovery.act(second, holder="replica-b/m2"))
        await eventually(lambda: any(r.verb == "get" and r.name == lease_name(key) for r in kubeapi.requests))
        assert not waiting.done()
        first = await a.recovery.act(state_change(clock[0]), holder="replica-a/m1")
        assert first.result is Result.DONE and first.details["runs"][0]["requeue"]["capacity"] == "capacity-block"
        outcome = await waiting
        assert outcome.result is Result.DONE, outcome.reason
        (run,) = outcome.details["runs"]
        assert "moved for event 7e9d2f6c-0000-4000-8000-00000000f001 after this notice" in run["skipped"], run
        assert "requeue" not in run and run["joined"] == "7e9d2f6c-0000-4000-8000-00000000f001"
        assert "joined the handling of another notice of the run (replica-a/m1)" in run["skipped"]
        assert len(a.events("Requeued")) == 1 and worker_pods_deleted(kubeapi) == 2  # moved once
        # it joined that handling: no claim of its own (the move claim let go, a's run claim done)
        keys = sorted(l["metadata"]["annotations"]["resilienced.io/claim-key"]
                      for l in kubeapi.list("leases", namespace=DAEMON_NS)
                      if "resilienced.io/claim-key" in l["metadata"].get("annotations", {}))
        assert keys == ["run/7e9d2f6c-0000-4000-8000-00000000f001/ml/train"], keys


async def test_a_copy_of_the_leading_notice_in_another_replica_is_a_duplicate_not_a_joiner(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    """The move claim held from a handling's start names its delivery and its event (``EVENT_MARK``):
    a copy of that event, delivered to the other replica as another message, is a duplicate (as
    under the run claim it stands for: ``claims.not_free``), not a notice joining the handling;
    the same message delivered again (its visibility ran out) is retried, never deleted."""
    async with two_replicas(api, kubeapi, s3) as (a, b, clock):
        assert await a.claims.acquire(a.mover.move_key(f"{NS}/train"), holder=LEADING, ttl_seconds=30)
        copy = state_change(clock[0])
        assert not await b.recovery.needs_event_claim(copy)  # its run claim stands for the event claim
        outcome = await b.recovery.act(copy, holder="replica-b/m9")
        assert outcome.result is Result.DUPLICATE, outcome.reason
        assert "is being handled by replica-a/m1" in outcome.reason
        again = state_change(clock[0])
        assert not await b.recovery.needs_event_claim(again)
        outcome = await b.recovery.act(again, holder="replica-b/m1")
        assert outcome.result is Result.RETRY and "an earlier delivery of this message (replica-a/m1)" in outcome.reason
        assert b.events("Draining") == [] and b.gcs.drains == []
        assert [l["metadata"]["annotations"]["resilienced.io/claim-key"] for l in kubeapi.list("leases", namespace=DAEMON_NS)
                if "resilienced.io/claim-key" in l["metadata"].get("annotations", {})] == [f"move/{NS}/train"]


async def test_a_handling_under_the_move_claim_writes_the_run_claim_once_done(world: Follow) -> None:
    """Issue #45: the move claim, held from the start, stands for the run claim: the run claim is one
    write, a create of the done claim with the run's record, not a create, renewals and a completion."""
    outcome = await world.recovery.act(state_change(world.clock[0]), holder="replica-a/m1")
    assert outcome.result is Result.DONE, outcome.reason
    writes = Counter(r.verb for r in world.kubeapi.requests if r.plural == "leases" and r.verb not in ("get", "list", "watch"))
    # the move claim (created, deleted), the run claim (created done), the follow-up record (created, patched)
    assert (writes["create"], writes["update"], writes["delete"]) == (3, 0, 1), writes
    done = await world.claims.get(f"run/{EVENT}/{NS}/train")
    assert done is not None and (done.state, done.holder) == ("done", "replica-a/m1")
    assert done.details["requeue"]["capacity"] == "capacity-block"
    assert await world.claims.get(world.mover.move_key(f"{NS}/train")) is None  # let go after the move


async def test_a_delivery_that_takes_the_move_claim_after_a_copy_was_handled_is_a_duplicate(world: Follow) -> None:
    """A copy of the event in another replica handled the run and let its move claim go after this
    delivery located the run: holding the move claim, this delivery finds the run claim done and
    moves nothing (the run claim is written before the move claim is let go)."""
    await world.claims.complete(f"run/{EVENT}/{NS}/train", holder="replica-b/m9", details={"outcome": "done"})
    plan = state_change(world.clock[0])
    assert not await world.recovery.needs_event_claim(plan)
    outcome = await world.recovery.act(plan, holder="replica-a/m1")
    assert outcome.result is Result.DUPLICATE and f"event {EVENT} already handled by replica-b/m9" in outcome.reason
    assert world.events("Requeued") == [] and worker_pods_deleted(world.kubeapi) == 0
    assert await world.claims.get(world.mover.move_key(f"{NS}/train")) is None  # let go


async def test_a_notice_located_before_another_replica_moved_its_run_is_done_with_that_move(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    """A notice of the run in replica b located its run (the pods still on its instance); replica a's
    handling of another notice then moved the run and let the move claim go.  b takes the move claim
    and, the run's record saying it was moved after b's notice, moves nothing: one move, one
    ``Requeued``, no claim or Event of b's."""
    async with two_replicas(api, kubeapi, s3) as (a, b, clock):
        second = state_change(clock[0], 2, event_id="7e9d2f6c-0000-4000-8000-00000000f002")
        assert not await b.recovery.needs_event_claim(second)  # located now: the run on its instance
        first = await a.recovery.act(state_change(clock[0]), holder="replica-a/m1")
        assert first.result is Result.DONE and first.details["runs"][0]["requeue"]["capacity"] == "capacity-block"
        events = kubeapi.list("events", namespace=None)
        outcome = await b.recovery.act(second, holder="replica-b/m2")
        assert outcome.result is Result.DONE, outcome.reason
        (run,) = outcome.details["runs"]
        assert run["joined"] == EVENT and "requeue" not in run, run
        assert kubeapi.list("events", namespace=None) == events  # b recorded none
        assert f"moved for event {EVENT} after this notice" in run["skipped"]
        assert len(a.events("Requeued")) == 1 and worker_pods_deleted(kubeapi) == 2  # moved once
        assert await b.claims.get(f"run/7e9d2f6c-0000-4000-8000-00000000f002/{NS}/train") is None
        assert await b.claims.get(b.mover.move_key(f"{NS}/train")) is None  # let go


async def test_a_notice_whose_run_its_follow_up_is_moving_does_not_wait(world: Follow) -> None:
    """A move claim the follow-up holds is a fallback (its own move, for an earlier notice): a new
    notice of the run does not wait for it and is retried as before."""
    key = world.mover.move_key(f"{NS}/train")
    assert await world.claims.acquire(key, holder="replica-b/follow-up", ttl_seconds=30)
    with pytest.raises(TemporaryError, match="being moved by its follow-up or another notice"):
        await world.recovery.act(state_change(world.clock[0]), holder="replica-a/m1")
    assert [r for r in world.kubeapi.requests if r.verb == "get" and r.name == lease_name(key)] != []


async def eventually(check: Callable[[], bool], *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_an_unreadable_follow_up_record_is_skipped_and_said(world: Follow, kubeapi: KubeApiServer) -> None:
    """A Lease labelled as a follow-up record whose record is not a JSON object (edited by hand, cut
    off) is no run's record: the pass skips it, ``get`` finds none, and the log names the Lease."""
    from resilienced.kube.followup_store import KIND_LABEL, RECORD_ANNOTATION
    from resilienced.kube.leases import MANAGED_BY

    for name, text in (("resilienced-fu-cut", '{"run": "ml/tr'), ("resilienced-fu-list", "[1, 2]")):
        kubeapi.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {
            "name": name, "namespace": DAEMON_NS, "labels": {**MANAGED_BY, **KIND_LABEL},
            "annotations": {RECORD_ANNOTATION: text}}, "spec": {}})
    with structlog.testing.capture_logs() as logs:
        assert await world.pass_once() == []
    said = {line["lease"]: line["error"] for line in logs if line["event"] == "follow-up record unreadable"}
    assert set(said) == {"resilienced-fu-cut", "resilienced-fu-list"}, logs
    assert said["resilienced-fu-list"] == "not a JSON object but list"


async def test_another_replica_looks_at_a_run_once_it_has_waited_in_its_stage(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    """The replica that wrote a run's record last looks at it every pass; another leaves it alone
    until it has waited in its stage ``min(bound / 2, TAKEOVER_PASSES x interval)`` (its writer may
    be gone), so two replicas do not race for every write of every run (issue #45)."""
    from resilienced.followup.follower import TAKEOVER_PASSES

    from .test_followup_reads import leases_written
    from .test_followup_writes import BLOCK_LABELS

    async with two_replicas(api, kubeapi, s3) as (a, b, clock):
        for name, n in (("b1", 11), ("b2", 12)):  # the block's Nodes: the workers are bound at once
            obj = node(name, instance(n), capacity="reserved")
            obj["metadata"]["labels"].update(BLOCK_LABELS)
            kubeapi.create(obj)
        await requeued_onto_the_block(a, when=clock[0])  # a's notice opened the follow-up
        assert (await a.record())["looked_by"] == a.follower.replica == "replica-a"
        b.follower.options = replace(b.follower.options, interval_s=2.0)
        wait = timedelta(seconds=TAKEOVER_PASSES * 2.0)  # 12 s: sooner than half the bound (30 s)
        assert wait < BOUND / 2
        await resume_record(s3, at=clock[0] + timedelta(seconds=1), step=5)  # the run trains again
        b.later(wait - timedelta(seconds=1))
        kubeapi.reset_log()
        (left,) = await b.pass_once()
        assert (left.state, left.looked_by) == ("following", "replica-a") and leases_written(kubeapi) == 0
        b.later(timedelta(seconds=1))
        (taken,) = await b.pass_once()
        assert (taken.state, taken.looked_by) == ("resumed", "replica-b")
