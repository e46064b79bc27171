"""Burst benchmark (kubernetes mode): a mass Spot interruption through the real daemon path.

    python bench/burst.py [--nodes 500] [--clusters 50] [--concurrency 10] [--claims memory,lease]
    python bench/burst.py --quick          # 40 nodes, 4 clusters: a smoke run of a few seconds

The world: the emulated Kubernetes API (``tests.support.kubeapi.KubeApiServer``, real HTTP on
127.0.0.1, in a child process so that it does not share this process's GIL) holds ``--nodes``
Spot worker Nodes (``spec.providerID aws:///<az>/<instance-id>``, instance-type, zone and
``karpenter.sh/capacity-type`` labels) and ``--clusters`` RayClusters, each owned by a RayJob that
carries ``resilienced.io/checkpoint-uri``; each cluster has ``nodes / clusters`` worker pods, one
per worker Node, and a head pod on an On-Demand Node of its own (not interrupted), every pod with
its own IP.  moto (server mode, a child process) holds an SQS queue with a DLQ.

The burst: one EventBridge-shaped "EC2 Spot Instance Interruption Warning" per worker Node
(distinct ids, ``time`` now, so the deadline is 120 s ahead) is put on the queue with
SendMessageBatch, one run's notices after another (a Spot pool is reclaimed at once), then the real ``Consumer.run()`` starts (``--concurrency`` handlers, receives
of 10) with the real ``Recovery`` responder on a real ``KubeCluster`` (watch caches, a real
kubernetes_asyncio client over HTTP).  Per message: receive, decode, validate, parse, plan,
claim the event, locate (caches only, one GCS listing per RayCluster shared for 5 s), claim the
run, SIGNAL = cordon (a Node patch) + drain through ``KubeCluster.ray_control(target)`` + a
``Draining`` Event on the Node and on the RayJob, DURABLE skipped (``store=None``: a
``CheckpointNotDurable`` warning Event on the Node and the RayJob, no S3), REQUEUE skipped
(``planner=None``, ``requeue=None``: no API call), claims completed, message deleted.  Claims
are measured twice, each on a fresh emulator: ``MemoryClaims`` (one replica) and
``KubeLeaseClaims`` (Leases on the emulator, what a multi-replica deployment uses).

Not Ray: 50 Ray clusters cannot run on 2 cores, so the GCS is a recording stand-in behind the
``ports.RayControl`` protocol (like tests/kube/conftest.py's StaticGcs): a fixed node list per
cluster address mapping each pod IP to a Ray node id; ``drain`` records (node id, monotonic
time) and returns True.  This benchmark measures the daemon's side (SQS receive, parse, locate
through the watch caches, claims, cordon, drain dispatch, Events), not Ray's GCS.

Printed, per claims store: receive -> drain sent per instance (receive: the ReceiveMessage
call that delivered the notice returned; drain: the stand-in's ``drain`` was called), p50 / p99
/ max, the time from the consumer's start to the last drain, events/s, this process's CPU time
per event (moto and the emulator are other processes); the Kubernetes API calls
made during the burst by (verb, resource) from the emulator's request log, apart from the
constant cost of starting the caches (one list and one watch per cache); GCS node listings
against the floor of one per RayCluster.  The floor for the API is one call per drain (the
Node taint) and no read per event.

Baselines, measured in the same run.  The transport: the same notices drained from another queue
by a bare receive + delete loop of the consumer's shape; printed: the burst's wall time over
it.  Locate, on the same emulator through the same client: a naive
locate that asks the API server for every event -- ``list_node`` + ``list_pod_for_all_namespaces
(fieldSelector spec.nodeName=<node>)`` -- against ``KubeCluster.locate`` from the caches, both
sequential, one instance at a time.  Two naive variants: the Node by name (``fieldSelector
metadata.name=``, as if the Node name were known from the instance id: the naive path's best
case) and the whole Node list matched on providerID client-side (what a real API server needs:
``spec.providerID`` is not a supported field selector).  Printed: API calls and time per event
of each, and the ratios cached / naive.  Figures go to docs/benchmarks.md (## Burst (kubernetes
mode)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kubernetes_asyncio import client as k8s  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from resilienced import log  # noqa: E402
from resilienced.aws.sqs import SqsQueue  # noqa: E402
from resilienced.doubles import MemoryClaims  # noqa: E402
from resilienced.consumer.loop import Consumer  # noqa: E402
from resilienced.kube.cluster import KubeCluster, KubeOptions  # noqa: E402
from resilienced.kube.leases import KubeLeaseClaims  # noqa: E402
from resilienced.kube.api import call  # noqa: E402
from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer, create_queue_with_dlq  # noqa: E402
from resilienced.model import Result  # noqa: E402
from resilienced.ports import DrainResult, Message, RayNode  # noqa: E402
from resilienced.recovery.responder import Recovery, RecoveryMetrics  # noqa: E402
from resilienced.settings import IntakeSettings, QueueSettings  # noqa: E402

REGION = "us-east-1"
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c")
INSTANCE_TYPES = ("g5.2xlarge", "g5.4xlarge", "g6.2xlarge")
NAMESPACE = "ml"
LEASE_NAMESPACE = "resilienced"
GCS_PORT = 6379
BURST_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------- the world
@dataclass(frozen=True)
class Worker:
    instance_id: str
    node: str
    zone: str
    instance_type: str
    cluster: int
    pod: str
    ip: str
    ray_node_id: str


@dataclass(frozen=True)
class World:
    """Every object of the benchmark, computed the same way in this process and the emulator's."""

    workers: tuple[Worker, ...]
    clusters: int

    @staticmethod
    def build(*, nodes: int, clusters: int) -> World:
        workers = []
        for i in range(nodes):
            c, w = i % clusters, i // clusters
            workers.append(Worker(
                instance_id=f"i-{0x0b00000000000000 + i:017x}", node=f"ip-10-20-{i // 250}-{i % 250}.ec2.internal",
                zone=ZONES[c % len(ZONES)], instance_type=INSTANCE_TYPES[c % len(INSTANCE_TYPES)], cluster=c,
                pod=f"{cluster_name(c)}-workers-{w:03d}", ip=f"10.{20 + i // 62500}.{i // 250 % 250}.{i % 250 + 3}",
                ray_node_id=f"{i + 1:056x}",
            ))
        return World(workers=tuple(workers), clusters=clusters)

    def in_notice_order(self) -> list[Worker]:
        """One run's workers after another: a Spot capacity pool (one instance type in one AZ, where a
        gang is placed) is reclaimed at once, so a run's notices arrive together."""
        return sorted(self.workers, key=lambda w: (w.cluster, w.instance_id))

    def head_ip(self, c: int) -> str:
        return f"10.250.{c // 250}.{c % 250 + 3}"

    def address(self, c: int) -> str:
        return f"{self.head_ip(c)}:{GCS_PORT}"

    def ray_nodes(self) -> dict[str, list[RayNode]]:
        """What each cluster's GCS answers: its head and its workers, keyed by GCS address."""
        nodes: dict[str, list[RayNode]] = {
            self.address(c): [RayNode(node_id=f"{0xffff0000 + c:056x}", address=self.head_ip(c), labels={},
                                      alive=True, is_head=True)]
            for c in range(self.clusters)}
        for w in self.workers:
            nodes[self.address(w.cluster)].append(
                RayNode(node_id=w.ray_node_id, address=w.ip, labels={}, alive=True))
        return nodes

    def objects(self) -> list[dict[str, Any]]:
        """Nodes, pods and RayClusters (RayJobs are created first by ``seed``: their uid is needed)."""
        out: list[dict[str, Any]] = []
        for w in self.workers:
            out.append(node(name=w.node, instance_id=w.instance_id, zone=w.zone, instance_type=w.instance_type,
                            capacity_type="spot"))
            out.append(ray_pod(name=w.pod, cluster=cluster_name(w.cluster), node_name=w.node, ip=w.ip,
                               node_type="worker"))
        for c in range(self.clusters):
            head_node = f"ip-10-30-{c // 250}-{c % 250}.ec2.internal"
            out.append(node(name=head_node, instance_id=f"i-{0x0c00000000000000 + c:017x}", zone=ZONES[c % len(ZONES)],
                            instance_type="m6i.2xlarge", capacity_type="on-demand"))
            out.append(ray_pod(name=f"{cluster_name(c)}-head", cluster=cluster_name(c), node_name=head_node,
                               ip=self.head_ip(c), node_type="head"))
        return out


