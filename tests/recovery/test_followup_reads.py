"""What a follow-up look costs the API server (issue #45: no run's follow-up polls the API in a loop).

The emulated API server over HTTP counts every request (``KubeApiServer.requests``).  A look at a
run that waits in a stage reads the daemon's watch caches (``kube.progress`` with the
``KubeCluster``'s caches, as kubernetes mode wires it) and sends nothing once they have synced; the
run's move claim is taken only by a look that moves the run, so a waiting look writes no Lease.
A cache that has not synced is no answer: past the bound, nothing is moved on it.  The follower
looks at the open follow-ups concurrently, at most ``looks_at_once`` at a time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from resilienced.followup.follower import Follower, FollowUpOptions
from resilienced.followup.rules import target_from
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.cluster_caches import WORKLOADS
from resilienced.kube.followup_store import KubeFollowUps
from resilienced.kube.progress import KubeProgress, NoAnswerYet
from resilienced.model import Capacity, Event, Kind, RequeueResult, RunFacts, StageSeen, Target
from tests.requeue.kueue_sim import KueueSim
from tests.support.kubeapi import KubeApiServer
from tests.kube.conftest import NODECLAIMS

from .conftest import DAEMON_NS, NS, seed_world
from .test_followup import BOUND, Follow, eventually, kueue_world, requeued_onto_the_block, selectors, state_change
from .test_recovery import FAST

pytestmark = pytest.mark.integration

#: The one request of a pass that is not a look: the follow-up records' listing (one per pass, all runs).
LEASES = "leases.coordination.k8s.io"
PASS_LISTING = ("list", "leases.coordination.k8s.io")


def looks_requests(kubeapi: KubeApiServer) -> Counter[tuple[str, str]]:
    """The requests since the log was reset, less the pass's listing of the records."""
    counts = kubeapi.counts()
    counts.pop(PASS_LISTING, None)
    return +counts


def leases_written(kubeapi: KubeApiServer) -> int:
    return sum(n for (verb, resource), n in kubeapi.counts().items()
               if resource == "leases.coordination.k8s.io" and verb in ("create", "update", "patch", "delete"))


async def test_a_look_at_a_run_waiting_to_be_scheduled_sends_no_request_once_the_caches_synced(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    kubeapi.register(NODECLAIMS)
    seed_world(kubeapi, gcs_port=6379)
    world = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)])
    await world.cluster.start()
    try:
        await requeued_onto_the_block(world, when=world.clock[0])  # its workers stay Unschedulable
        await eventually(lambda: sum("Unschedulable" in str(p.get("status")) for p in world.cluster.caches.pods.values()) == 2)
        (record,) = await world.pass_once()  # the first look keeps its evidence (a write of the record)
        assert record.stage == "scheduled" and "Unschedulable" in (record.evidence or "")
        kubeapi.reset_log()
        for _ in range(3):
            world.later(timedelta(seconds=15))  # within the bound: it waits
            (after,) = await world.pass_once()
            assert (after.stage, after.evidence, after.version) == (record.stage, record.evidence, record.version)
        assert looks_requests(kubeapi) == Counter(), "a waiting look read or wrote the API"
        assert kubeapi.counts()[PASS_LISTING] == 3 and leases_written(kubeapi) == 0

        world.later(BOUND)  # past the bound: the look that moves takes the move claim
        kubeapi.reset_log()
        (moved,) = await world.pass_once()
        assert [(f["from"].split()[0], f["to"]) for f in moved.fallbacks] == [("capacity-block", "spot")]
        counts = kubeapi.counts()
        assert counts[("create", LEASES)] == 1 and counts[("delete", LEASES)] == 1  # the claim, taken and let go
    finally:
        await world.cluster.stop()


