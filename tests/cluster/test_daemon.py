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
from pathlib import Path
from typing import Any

import pytest

from tests.support.controlplane import ControlPlane
from resilienced.kube.followups import RECORD_ANNOTATION, lease_name
from tests.support.controlplane.world import DAEMON_NS, World

from .stage import (BLOCK, Aws, Daemon, Trainer, block, node_world, queue_world, raycluster_of, rayjob,
                    running_workers, wait)

pytestmark = pytest.mark.cluster

JsonObj = dict[str, Any]


@pytest.fixture
def sqs_s3(aws: Any) -> Aws:
    return Aws(aws.endpoint_url).open()


@pytest.fixture
def daemons(daemon_identity: ControlPlane, world: World, sqs_s3: Aws, aws: Any,
            tmp_path: Path) -> Iterator[list[Daemon]]:
    made: list[Daemon] = []

    def start(name: str = "replica-a", **kwargs: Any) -> Daemon:
        daemon = Daemon(plane=daemon_identity, world=world, aws=aws, queue_url=sqs_s3.queue_url,
                        workdir=tmp_path / "daemon", name=name, **kwargs)
        made.append(daemon)
        return daemon.start()

    made_start = start
    yield made  # type: ignore[misc]
    for daemon in made:
        daemon.kill()
    del made_start


def taints(world: World, node: str) -> list[str]:
    found = world.get("v1", "nodes", node, namespace=None) or {}
    return [t["key"] for t in (found.get("spec") or {}).get("taints") or []]


def events(world: World, reason: str) -> list[JsonObj]:
    return [e for e in world.list("v1", "events") if e.get("reason") == reason]


def follow_up(world: World, run: str) -> JsonObj | None:
    """The follow-up record of ``run`` (namespace/name), read from its Lease as the daemon keeps it
    (resilienced/kube/followups.py: the record's JSON in an annotation)."""
    lease = world.get("coordination.k8s.io/v1", "leases", lease_name(run), namespace=DAEMON_NS)
    if lease is None:
        return None
    return dict(json.loads(lease["metadata"]["annotations"][RECORD_ANNOTATION]))


def test_a_spot_notice_moves_a_kueue_run_to_the_capacity_block_and_follows_it_until_it_trains(
        daemon_identity: ControlPlane, world: World, sqs_s3: Aws, aws: Any, tmp_path: Path) -> None:
    plane = daemon_identity
    nodes = node_world(world, spot=2, block=2)
    queue = queue_world(world)
    rayjob(world, queue=queue)
    workers = running_workers(world, count=2)
    assert {p["spec"]["nodeName"] for p in workers} == {f"{world.namespace}-spot-0", f"{world.namespace}-spot-1"}
    cluster = raycluster_of(world)
    daemon = Daemon(plane=plane, world=world, aws=aws, queue_url=sqs_s3.queue_url, workdir=tmp_path / "a",
                    blocks=[block()], flags=["--prefer-blocks", "true"])
    daemon.see(cluster, world.pods(f"ray.io/cluster={cluster['metadata']['name']}"))
    trainer = Trainer(sqs_s3, f"{world.namespace}/train")
    daemon.start()
    try:
        lost = workers[0]["spec"]["nodeName"]
        sqs_s3.notice(nodes.instance_of(lost))
        # the drain reaches the GCS of the run (the stand-in records it): the trainer saves
        wait("the drain of the lost worker", daemon.drained, timeout=90, daemons=[daemon])
        assert {d["address"] for d in daemon.drained()} <= {f"{h}:6379" for h in cluster["status"]["head"].values()
                                                            if isinstance(h, str)}
        trainer.save(step=7)
        # cordon: a real Node patch with the daemon's token
        wait("the lost Node cordoned", lambda: "resilienced.io/interrupted" in taints(world, lost)
             or any(k.startswith("resilienced") for k in taints(world, lost)), timeout=60, daemons=[daemon])
        # the requeue through Kueue: the workers come back on the block's Nodes
        moved = wait("the workers Running on the Capacity Block", lambda: (
            pods := [p for p in world.pods("ray.io/node-type=worker")
                     if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")])
            and len(pods) == 2 and all("-block-" in p["spec"]["nodeName"] for p in pods) and pods,
            timeout=150, daemons=[daemon])
        for pod in moved:
            assert pod["spec"]["nodeSelector"]["karpenter.k8s.aws/capacity-reservation-id"] == BLOCK
        trainer.resumed(step=7)
        run = f"{world.namespace}/train"
        try:
            record = wait("the follow-up to see the run train again", lambda: (
                r := follow_up(world, run)) and r.get("state") == "resumed" and r, timeout=120, daemons=[daemon])
        except AssertionError:
            print(json.dumps(follow_up(world, run), indent=1))
            raise
        assert record
        assert events(world, "Requeued"), "no Requeued Event on the run"
        assert sqs_s3.in_flight() == 0
    finally:
        code = daemon.stop()
    assert code == 0, daemon.tail()