def cluster_name(c: int) -> str:
    return f"train-{c:03d}"


def node(*, name: str, instance_id: str, zone: str, instance_type: str, capacity_type: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "node.kubernetes.io/instance-type": instance_type,
                "topology.kubernetes.io/zone": zone, "topology.kubernetes.io/region": REGION,
                "karpenter.sh/capacity-type": capacity_type, "karpenter.sh/nodepool": "gpu"}},
            "spec": {"providerID": f"aws:///{zone}/{instance_id}"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def ray_pod(*, name: str, cluster: str, node_name: str, ip: str, node_type: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": f"ray-{node_type}", "image": "rayproject/ray:2.60.0"}
    if node_type == "head":
        container["ports"] = [{"name": "gcs-server", "containerPort": GCS_PORT}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {
                "ray.io/cluster": cluster, "ray.io/node-type": node_type, "ray.io/is-ray-node": "yes",
                "ray.io/group": "headgroup" if node_type == "head" else "workers"}},
            "spec": {"nodeName": node_name, "containers": [container]},
            "status": {"phase": "Running", "podIP": ip}}


def seed(server: Any, world: World) -> None:
    """RayJobs, then their RayClusters (owner reference with the job's uid), then Nodes and pods."""
    for c in range(world.clusters):
        name = cluster_name(c)
        job = server.create({
            "apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "annotations": {"resilienced.io/checkpoint-uri": f"s3://ckpt/{name}"}},
            "spec": {"entrypoint": "python -m trainer", "shutdownAfterJobFinishes": True},
            "status": {"jobDeploymentStatus": "Running", "rayClusterName": name}})
        server.create({
            "apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": name, "namespace": NAMESPACE, "ownerReferences": [{
                "apiVersion": "ray.io/v1", "kind": "RayJob", "name": name, "uid": job["metadata"]["uid"],
                "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"rayVersion": "2.60.0", "headGroupSpec": {"rayStartParams": {}}, "workerGroupSpecs": []},
            "status": {"state": "ready", "head": {"podIP": world.head_ip(c)}}})
    for obj in world.objects():
        server.create(obj)


# --------------------------------------------------------------------------- the emulator, in a child process
def serve_kubeapi(conn: Any, nodes: int, clusters: int) -> None:
    """Child process: the emulated API server, seeded; answers ``log`` and ``stop`` on ``conn``."""
    asyncio.run(_serve_kubeapi(conn, World.build(nodes=nodes, clusters=clusters)))


async def _serve_kubeapi(conn: Any, world: World) -> None:
    from tests.support.kubeapi import KubeApiServer

    server = KubeApiServer()
    seed(server, world)
    await server.start()
    loop = asyncio.get_running_loop()
    try:
        conn.send(server.port)
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "log":
                conn.send([(r.verb, r.resource, r.status) for r in server.requests])
            elif command == "events":  # the core/v1 Events stored: (reason, object kind, count)
                conn.send([(e.get("reason"), (e.get("involvedObject") or {}).get("kind"), e.get("count") or 1)
                           for e in server.list("events")])
            elif command == "stop":
                break
    except EOFError:  # the benchmark went away
        pass
    finally:
        await server.stop()


class Emulator:
    """The emulated API server in a spawned child process; ``stop`` (idempotent) ends it for certain."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._proc: Any = None
        self._conn: Any = None
        self.url = ""
        self._seen = 0

    def start(self) -> Emulator:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve_kubeapi, args=(child, len(self.world.workers), self.world.clusters),
                                 name="kubeapi-emulator", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(120):
            raise RuntimeError("the emulated API server did not start within 120 s")
        self.url = f"http://127.0.0.1:{self._conn.recv()}"
        return self

    def log(self) -> list[tuple[str, str, int]]:
        self._conn.send("log")
        return self._conn.recv()

    def events(self) -> list[tuple[str, str, int]]:
        self._conn.send("events")
        return self._conn.recv()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            self._conn.send("stop")
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        self._conn.close()

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- the GCS stand-in
class RecordingGcs:
    """``ray_control_factory``: one control per (address, token) over the world's fixed node lists."""

    def __init__(self, nodes: dict[str, list[RayNode]]) -> None:
        self.nodes = nodes
        self.drains: list[tuple[str, float]] = []  # (Ray node id, time.monotonic())
        self.listings = 0

    def __call__(self, address: str, token: str | None) -> RecordingControl:
        return RecordingControl(self, address)


class RecordingControl:
    """``ports.RayControl`` for one cluster: ``nodes`` answers the fixed list, ``drain`` records."""

    def __init__(self, gcs: RecordingGcs, address: str) -> None:
        self._gcs, self.address = gcs, address

    async def nodes(self) -> list[RayNode]:
        self._gcs.listings += 1
        return list(self._gcs.nodes.get(self.address, []))

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        self._gcs.drains.append((node_id, time.monotonic()))
        return DrainResult(node_id, "drained", True, int(deadline.timestamp() * 1000))


# --------------------------------------------------------------------------- SQS
class TimedQueue:
    """The real SqsQueue; records when the receive that first delivered each instance's notice returned."""

    def __init__(self, queue: SqsQueue) -> None:
        self._queue = queue
        self.received: dict[str, float] = {}  # instance id -> monotonic time of its first receive
        self.receive_seconds: list[float] = []
        self.deliveries = 0

    async def receive(self, *, max_messages: int, wait_seconds: int, visibility_timeout: int) -> list[Message]:
        start = time.monotonic()
        messages = await self._queue.receive(max_messages=max_messages, wait_seconds=wait_seconds,
                                             visibility_timeout=visibility_timeout)
        now = time.monotonic()
        self.receive_seconds.append(now - start)
        for message in messages:
            self.deliveries += 1
            self.received.setdefault(json.loads(message.body)["detail"]["instance-id"], now)
        return messages

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def notice(instance_id: str, when: datetime) -> str:
    """An EventBridge Spot interruption warning, as SQS delivers it."""
    return json.dumps({
        "version": "0", "id": str(uuid.uuid4()), "detail-type": "EC2 Spot Instance Interruption Warning",
        "source": "aws.ec2", "account": "123456789012", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": REGION, "resources": [f"arn:aws:ec2:{REGION}a:instance/{instance_id}"],
        "detail": {"instance-id": instance_id, "instance-action": "terminate"}})


# --------------------------------------------------------------------------- one burst
@dataclass
class Burst:
    """The figures of one burst."""

    claims: str
    events: int
    drains: int = 0  # distinct Ray nodes drained
    drain_calls: int = 0
    latencies: list[float] = field(default_factory=list)  # receive -> first drain, per instance
    to_last_drain_s: float = float("nan")
    to_all_settled_s: float = float("nan")
    results: Counter[str] = field(default_factory=Counter)
    deliveries: int = 0
    receives: int = 0
    receive_mean_s: float = 0.0
    startup_calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    burst_calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    burst_errors: Counter[str] = field(default_factory=Counter)
    gcs_listings: int = 0
    cpu_s: float = 0.0  # this process's CPU time from the consumer's start to all settled
    warnings: Counter[str] = field(default_factory=Counter)
    events_recorded: dict[str, dict[str, int]] = field(default_factory=dict)  # "reason on Kind" -> objects, count

    @property
    def api_calls(self) -> int:
        return sum(self.burst_calls.values())


@dataclass
class Stack:
    """What one burst leaves running for the locate comparison; ``close`` stops it."""

    emulator: Emulator
    api: k8s.ApiClient
    kube: KubeCluster
    gcs: RecordingGcs  # the KubeCluster's GCS controls: it counts their node listings

    async def close(self) -> None:
        try:
            await self.kube.stop()
            await self.api.close()
        finally:
            self.emulator.stop()


async def wait_for(predicate: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


async def start_stack(world: World, gcs: RecordingGcs, *, replica: str) -> tuple[Stack, Counter[tuple[str, str]]]:
    """A fresh emulator and KubeCluster with its caches synced; the calls that start-up cost."""
    emulator = Emulator(world).start()
    api = k8s.ApiClient(k8s.Configuration(host=emulator.url))
    kube = KubeCluster(api, ray_control_factory=gcs, replica=replica, options=KubeOptions())
    stack = Stack(emulator=emulator, api=api, kube=kube, gcs=gcs)
    try:
        await kube.start()
        await kube.caches.wait_ready(timeout=60)
        await wait_for(lambda: sum(1 for v, _, _ in emulator.log() if v == "watch") >= len(kube.caches.informers),
                       timeout=30, what="one watch per cache")
        return stack, Counter((v, r) for v, r, _ in emulator.log())
    except BaseException:
        await stack.close()
        raise


async def run_burst(*, world: World, sqs: Any, endpoint: str, claims_kind: str, concurrency: int,
                    log_dir: Path) -> tuple[Burst, Stack]:
    """Queue one notice per worker Node, then run the consumer until every message is settled."""
    events = len(world.workers)
    result = Burst(claims=claims_kind, events=events)
    queue_url, _dlq = await create_queue_with_dlq(sqs, name=f"burst-{claims_kind}-{uuid.uuid4().hex[:6]}")
    now = datetime.now(timezone.utc)
    bodies = [notice(w.instance_id, now) for w in world.in_notice_order()]
    for start in range(0, len(bodies), 10):
        await sqs.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(n), "MessageBody": body} for n, body in enumerate(bodies[start:start + 10])])

    gcs = RecordingGcs(world.ray_nodes())
    replica = f"bench-{claims_kind}"
    stack, result.startup_calls = await start_stack(world, gcs, replica=replica)
    try:
        log_path = log_dir / f"{claims_kind}.jsonl"
        before = len(stack.emulator.log())
        claims = (MemoryClaims() if claims_kind == "memory"
                  else KubeLeaseClaims(stack.api, namespace=LEASE_NAMESPACE))
        recovery = Recovery(cluster=stack.kube, claims=claims, ray_control=stack.kube.ray_control, store=None,
                            mover=None, metrics=RecoveryMetrics(CollectorRegistry()))
        settings = QueueSettings(queue_url=queue_url, region=REGION, endpoint_url=endpoint, wait_seconds=1,
                                 batch_size=10, concurrency=concurrency, visibility_timeout=60)
        settled: list[Result] = []
        done = asyncio.Event()

        def observe(message: Message, outcome: Any, verdict: Any, latency: float) -> None:
            settled.append(outcome.result)
            if len(settled) >= events:
                done.set()

        with log_path.open("w") as log_file:  # noqa: ASYNC230 - opened once, before the clock starts
            log.configure(level="info", stream=log_file)  # every line rendered, read back for warnings
            try:
                started, queue = await consume(
                    queue_url=queue_url, endpoint=endpoint, recovery=recovery, claims=claims, settings=settings,
                    observe=observe, done=done, replica=replica, result=result)
            finally:
                log.configure(level="warning", stream=sys.stderr)
        calls = stack.emulator.log()[before:]
        result.burst_calls = Counter((v, r) for v, r, _ in calls)
        result.burst_errors = Counter(f"{v} {r} {s}" for v, r, s in calls if s >= 400)
        result.gcs_listings = stack.gcs.listings
        for reason, kind, count in stack.emulator.events():
            row = result.events_recorded.setdefault(f"{reason} on {kind}", {"objects": 0, "count": 0})
            row["objects"] += 1
            row["count"] += count
        result.results = Counter(r.value for r in settled)
        result.receives, result.deliveries = len(queue.receive_seconds), queue.deliveries
        result.receive_mean_s = statistics.fmean(queue.receive_seconds)
        result.drain_calls = len(gcs.drains)
        first_drain: dict[str, float] = {}
        for node_id, at in gcs.drains:
            first_drain.setdefault(node_id, at)
        result.drains = len(first_drain)
        instance_of = {w.ray_node_id: w.instance_id for w in world.workers}
        result.latencies = sorted(at - queue.received[instance_of[n]] for n, at in first_drain.items())
        if first_drain:
            result.to_last_drain_s = max(first_drain.values()) - started
        result.warnings = warnings(log_path)
        return result, stack
    except BaseException:
        await stack.close()
        raise


async def consume(*, queue_url: str, endpoint: str, recovery: Recovery, claims: Any, settings: QueueSettings,
                  observe: Any, done: asyncio.Event, replica: str, result: Burst) -> tuple[float, TimedQueue]:
    """``Consumer.run()`` until ``done``; then stop it (it finishes what is in flight)."""
    async with SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=endpoint,
                             max_connections=settings.concurrency * 2 + 4) as sqs_queue:
        queue = TimedQueue(sqs_queue)
        consumer = Consumer(queue=queue, responder=recovery, claims=claims, queue_settings=settings,
                            intake_settings=IntakeSettings(), max_receive_count=3, observer=observe,
                            replica=replica)
        cpu = time.process_time()
        started = time.monotonic()
        loop = asyncio.create_task(consumer.run(), name="bench.consumer")
        try:
            await asyncio.wait_for(done.wait(), BURST_TIMEOUT_S)
            result.to_all_settled_s = time.monotonic() - started
            result.cpu_s = time.process_time() - cpu
        finally:
            consumer.stop()
            await loop
    return started, queue