async def test_a_look_at_a_workload_pending_for_quota_reads_the_workload_and_flavor_caches(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    world = kueue_world(api, kubeapi, s3)
    await world.cluster.start()
    try:
        async with KueueSim(kubeapi, namespace=NS) as kueue:
            kueue.quota_short.add("capacity-block")  # the block flavor's quota is used up
            outcome = await world.recovery.act(state_change(world.clock[0]), holder="replica-a/m1")
            assert outcome.details["runs"][0]["follow_up"]["stage"] == "admitted"
            await eventually(lambda: kueue.no_fit > 0)
            await eventually(lambda: any("insufficient" in str(w.get("status"))
                                         for w in world.cluster.caches.cache_of(WORKLOADS).values()))
            (record,) = await world.pass_once()
            assert record.stage == "admitted" and "insufficient unused quota" in (record.evidence or "")
            kubeapi.reset_log()
            (after,) = await world.pass_once()
            assert after.version == record.version and after.evidence == record.evidence
            assert looks_requests(kubeapi) == Counter(), "a waiting look read or wrote the API"
    finally:
        await world.cluster.stop()


async def test_caches_that_have_not_synced_are_no_answer_and_nothing_is_moved_on_them(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    seed_world(kubeapi, gcs_port=6379)
    world = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[datetime.now(timezone.utc)])
    await world.cluster.start()
    unsynced = KubeCluster(api, ray_control_factory=lambda addr, tok: world.gcs, options=FAST)  # never started
    try:
        await requeued_onto_the_block(world, when=world.clock[0])
        (record,) = await world.pass_once()
        world.follower.progress = KubeProgress(api, kueue=world.kueue, caches=unsynced.caches)
        world.later(BOUND + timedelta(seconds=1))  # past the bound, but the look has no answer
        kubeapi.reset_log()
        (after,) = await world.pass_once()
        assert after.version == record.version and after.fallbacks == () and selectors(kubeapi) == ["reserved"]
        assert looks_requests(kubeapi) == Counter()  # neither read from the API nor claimed
        with pytest.raises(NoAnswerYet, match="has no answer yet: not listed yet"):  # the look's reason
            await world.follower.progress.placed(target_from(record.target), capacity=Capacity(record.capacity),
                                                 reservation_id=record.reservation_id, since=record.stage_since)

        world.follower.progress = KubeProgress(api, kueue=world.kueue, caches=world.cluster.caches)  # synced: it judges
        (after,) = await world.pass_once()
        assert [f["to"] for f in after.fallbacks] == ["spot"] and selectors(kubeapi) == ["spot"]
    finally:
        await world.cluster.stop()


# --------------------------------------------------------------------------- concurrency
T0 = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)


class HeldLooks:
    """``ports.Progress`` whose looks wait until released, counting how many are in flight at once."""

    def __init__(self) -> None:
        self.in_flight = self.most = 0
        self.release = asyncio.Event()

    async def admitted(self, target: Target, **kwargs: Any) -> StageSeen:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return StageSeen(False, "Workload pending")

    async def placed(self, target: Target, **kwargs: Any) -> StageSeen:
        raise AssertionError("the runs wait to be admitted")


async def test_a_pass_looks_at_the_open_follow_ups_together_at_most_looks_at_once(api: Any, kubeapi: KubeApiServer) -> None:
    seed_world(kubeapi, gcs_port=6379)
    progress = HeldLooks()
    follower = Follower(store=KubeFollowUps(api, namespace=DAEMON_NS), cluster=None,  # type: ignore[arg-type]
                        progress=progress,
                        mover=None, objects=None, clock=lambda: T0,  # type: ignore[arg-type]
                        options=FollowUpOptions(looks_at_once=4))
    for n in range(10):
        target = Target(instance_id=f"i-{n}", node=f"n{n}", ray_cluster=f"ml/rc-{n}", ray_job=f"ml/run-{n}",
                        ray_node_ids=(), checkpoint_uri="s3://b/runs/x", facts=RunFacts())
        result = RequeueResult(run_key=target.run_key, kind="kueue", capacity=Capacity.ON_DEMAND, reason="r",
                               changes=("patched",))
        await follower.open(target, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id=f"ev-{n}", time=T0),
                            result=result)
    passing = asyncio.create_task(follower.pass_once())
    await eventually(lambda: progress.in_flight == 4)
    for _ in range(50):  # nothing but the event loop stands between the other looks and their start
        await asyncio.sleep(0)
    assert progress.most == 4
    progress.release.set()
    after = await asyncio.wait_for(passing, 10)
    assert len(after) == 10 and all(r.stage == "admitted" and r.evidence == "Workload pending" for r in after)
