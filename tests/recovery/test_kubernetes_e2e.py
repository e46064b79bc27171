"""Two daemon replicas on one queue, duplicated and redelivered events: each run is drained once
and verified once.

Everything is the real path of ``resilienced run --mode kubernetes`` except the Kubernetes API
server, which is the emulated one (over HTTP, with the manifests' RBAC):

* SQS and S3 on moto server; two :class:`Consumer` s (two replicas, each with its own watch
  caches, claims on Leases in the shared API server, S3 client, requeuer);
* a real local Ray cluster with token auth: the RayCluster's head service leads to its GCS, the
  worker pods' IPs are the workers' loopback addresses, the token comes from the RayCluster's
  Secret; the drain is Ray's own, and a busy worker stays draining until its deadline;
* the trainer's save is played by writing a checkpoint to S3 once the GCS shows the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session

from resilienced.aws.s3 import S3Store
from resilienced.aws.sqs import SqsQueue
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.local.capacity import StaticCapacity
from resilienced.consumer.loop import Consumer
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.leases import KubeLeaseClaims
from resilienced.local.aws import create_queue_with_dlq
from resilienced.local.raycluster import LocalRayCluster
from resilienced.ops.metrics import Metrics
from resilienced.ray.gcs import RayGcs
from resilienced.recovery.responder import Recovery, RecoveryMetrics, RecoveryOptions
from resilienced.recovery.move import Mover
from resilienced.ray.replacement import ReplacementAnnouncer
from resilienced.requeue.router import ReportingRequeuer, RequeueMetrics, RequeueRouter
from resilienced.settings import IntakeSettings, QueueSettings
from tests.support.kubeapi import KubeApiServer
from tests.support.ray import busy
from tests.support.kubeoptions import LOCAL_BOUND_S

from .conftest import DAEMON_NS, NS, REGION, WORKER_IPS, instance, put_checkpoint, rbac, seed_world
from .test_recovery import BLOCK, FAST, block, body

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="rk2-", dir="/tmp"))  # short: Ray's sockets live under it
    cluster = LocalRayCluster(workdir=workdir)
    try:
        cluster.start()
        for n, ip in enumerate(WORKER_IPS, start=1):
            cluster.add_node(labels={"resilienced.io/instance-id": instance(n)}, num_cpus=1, node_ip=ip)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


class Replica:
    """One daemon replica: its own caches, claims, clients and metrics, as a second pod has."""

    def __init__(self, name: str, *, kubeapi: KubeApiServer, queue: SqsQueue, s3: Any, queue_url: str,
                 endpoint: str) -> None:
        self.name = name
        self.api = kubeapi.api_client()
        self.metrics = Metrics()
        self.cluster = KubeCluster(self.api, ray_control_factory=lambda addr, tok: RayGcs(addr, token=tok, timeout=LOCAL_BOUND_S),
                                   replica=name, options=FAST)
        claims = KubeLeaseClaims(self.api, namespace=DAEMON_NS)
        planner = CapacityPlanner(source=StaticCapacity([block()]),
                                  policy=CapacityPolicy(interruption_threshold=1))
        recovery = Recovery(
            cluster=self.cluster, claims=claims, ray_control=self.cluster.ray_control,
            store=S3Store(client=s3),
            mover=Mover(planner=planner, requeue=ReportingRequeuer(RequeueRouter(self.api), cluster=self.cluster,
                                                                   metrics=RequeueMetrics(self.metrics.registry)),
                        replacements=ReplacementAnnouncer(self.cluster.ray_control, priors={})),
            options=RecoveryOptions(durable_grace_seconds=30, durable_poll_seconds=0.2),
            metrics=RecoveryMetrics(self.metrics.registry))
        self.consumer = Consumer(
            queue=queue, responder=recovery, claims=claims,
            queue_settings=QueueSettings(queue_url=queue_url, region=REGION, endpoint_url=endpoint,
                                         wait_seconds=1, visibility_timeout=4, concurrency=4),
            intake_settings=IntakeSettings(), max_receive_count=5, metrics=self.metrics, replica=name)

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.value(name, **labels)


async def wait_for(predicate, *, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_two_replicas_drain_and_verify_each_run_once(ray_cluster: LocalRayCluster, aws: Any) -> None:
    worker = next(n for n in ray_cluster.workers if n.labels["resilienced.io/instance-id"] == instance(1))
    session = get_session()
    async with KubeApiServer(rbac=rbac()) as kubeapi, \
            session.create_client("sqs", region_name=REGION, endpoint_url=aws.endpoint_url) as sqs, \
            session.create_client("s3", region_name=REGION, endpoint_url=aws.endpoint_url) as s3:
        await s3.create_bucket(Bucket="ckpt")
        queue_url, dlq_url = await create_queue_with_dlq(sqs, name="interruptions", max_receive_count=5)
        seed_world(kubeapi, gcs_port=ray_cluster.gcs_port, token=ray_cluster.auth_token)
        gcs = RayGcs(ray_cluster.address, token=ray_cluster.auth_token, timeout=5)

        notice = body("EC2 Spot Instance Interruption Warning",
                      {"instance-id": instance(1), "instance-action": "terminate"},
                      when=datetime.now(timezone.utc))
        # EventBridge delivers at least once: the same event twice, and once more later
        for _ in range(2):
            await sqs.send_message(QueueUrl=queue_url, MessageBody=notice)

        async def drained() -> bool:
            return any(n.node_id == worker.node_id and n.draining_deadline_ms for n in await gcs.nodes())

        async def trainer_saves() -> None:
            await wait_for(drained, timeout=60, what="the worker's Ray node to be draining")
            await put_checkpoint(s3, step=41, saved=datetime.now(timezone.utc),
                                 files={"__0_0.distcp": b"a" * 300, "__1_0.distcp": b"b" * 200, ".metadata": b"m"})

        async with SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=aws.endpoint_url) as qa, \
                SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=aws.endpoint_url) as qb:
            replicas = [Replica(name, kubeapi=kubeapi, queue=q, s3=s3, queue_url=queue_url,
                                endpoint=aws.endpoint_url) for name, q in (("replica-a", qa), ("replica-b", qb))]
            loops = []
            try:
                with busy(ray_cluster, worker.node_id):  # a training worker keeps the node busy
                    for r in replicas:
                        await r.cluster.start()
                    loops = [asyncio.create_task(r.consumer.run(), name=f"loop-{r.name}") for r in replicas]
                    saver = asyncio.create_task(trainer_saves())

                    async def settled(n: int) -> bool:
                        return sum(r.count("resilienced_events_decided_total", kind="spot_interruption",
                                           outcome=o) for r in replicas for o in ("done", "duplicate")) >= n
                    await wait_for(lambda: settled(2), timeout=90, what="both copies to be settled")
                    await saver
                    await sqs.send_message(QueueUrl=queue_url, MessageBody=notice)  # a late redelivery
                    await wait_for(lambda: settled(3), timeout=30, what="the late copy to be settled")
                    nodes = {n.node_id: n for n in await gcs.nodes()}
            finally:
                for r in replicas:
                    r.consumer.stop()
                for loop in loops:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(loop, timeout=30)
                for r in replicas:
                    await r.cluster.stop()
                    await r.api.close()

        def total(name: str, **labels: str) -> float:
            return sum(r.count(name, **labels) for r in replicas)

        # acted on once: one done, two duplicates, across the two replicas
        assert total("resilienced_events_decided_total", kind="spot_interruption", outcome="done") == 1
        assert total("resilienced_events_decided_total", kind="spot_interruption", outcome="duplicate") == 2
        # drained once, by Ray's protocol, with the notice's deadline; verified once; requeued once
        assert total("resilienced_drains_total", outcome="accepted") == 1
        sent = datetime.strptime(json.loads(notice)["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
        assert nodes[worker.node_id].draining_deadline_ms == int(sent.timestamp() + 120) * 1000
        assert total("resilienced_checkpoints_total", outcome="durable") == 1
        assert total("resilienced_requeues_total", capacity="capacity-block") == 1
        events = kubeapi.list("events", namespace=None)
        for reason in ("Draining", "CheckpointDurable", "Requeued"):
            on_job = [e for e in events if e["reason"] == reason and e["involvedObject"]["kind"] == "RayJob"]
            assert len(on_job) == 1 and on_job[0].get("count", 1) == 1, (reason, on_job)
        job = kubeapi.get("rayjobs", "train", namespace=NS)
        assert all(g["template"]["spec"]["nodeSelector"].get("karpenter.k8s.aws/capacity-reservation-id") == BLOCK
                   for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
        leases = kubeapi.list("leases", namespace=DAEMON_NS)
        assert leases and all(l["metadata"]["annotations"].get("resilienced.io/state") == "done" for l in leases)
        left = await sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])
        assert left["Attributes"]["ApproximateNumberOfMessages"] == "0"
        dead = await sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["All"])
        assert dead["Attributes"]["ApproximateNumberOfMessages"] == "0"