def warnings(log_path: Path) -> Counter[str]:
    """Warning and error lines the daemon logged, by message."""
    counts: Counter[str] = Counter()
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("warning", "error", "critical"):
            counts[str(entry.get("event"))] += 1
    return counts


# --------------------------------------------------------------------------- the transport's limit
async def sqs_baseline(*, sqs: Any, endpoint: str, bodies: Sequence[str], concurrency: int) -> dict[str, Any]:
    """The same burst drained by a bare receive + delete loop: what moto's SQS allows this consumer's shape.

    Like the consumer: receive up to min(10, free slots) when a slot is free, delete each message
    in its own task, at most ``concurrency`` in flight.
    """
    queue_url, _dlq = await create_queue_with_dlq(sqs, name=f"burst-baseline-{uuid.uuid4().hex[:6]}")
    for start in range(0, len(bodies), 10):
        await sqs.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(n), "MessageBody": body} for n, body in enumerate(bodies[start:start + 10])])
    receive_seconds: list[float] = []
    async with SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=endpoint,
                             max_connections=concurrency * 2 + 4) as queue:
        pending: set[asyncio.Task[None]] = set()
        freed = asyncio.Event()
        taken = 0

        def finished(task: asyncio.Task[None]) -> None:
            pending.discard(task)
            freed.set()

        start = time.monotonic()
        while taken < len(bodies):
            free = concurrency - len(pending)
            if free <= 0:
                freed.clear()
                await freed.wait()
                continue
            t = time.monotonic()
            messages = await queue.receive(max_messages=min(10, free), wait_seconds=1, visibility_timeout=60)
            receive_seconds.append(time.monotonic() - t)
            for message in messages:
                taken += 1
                task = asyncio.create_task(queue.delete(message))
                pending.add(task)
                task.add_done_callback(finished)
        await asyncio.gather(*pending)
        total = time.monotonic() - start
    return {"events": len(bodies), "total_s": round(total, 3), "events_per_s": round(len(bodies) / total, 1),
            "sqs_receives": len(receive_seconds),
            "sqs_receive_mean_ms": round(statistics.fmean(receive_seconds) * 1000, 1)}


