"""The daemon as deployed, on the real control plane: a Spot notice through moto SQS, and the run
moved through the real Kueue and the real KubeRay operator, followed until it trains again.

Real: kube-apiserver (RBAC: the daemon holds a token of its own ServiceAccount, bound by
deploy/kubernetes/base's ClusterRole and Role, never cluster-admin), etcd, the scheduler binding
the pods to kwok Nodes, the controller-manager, the KubeRay operator reconciling the RayJob into a
RayCluster and pods, Kueue admitting the Workload on a flavor; SQS and S3 on moto; the daemon's own
process with ``resilienced run``'s flags.  Stand-ins: the Ray side of each pod (the recording GCS,
tests/support/controlplane/daemon.py) and the trainer's two writes to S3 (the checkpoint once the
drain is recorded, the resume record once the requeued pods run: tests/cluster/stage.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.controlplane import ControlPlane
from resilienced.kube.followup_store import RECORD_ANNOTATION, lease_name
from tests.support.controlplane.world import DAEMON_NS, World

from .stage import (BLOCK, Aws, Daemon, Nodes, Trainer, block, node_world, queue_world, raycluster_of, rayjob,
                    running_workers, wait)

pytestmark = pytest.mark.cluster

JsonObj = dict[str, Any]


@pytest.fixture
def sqs_s3(aws: Any) -> Aws:
    return Aws(aws.endpoint_url).open()


@dataclass
class Run:
    """A training run on the real plane, the daemon replicas beside it, the trainer's writes."""

    world: World
    plane: ControlPlane
    aws: Aws
    nodes: Nodes
    cluster: JsonObj
    workers: list[JsonObj]
    trainer: Trainer
    daemons: list[Daemon] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.world.namespace}/train"

    def record(self) -> JsonObj | None:
        """The run's follow-up record, read from its Lease as the daemon keeps it
        (resilienced/kube/followup_store.py: the record's JSON in an annotation)."""
        lease = self.world.get("coordination.k8s.io/v1", "leases", lease_name(self.name), namespace=DAEMON_NS)
        if lease is None:
            return None
        return dict(json.loads(lease["metadata"]["annotations"][RECORD_ANNOTATION]))

    def ended(self, state: str, *, timeout: float) -> JsonObj:
        try:
            return wait(f"the follow-up {state}", lambda: (r := self.record()) and r.get("state") == state and r,
                        timeout=timeout, daemons=self.daemons)
        except AssertionError:
            print(json.dumps(self.record(), indent=1))
            raise

    def interrupt(self, *, step: int = 7) -> str:
        """A Spot notice for the first worker's instance; the trainer saves once the drain reached it."""
        lost = self.workers[0]["spec"]["nodeName"]
        self.aws.notice(self.nodes.instance_of(lost))
        wait("the drain of the lost worker", lambda: any(d.drained() for d in self.daemons), timeout=90,
             daemons=self.daemons)
        self.trainer.save(step=step)
        return lost

    def workers_on(self, part: str, *, timeout: float = 150) -> list[JsonObj]:
        """Wait until the run's two workers run on Nodes named ``*-<part>-*``; them."""
        def on() -> list[JsonObj] | None:
            pods = [p for p in self.world.pods("ray.io/node-type=worker")
                    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            return pods if len(pods) == 2 and all(f"-{part}-" in p["spec"]["nodeName"] for p in pods) else None

        return wait(f"the workers Running on the {part} Nodes", on, timeout=timeout, daemons=self.daemons)

    def stop(self) -> None:
        codes = {d.name: d.stop() for d in self.daemons if d.alive()}
        assert all(code == 0 for code in codes.values()), (codes, [d.tail() for d in self.daemons])


@pytest.fixture
def stage(daemon_identity: ControlPlane, world: World, sqs_s3: Aws, aws: Any, tmp_path: Path) -> Iterator[Any]:
    """``stage(queue=..., shape=..., spot=, block=, on_demand=, quota=, flags=, replicas=)``: the run
    reconciled and Running on its Spot Nodes, the daemon replicas started; every replica is
    stopped at the end (killed where a test left it running)."""
    runs: list[Run] = []

    def make(*, queue: bool = True, shape: str = "karpenter", spot: int = 2, block_nodes: int = 2,
             on_demand: int = 0, quota: dict[str, Any] | None = None, flags: tuple[str, ...] = (),
             replicas: int = 1, blocks: tuple[JsonObj, ...] | None = None) -> Run:
        nodes = node_world(world, spot=spot, block=block_nodes, on_demand=on_demand, shape=shape)
        spot_labels = ({"karpenter.sh/capacity-type": "spot"} if shape == "karpenter"
                       else {"eks.amazonaws.com/capacityType": "SPOT"})
        name = queue_world(world, **(quota or {})) if queue else None
        rayjob(world, queue=name, selector=None if queue else spot_labels)
        workers = running_workers(world, count=2)
        assert all("-spot-" in p["spec"]["nodeName"] for p in workers), [p["spec"]["nodeName"] for p in workers]
        cluster = raycluster_of(world)
        run = Run(world=world, plane=daemon_identity, aws=sqs_s3, nodes=nodes, cluster=cluster, workers=workers,
                  trainer=Trainer(sqs_s3, f"{world.namespace}/train"))
        for r in range(replicas):
            daemon = Daemon(plane=daemon_identity, world=world, aws=aws, queue_url=sqs_s3.queue_url,
                            workdir=tmp_path / f"replica-{r}", name=f"replica-{'ab'[r]}",
                            blocks=list(blocks if blocks is not None else (block(),)), flags=list(flags))
            daemon.drains = tmp_path / "drains.jsonl"  # one Ray side: every replica drains the same GCS
            daemon._world["gcs"]["drains"] = str(daemon.drains)
            daemon.see(cluster, world.pods(f"ray.io/cluster={cluster['metadata']['name']}"))
            run.daemons.append(daemon.start())
        runs.append(run)
        return run

    yield make
    for run in runs:
        for daemon in run.daemons:
            daemon.kill()


def taints(world: World, node: str) -> list[str]:
    found = world.get("v1", "nodes", node, namespace=None) or {}
    return [t["key"] for t in (found.get("spec") or {}).get("taints") or []]


def events(world: World, reason: str) -> list[JsonObj]:
    return [e for e in world.list("v1", "events") if e.get("reason") == reason]


#: The daemon's flags in every test: Capacity Blocks before On-Demand; stalls bounded in seconds.
FLAGS = ("--prefer-blocks", "true", "--admitted-bound-seconds", "60", "--scheduled-bound-seconds", "60",
         "--training-bound-seconds", "120")
#: A stall's bound, short enough to wait for.
STALL = ("--prefer-blocks", "true", "--admitted-bound-seconds", "8", "--scheduled-bound-seconds", "8",
         "--training-bound-seconds", "120")


def test_a_spot_notice_moves_a_kueue_run_to_the_capacity_block_and_follows_it_until_it_trains(stage: Any) -> None:
    run: Run = stage(flags=FLAGS)
    lost = run.interrupt()
    heads = {f"{h}:6379" for h in run.cluster["status"]["head"].values() if isinstance(h, str)}
    assert {d["address"] for d in run.daemons[0].drained()} <= heads
    # cordon: a real Node patch with the daemon's token
    wait("the lost Node cordoned", lambda: any(k.startswith("resilienced") for k in taints(run.world, lost)),
         timeout=60, daemons=run.daemons)
    # the requeue through Kueue: Kueue admits on the block's flavor, KubeRay recreates the cluster
    for pod in run.workers_on("block"):
        assert pod["spec"]["nodeSelector"]["karpenter.k8s.aws/capacity-reservation-id"] == BLOCK
    run.trainer.resumed(step=7)
    record = run.ended("resumed", timeout=120)
    assert set(record["reached"]) >= {"admitted", "scheduled", "training"}, record["reached"]
    assert not record["fallbacks"]
    assert len(events(run.world, "Requeued")) == 1
    assert run.aws.in_flight() == 0
    run.stop()


def test_without_kueue_the_daemon_moves_the_workers_through_the_kuberay_operator(stage: Any) -> None:
    """EKS managed node groups: the workers' pods are deleted and the real operator recreates them
    from the steered template on the Capacity Block node group's Nodes."""
    run: Run = stage(queue=False, shape="eks-nodegroup", flags=FLAGS)
    run.interrupt()
    for pod in run.workers_on("block"):
        assert pod["spec"]["nodeSelector"]["eks.amazonaws.com/capacityType"] == "CAPACITY_BLOCK"
    assert run.world.get("ray.io/v1", "rayclusters", run.cluster["metadata"]["name"]) is not None, \
        "the RayCluster itself is kept: only its workers move"
    run.trainer.resumed(step=7)
    record = run.ended("resumed", timeout=120)
    assert set(record["reached"]) >= {"scheduled", "training"}, record["reached"]
    run.stop()


def test_a_workload_pending_for_quota_falls_back_to_on_demand(stage: Any) -> None:
    """The block flavor has no quota of its own and borrows from a cohort that has none: the
    daemon's quota check cannot close it (no borrowing limit), the real Kueue leaves the Workload
    pending, and once the admitted bound passes the follow-up moves the run to On-Demand."""
    run: Run = stage(on_demand=2, quota={"block": 0, "cohort": "pool"}, flags=STALL)
    run.interrupt()
    run.workers_on("od")
    record = run.record() or {}
    assert [f["to"] for f in record["fallbacks"]] == ["on-demand"], json.dumps(record["fallbacks"], indent=1)
    assert "insufficient" in json.dumps(record["fallbacks"]).lower() or "quota" in json.dumps(record["fallbacks"]).lower(), \
        record["fallbacks"]
    run.trainer.resumed(step=7)
    run.ended("resumed", timeout=120)
    run.stop()


def test_pods_the_scheduler_cannot_place_fall_back_to_on_demand(stage: Any) -> None:
    """No Node of the Capacity Block exists (EC2 lists the block, Karpenter never brought its Nodes
    up): the real scheduler leaves the recreated workers Unschedulable, and after the scheduled
    bound the follow-up moves the run to On-Demand, naming the scheduler's message."""
    run: Run = stage(queue=False, block_nodes=0, on_demand=2, flags=STALL)
    run.interrupt()
    run.workers_on("od")
    record = run.record() or {}
    assert [f["to"] for f in record["fallbacks"]] == ["on-demand"], (
        json.dumps(record, indent=1), [d.tail() for d in run.daemons])
    assert "didn't match Pod's node affinity/selector" in json.dumps(record["fallbacks"]), record["fallbacks"]
    run.trainer.resumed(step=7)
    run.ended("resumed", timeout=120)
    run.stop()


def test_a_replica_killed_mid_follow_up_leaves_a_run_the_other_moves_once(stage: Any) -> None:
    """Two daemon processes on one queue, claims and follow-ups on the API server's Leases: the
    replica that requeued the run is killed (SIGKILL) while the Workload waits for quota; the other
    one falls back once, and the run is requeued twice in all (the move and the fallback)."""
    run: Run = stage(on_demand=2, quota={"block": 0, "cohort": "pool"}, replicas=2,
                     flags=(*STALL, "--follow-up-claim-ttl-seconds", "10"))
    run.interrupt()
    wait("the follow-up opened", lambda: (r := run.record()) and r.get("state") == "following", timeout=60,
         daemons=run.daemons)
    mover = next(d for d in run.daemons if any(line.get("event") == "follow-up opened" for line in d.lines()))
    mover.kill()
    survivor = next(d for d in run.daemons if d is not mover)
    run.workers_on("od")
    record = run.record() or {}
    assert [f["to"] for f in record["fallbacks"]] == ["on-demand"], json.dumps(record["fallbacks"], indent=1)
    assert any(line.get("event") == "follow-up fell back" for line in survivor.lines()), survivor.tail()
    run.trainer.resumed(step=7)
    run.ended("resumed", timeout=120)
    assert len(events(run.world, "Requeued")) == 2, [e.get("message") for e in events(run.world, "Requeued")]
    run.stop()


def test_when_no_capacity_can_place_the_run_the_follow_up_ends_stuck_and_says_why(stage: Any) -> None:
    """Neither the Capacity Block's Nodes nor On-Demand Nodes exist: the real scheduler leaves the
    workers Unschedulable on the block, then on On-Demand after the one fallback allowed; the
    follow-up ends ``stuck`` with the scheduler's message and a RecoveryStuck Event, never a
    success (nothing trains: no resume record is written)."""
    run: Run = stage(queue=False, block_nodes=0, on_demand=0, flags=(*STALL, "--max-fallbacks", "1"))
    run.interrupt()
    record = run.ended("stuck", timeout=150)
    assert [f["to"] for f in record["fallbacks"]] == ["on-demand"], json.dumps(record["fallbacks"], indent=1)
    assert "training" not in record["reached"], record["reached"]
    assert "didn't match Pod's node affinity/selector" in json.dumps(record), json.dumps(record, indent=1)
    # the end is saved, then its Event recorded (followup/follower.py ``_stuck``): wait for it (run 98
    # read the Events between the two)
    stuck = wait("the RecoveryStuck Event", lambda: events(run.world, "RecoveryStuck"), timeout=30, daemons=run.daemons)
    assert "1 fallback(s) made, at most 1" in stuck[0]["message"], [e.get("message") for e in stuck]
    assert len(events(run.world, "Requeued")) == 2
    run.stop()