# --------------------------------------------------------------------------- the baseline: naive locate
async def compare_locate(*, world: World, stack: Stack) -> dict[str, Any]:
    """Per instance, sequentially: locate from the caches vs. asking the API server (two variants)."""
    core = k8s.CoreV1Api(stack.api)
    emulator, kube = stack.emulator, stack.kube
    out: dict[str, Any] = {}

    async def cached(w: Worker) -> None:
        location = await kube.locate(instance_ids=[w.instance_id])
        assert [t.ray_node_ids for t in location.targets] == [(w.ray_node_id,)], location

    async def naive_by_name(w: Worker) -> None:
        nodes = await call(verb="list", resource="nodes", request=core.list_node(
            field_selector=f"metadata.name={w.node}", _preload_content=False))
        assert [n["spec"]["providerID"].rsplit("/", 1)[-1] for n in nodes["items"]] == [w.instance_id]
        await pods_on(w)

    async def naive_full_list(w: Worker) -> None:
        nodes = await call(verb="list", resource="nodes", request=core.list_node(_preload_content=False))
        found = [n for n in nodes["items"] if n["spec"].get("providerID", "").endswith("/" + w.instance_id)]
        assert [n["metadata"]["name"] for n in found] == [w.node]
        await pods_on(w)

    async def pods_on(w: Worker) -> None:
        pods = await call(verb="list", resource="pods", request=core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={w.node}", label_selector="ray.io/node-type", _preload_content=False))
        assert [p["metadata"]["name"] for p in pods["items"]] == [w.pod]

    for name, locate in (("cached", cached), ("naive_by_name", naive_by_name), ("naive_full_list", naive_full_list)):
        before, gcs_before = len(emulator.log()), stack.gcs.listings
        times = []
        cpu = time.process_time()
        start = time.perf_counter()
        for w in world.workers:
            t = time.perf_counter()
            await locate(w)
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        cpu = time.process_time() - cpu
        calls = emulator.log()[before:]
        out[name] = {"events": len(times), "total_s": total, "mean_s": statistics.fmean(times),
                     "client_cpu_ms_per_event": round(cpu / len(times) * 1000, 3),
                     "p50_s": percentile(times, 50), "p99_s": percentile(times, 99),
                     "api_calls": len(calls), "api_calls_per_event": len(calls) / len(times),
                     "calls": {f"{v} {r}": n for (v, r), n in sorted(Counter((v, r) for v, r, _ in calls).items())},
                     "gcs_listings": stack.gcs.listings - gcs_before}
    return out


# --------------------------------------------------------------------------- report
def percentile(values: Sequence[float], q: int) -> float:
    """Nearest-rank-free inclusive percentile (as bench/intake.py)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def group_calls(calls: Counter[tuple[str, str]]) -> dict[str, int]:
    """Burst calls by purpose: reads, the Node taint, Events, Leases, anything else."""
    groups: Counter[str] = Counter()
    for (verb, resource), n in calls.items():
        if verb in ("get", "list", "watch"):
            groups[f"reads ({resource})" if resource not in ("leases.coordination.k8s.io", "events") else
                   ("lease reads" if resource.startswith("leases") else "event reads")] += n
        elif resource == "nodes":
            groups["node taints (cordon)"] += n
        elif resource == "events":
            groups["event writes"] += n
        elif resource.startswith("leases"):
            groups["lease writes"] += n
        else:
            groups[f"other ({verb} {resource})"] += n
    return dict(sorted(groups.items()))


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {"arch": platform.machine(), "nproc": os.cpu_count(), "cpu": model,
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "load_average_1m": round(load, 2)}


def burst_json(b: Burst) -> dict[str, Any]:
    lat = b.latencies or [float("nan")]
    return {
        "claims": b.claims, "events": b.events, "drains": b.drains, "drain_calls": b.drain_calls,
        "receive_to_drain_p50_ms": round(percentile(lat, 50) * 1000, 1),
        "receive_to_drain_p99_ms": round(percentile(lat, 99) * 1000, 1),
        "receive_to_drain_max_ms": round(max(lat) * 1000, 1),
        "start_to_last_drain_s": round(b.to_last_drain_s, 3),
        "start_to_all_settled_s": round(b.to_all_settled_s, 3),
        "events_per_s": round(b.events / b.to_last_drain_s, 1),
        "daemon_cpu_ms_per_event": round(b.cpu_s / b.events * 1000, 2),
        "results": dict(b.results), "sqs_receives": b.receives, "sqs_deliveries": b.deliveries,
        "sqs_receive_mean_ms": round(b.receive_mean_s * 1000, 1),
        "startup_api_calls": {f"{v} {r}": n for (v, r), n in sorted(b.startup_calls.items())},
        "api_calls": b.api_calls,
        "api_calls_per_drain": round(b.api_calls / b.drains, 2) if b.drains else None,
        "api_floor_per_drain": 1,
        "api_reads_per_drain": round(sum(n for (v, _), n in b.burst_calls.items()
                                         if v in ("get", "list", "watch")) / max(1, b.drains), 2),
        "api_calls_by_verb_resource": {f"{v} {r}": n for (v, r), n in sorted(b.burst_calls.items())},
        "api_calls_by_purpose": group_calls(b.burst_calls),
        "api_errors": dict(b.burst_errors),
        "events_recorded": b.events_recorded,
        "gcs_listings": b.gcs_listings,
        "daemon_warnings": dict(b.warnings),
    }


def print_report(*, args: argparse.Namespace, world: World, bursts: list[Burst], locate: dict[str, Any],
                 transport: dict[str, Any]) -> dict[str, Any]:
    m = machine()
    n = len(world.workers)
    print(f"machine: {m['arch']}, nproc {m['nproc']}, {m['cpu']}, {m['python']}, load {m['load_average_1m']}; "
          "moto, the emulated API server and the daemon each in their own process on this machine")
    print(f"world: {n} Spot worker Nodes + {world.clusters} head Nodes, {world.clusters} RayClusters (RayJob-owned) "
          f"x {n // world.clusters}{'+' if n % world.clusters else ''} workers; {n} Spot ITN notices queued "
          f"up front; concurrency {args.concurrency}, receives of 10; GCS: recording stand-in")
    print()
    print("| claims | drains / events | p50 receive->drain | p99 | max | start->last drain | events/s "
          f"| daemon CPU per event | k8s API calls (burst) | per drain (floor 1) | GCS listings (floor {world.clusters}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs = {}
    for b in bursts:
        j = burst_json(b)
        runs[b.claims] = j
        print(f"| {b.claims} | {b.drains} / {b.events} | {j['receive_to_drain_p50_ms']:.0f} ms "
              f"| {j['receive_to_drain_p99_ms']:.0f} ms | {j['receive_to_drain_max_ms']:.0f} ms "
              f"| {j['start_to_last_drain_s']:.2f} s | {j['events_per_s']:.0f} | {j['daemon_cpu_ms_per_event']:.1f} ms "
              f"| {b.api_calls} "
              f"| {j['api_calls_per_drain']} | {b.gcs_listings} |")
    print(f"| bare SQS receive+delete of the same burst (baseline: the transport) | - | - | - | - "
          f"| {transport['total_s']:.2f} s | {transport['events_per_s']:.0f} | - | - | - | - |")
    for b in bursts:
        runs[b.claims]["wall_over_bare_sqs"] = round(b.to_all_settled_s / transport["total_s"], 2)
        print(f"ratio {b.claims} burst (start -> all settled) / bare SQS: {runs[b.claims]['wall_over_bare_sqs']:.2f} "
              f"(SQS receives: {b.receives} of {b.receive_mean_s * 1000:.0f} ms mean in the burst, "
              f"{transport['sqs_receives']} of {transport['sqs_receive_mean_ms']:.0f} ms bare)")
    print()
    for b in bursts:
        j = runs[b.claims]
        print(f"{b.claims}: Events stored (objects, summed count) {j['events_recorded']}")
        print(f"{b.claims}: burst calls by purpose {j['api_calls_by_purpose']}")
        print(f"{b.claims}: by verb/resource {j['api_calls_by_verb_resource']}; errors {j['api_errors'] or 'none'}")
        print(f"{b.claims}: start-up (constant) {j['startup_api_calls']}; results {j['results']}; "
              f"SQS receives {j['sqs_receives']} (mean {j['sqs_receive_mean_ms']:.0f} ms), deliveries "
              f"{j['sqs_deliveries']}; daemon warnings {j['daemon_warnings'] or 'none'}")
    print()
    print("locate, sequential, per event (same emulator, same client):")
    print("| path | API calls per event | mean | p50 | p99 | client CPU per event | GCS listings |")
    print("|---|---|---|---|---|---|---|")
    labels = {"cached": "KubeCluster.locate (watch caches)",
              "naive_by_name": "naive: list_node(metadata.name=) + list pods(spec.nodeName=)",
              "naive_full_list": "naive: list_node() matched on providerID + list pods(spec.nodeName=)"}
    for key, row in locate.items():
        print(f"| {labels[key]} | {row['api_calls_per_event']:.2f} | {row['mean_s'] * 1000:.2f} ms "
              f"| {row['p50_s'] * 1000:.2f} ms | {row['p99_s'] * 1000:.2f} ms "
              f"| {row['client_cpu_ms_per_event']:.2f} ms | {row['gcs_listings']} |")
    ratios = {}
    for naive in ("naive_by_name", "naive_full_list"):
        ratios[f"time_cached_over_{naive}"] = round(locate["cached"]["mean_s"] / locate[naive]["mean_s"], 4)
        ratios[f"calls_cached_over_{naive}"] = round(
            locate["cached"]["api_calls_per_event"] / locate[naive]["api_calls_per_event"], 4)
    print(f"ratio cached / naive (by name): time {ratios['time_cached_over_naive_by_name']:.3f}, "
          f"API calls {ratios['calls_cached_over_naive_by_name']:.2f}; "
          f"cached / naive (full list): time {ratios['time_cached_over_naive_full_list']:.3f}, "
          f"API calls {ratios['calls_cached_over_naive_full_list']:.2f}")
    summary = {
        "bench": "burst", "mode": "kubernetes", "nodes": n, "clusters": world.clusters,
        "concurrency": args.concurrency, "events": n,
        "drains": min(b.drains for b in bursts),  # every claims store's run drained this many
        "runs": runs, "bare_sqs": transport, "locate": locate, "locate_ratios": ratios, "machine": m,
    }
    print(json.dumps(summary, sort_keys=False))
    return summary


# --------------------------------------------------------------------------- main
async def measure(args: argparse.Namespace, world: World, endpoint: str, log_dir: Path) -> None:
    bursts: list[Burst] = []
    locate: dict[str, Any] = {}
    session = get_session()
    async with session.create_client("sqs", region_name=REGION, endpoint_url=endpoint) as sqs:
        now = datetime.now(timezone.utc)
        transport = await sqs_baseline(sqs=sqs, endpoint=endpoint, concurrency=args.concurrency,
                                       bodies=[notice(w.instance_id, now) for w in world.in_notice_order()])
        for kind in args.claims:
            result, stack = await run_burst(world=world, sqs=sqs, endpoint=endpoint, claims_kind=kind,
                                            concurrency=args.concurrency, log_dir=log_dir)
            try:
                bursts.append(result)
                if not locate:
                    locate = await compare_locate(world=world, stack=stack)
            finally:
                await stack.close()
    print_report(args=args, world=world, bursts=bursts, locate=locate, transport=transport)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500, help="Spot worker Nodes = notices = drains")
    parser.add_argument("--clusters", type=int, default=50, help="RayClusters (the workers spread over them)")
    parser.add_argument("--concurrency", type=int, default=10, help="messages handled at once")
    parser.add_argument("--claims", default="memory,lease", help="claim stores to measure: memory, lease")
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 nodes, 4 clusters")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.clusters = 40, 4
    args.claims = [c.strip() for c in args.claims.split(",") if c.strip()]
    if not args.claims or set(args.claims) - {"memory", "lease"}:
        parser.error("--claims: memory and/or lease")
    if args.nodes < 1 or not 1 <= args.clusters <= args.nodes:
        parser.error("need 1 <= --clusters <= --nodes")
    os.environ.update(FAKE_CREDENTIALS)
    world = World.build(nodes=args.nodes, clusters=args.clusters)
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp, MotoServer() as moto:
        asyncio.run(measure(args, world, moto.endpoint_url, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
