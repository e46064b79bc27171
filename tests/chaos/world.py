"""The reliability campaign's world: real daemon processes against local backends.

* moto server on 127.0.0.1 (SQS queue with a DLQ, S3 bucket of checkpoints), driven here with
  botocore over HTTP;
* the emulated Kubernetes API server (tests/support/kubeapi.py) with the manifests' RBAC, served
  from a thread of its own so the campaign can block on daemon output while it answers; the
  daemons reach it through a kubeconfig;
* ``resilienced run --mode kubernetes`` replicas as child processes (tests/intake/process.py),
  whose decision log lines, together with the emulator's objects and request log and moto's
  queue state, are what the campaign counts.

The runs live on Nodes whose Ray head pod is on the interrupted Node itself (a one-node gang): the
daemon then proceeds without the head's GCS (``gcs_error``), as it must when the head is going
away, so the campaign needs no Ray cluster. Ray's own drain protocol is exercised against a
real Ray cluster by tests/recovery/test_kubernetes_e2e.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import botocore.session

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from tests.intake.process import DaemonProcess
from tests.recovery.conftest import DAEMON_NS, REGION, node, pod_template, rbac
from tests.support.ec2blocks import Block, Ec2Blocks
from tests.support.faultproxy import FaultProxy
from tests.support.kubeapi import KubeApiServer, ResourceType

BUCKET = "ckpt"
ACCOUNT = "123456789012"
MAX_RECEIVES = 5


#: Karpenter's kinds as aws/karpenter-provider-aws v1.14.1 serves them (the version whose CRDs
#: tests/deploy/schemas vendors; pkg/apis/crds/karpenter.sh_nodepools.yaml,
#: karpenter.k8s.aws_ec2nodeclasses.yaml: cluster-scoped, status subresource); served by a world
#: made with ``karpenter=True``.
KARPENTER_RESOURCES = (
    ResourceType("karpenter.sh", ("v1",), "nodepools", "NodePool", namespaced=False),
    ResourceType("karpenter.k8s.aws", ("v1",), "ec2nodeclasses", "EC2NodeClass", namespaced=False),
)
#: The EC2NodeClass of the reserved NodePool selects Capacity Reservations by these tags
#: (spec.capacityReservationSelectorTerms); the daemons put them on a block they buy
#: (--purchase-tags), so Karpenter can launch into it.
BLOCK_TAGS = {"resilienced.io/pool": "training"}
NODECLASS = "reserved"


def karpenter_objects() -> list[dict[str, Any]]:
    """A NodePool that launches reserved capacity of the runs' type, and its EC2NodeClass (no block yet)."""
    return [
        {"apiVersion": "karpenter.sh/v1", "kind": "NodePool", "metadata": {"name": "reserved"},
         "spec": {"template": {"spec": {
             "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": NODECLASS},
             "requirements": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["reserved"]},
                              {"key": "node.kubernetes.io/instance-type", "operator": "In",
                               "values": ["p5.48xlarge"]}]}}}},
        {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": NODECLASS},
         "spec": {"amiSelectorTerms": [{"alias": "al2023@latest"}], "role": "KarpenterNodeRole",
                  "subnetSelectorTerms": [{"tags": {"karpenter.sh/discovery": "chaos"}}],
                  "securityGroupSelectorTerms": [{"tags": {"karpenter.sh/discovery": "chaos"}}],
                  "capacityReservationSelectorTerms": [{"tags": dict(BLOCK_TAGS)}]},
         "status": {"capacityReservations": []}},
    ]


def instance(n: int) -> str:
    return f"i-{0xc4a05000 + n:017x}"


class ThreadedKubeApi:
    """A :class:`KubeApiServer` on an event loop of its own thread; ``call`` runs on that loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kubeapi", daemon=True)
        self._thread.start()
        self.server: KubeApiServer = self._run(self._make())

    async def _make(self) -> KubeApiServer:
        return await KubeApiServer(rbac=rbac()).start()

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the server's loop; its result."""
        return self._run(coro)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the server's loop (its stores are not thread-safe)."""
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller
                done.set_exception(e)
        self.loop.call_soon_threadsafe(run)
        return done.result(timeout=60)

    def close(self) -> None:
        try:
            self._run(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


def _ray_spec() -> dict[str, Any]:
    return {"headGroupSpec": {"rayStartParams": {}, "template": pod_template()},
            "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                  "rayStartParams": {}, "template": pod_template()}]}


def run_objects(n: int, *, job_uid: str, head_ip: str = "127.0.0.1",
                reservation: str | None = None) -> list[dict[str, Any]]:
    """Run ``trial-n/train``: the Node, RayCluster and head pod of RayJob ``job_uid`` (:func:`run_job`).

    ``reservation``: the Node is Karpenter's reserved capacity in that Capacity Block (labels
    ``karpenter.sh/capacity-type=reserved``, ``karpenter.k8s.aws/capacity-reservation-id``).
    """
    ns = f"trial-{n}"
    spec = _ray_spec()
    # every run's Node is in the same pool (p5.48xlarge x us-east-1a): the replicas' in-memory
    # interruption histories of that pool differ, so a replica taking a run over after its requeue
    # must keep the move already applied rather than decide again (docs/reliability.md)
    host = node(f"node-{n}", instance(n), capacity="reserved" if reservation else "spot")
    if reservation:
        host["metadata"]["labels"]["karpenter.k8s.aws/capacity-reservation-id"] = reservation
    return [
        host,
        {"apiVersion": "ray.io/v1", "kind": "RayCluster",
         "metadata": {"name": "train-rc", "namespace": ns, "ownerReferences": [{
             "apiVersion": "ray.io/v1", "kind": "RayJob", "name": "train", "uid": job_uid,
             "controller": True, "blockOwnerDeletion": True}]},
         "spec": {"rayVersion": "2.60.0", **spec}, "status": {"state": "ready", "head": {"serviceIP": head_ip}}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "train-head", "namespace": ns, "labels": {
             "ray.io/cluster": "train-rc", "ray.io/node-type": "head", "ray.io/group": "headgroup",
             "ray.io/is-ray-node": "yes"}},
         "spec": {"nodeName": f"node-{n}", "containers": [{"name": "ray", "image": "rayproject/ray:2.60.0",
                                                          "ports": [{"name": "gcs-server", "containerPort": 9}]}]},
         "status": {"phase": "Running", "podIP": head_ip}},
    ]


def run_job(n: int) -> dict[str, Any]:
    spec = _ray_spec()
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": "train", "namespace": f"trial-{n}",
                         "annotations": {"resilienced.io/checkpoint-uri": f"s3://{BUCKET}/trial-{n}/train"}},
            "spec": {"entrypoint": "python -m trainer", "shutdownAfterJobFinishes": True, "rayClusterSpec": spec},
            "status": {"jobDeploymentStatus": "Running", "rayClusterName": "train-rc"}}


def read_dead_letters(sqs: Any, dlq_url: str, *, hidden_for_s: float) -> list[dict[str, Any]]:
    """Every message in the DLQ, each received once (with a long visibility, so each comes once).

    Read until every message the DLQ holds has been read, not only until the first empty
    receive: moto's redrive (``SQSBackend.receive_message`` in moto/sqs/models.py, moto 5.2.5:
    it checks that a message is visible, then its receive count) moves a message to the DLQ from
    one receive while another receive can have just taken it, and the moved message then stays
    hidden in the DLQ for that receive's visibility timeout (``hidden_for_s``: the replicas'
    ``--visibility-timeout``).  Bounded by a few of those timeouts; what is still
    hidden then is left out, and the caller's check names it missing.
    """
    got: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 3 * hidden_for_s + 10
    while True:
        batch = sqs.receive_message(QueueUrl=dlq_url, MaxNumberOfMessages=10, VisibilityTimeout=600,
                                    AttributeNames=["All"]).get("Messages", [])
        got.update({m["MessageId"]: m for m in batch})
        if batch:
            continue
        attrs = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["All"])["Attributes"]
        held = int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])
        if held <= len(got) or time.monotonic() > deadline:
            return list(got.values())
        time.sleep(0.5)


class World:
    """moto + emulated API + N daemon replicas; every process stopped by :meth:`close`."""

    def __init__(self, workdir: Path, *, moto: MotoServer | None = None, visibility: int = 4,
                 karpenter: bool = False) -> None:
        self.workdir = workdir
        self.visibility = visibility
        self._own_moto = moto is None
        self.moto = moto or MotoServer(log_path=workdir / "moto.log").start()
        if not self._own_moto:
            self.moto.reset()
        session = botocore.session.get_session()
        keys = {"aws_access_key_id": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "aws_secret_access_key": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
        self.sqs = session.create_client("sqs", region_name=REGION, endpoint_url=self.moto.endpoint_url, **keys)
        self.s3 = session.create_client("s3", region_name=REGION, endpoint_url=self.moto.endpoint_url, **keys)
        self.s3.create_bucket(Bucket=BUCKET)
        dlq = self.sqs.create_queue(QueueName="interruptions-dlq")["QueueUrl"]
        arn = self.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self.dlq_url = dlq
        self.queue_url = self.sqs.create_queue(QueueName="interruptions", Attributes={"RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": arn, "maxReceiveCount": str(MAX_RECEIVES)})})["QueueUrl"]
        self.kube = ThreadedKubeApi()
        # the daemons reach AWS through the fault proxy (scenario 2), which also answers the EC2
        # Capacity Block calls moto lacks, from ``self.ec2`` (no block, no offering until a
        # scenario adds them); its state lives on the kube loop (w.kube.call to change it)
        self.aws_proxy: FaultProxy = self.kube.run(FaultProxy(self.moto.endpoint_url).start())
        self.karpenter = karpenter
        self.ec2 = Ec2Blocks(on_active=self._karpenter_resolves)
        self.kube.call(self.ec2.install, self.aws_proxy)
        if karpenter:  # before any replica starts: kubernetes mode discovers the kinds at start
            for rtype in KARPENTER_RESOURCES:
                self.kube.call(self.kube.server.register, rtype)
            self.kube.call(self.kube.server.seed, *karpenter_objects())
        self.kubeconfig = self.kube.call(self.kube.server.write_kubeconfig, workdir / "kubeconfig")
        self.replicas: list[DaemonProcess] = []
        self.retired: list[DaemonProcess] = []
        self._counted: dict[int, int] = {}
        self._decided = 0

    # ------------------------------------------------------------------ daemons
    def start_replica(self, *extra: str, wait: bool = True) -> DaemonProcess:
        """One more replica; ``wait``: until it has logged ``started``."""
        env = dict(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION, PYTHONUNBUFFERED="1",  # as the image sets it
                   HOSTNAME=f"replica-{len(self.replicas) + len(self.retired)}")
        argv = ["-m", "resilienced", "run", "--queue-url", self.queue_url, "--region", REGION,
                "--endpoint-url", self.aws_proxy.url, "--mode", "kubernetes",
                "--kubeconfig", str(self.kubeconfig), "--claims-namespace", DAEMON_NS,
                "--kueue-api-version", "v1beta1", "--wait-seconds", "1",
                "--visibility-timeout", str(self.visibility), "--http-port", "0", "--http-host", "127.0.0.1",
                "--allowed-accounts", ACCOUNT, "--durable-poll-seconds", "0.2", *extra]
        daemon = DaemonProcess(argv, env=env)
        daemon.hostname = env["HOSTNAME"]  # type: ignore[attr-defined]  # the prefix of its claims' holder
        self.replicas.append(daemon)
        if wait:
            self.wait_started(daemon)
        return daemon

    def start_replicas(self, count: int, *extra: str) -> list[DaemonProcess]:
        """``count`` replicas started side by side (their imports overlap), each waited for."""
        daemons = [self.start_replica(*extra, wait=False) for _ in range(count)]
        for daemon in daemons:
            self.wait_started(daemon)
        return daemons

    @staticmethod
    def wait_started(daemon: DaemonProcess) -> None:
        daemon.wait_for(lambda lines: any(line.get("event") == "started" for line in lines), timeout=120)
        daemon.http_port = daemon.events("started")[0]["http_port"]  # type: ignore[attr-defined]

    @staticmethod
    def readyz(daemon: DaemonProcess) -> tuple[int, str]:
        """A replica's ``/readyz``: (HTTP status, the reason it gives; 0 and the error if no answer)."""
        port = getattr(daemon, "http_port", None)
        if port is None:
            return 0, "not started"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
                return answer.status, ""
        except urllib.error.HTTPError as e:
            try:
                return e.code, str(json.loads(e.read() or b"{}").get("reason", ""))
            except ValueError:
                return e.code, "(no JSON body)"
        except OSError as e:
            return 0, str(e)

    def kill(self, daemon: DaemonProcess) -> None:
        """SIGKILL: no shutdown path runs."""
        daemon.kill()
        while daemon._drain(0.05):  # keep what it wrote before dying
            pass
        self.replicas.remove(daemon)
        self.retired.append(daemon)

    def pump(self, seconds: float = 0.05) -> None:
        """Read every line the live replicas have written (waiting up to ``seconds`` for one)."""
        for daemon in self.replicas:
            daemon._drain(seconds / max(1, len(self.replicas)))
            daemon.read_available()

    def stop_replicas(self) -> None:
        """SIGTERM every live replica and read all it wrote (before the final counts).

        A replica restarted just before (``start_replica(wait=False)``) may still be in Python's
        start-up, where SIGTERM has its default action; it is waited for until it logged
        ``starting`` (its handlers are in place: from there on SIGTERM ends it with 0, also
        while it starts)."""
        for daemon in list(self.replicas):
            daemon.wait_for(lambda lines: any(line.get("event") == "starting" for line in lines), timeout=120)
            code = daemon.terminate(timeout=120)
            assert code == 0, f"replica exited {code} on SIGTERM:\n{daemon.stderr()[-3000:]}"
            self.replicas.remove(daemon)
            self.retired.append(daemon)

    def wait(self, condition: Callable[[], bool], *, timeout: float, what: str, every: float = 0.05) -> float:
        """Pump output until ``condition()`` holds; the seconds it took. Fails naming ``what``.

        ``condition`` is evaluated at most once per ``every`` seconds (moto answers a queue's
        attributes by scanning its messages: asking 20 times a second slows a big flood down).
        """
        start = time.monotonic()
        checked = 0.0
        while True:
            if time.monotonic() - checked >= every:
                if condition():
                    break
                checked = time.monotonic()
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
            for daemon in self.replicas:
                if daemon.proc.poll() is not None:
                    raise AssertionError(f"replica exited with {daemon.proc.returncode} while waiting "
                                         f"for {what}:\n{daemon.stderr()[-4000:]}")
            self.pump()
            time.sleep(0.05)  # leave the CPU (and the GIL: the emulated API server is a thread here)
        return time.monotonic() - start

    def decided(self) -> int:
        """How many decision lines the replicas have written (counted as they are read)."""
        for daemon in (*self.retired, *self.replicas):
            seen = self._counted.get(id(daemon), 0)
            self._decided += sum(1 for line in daemon.lines[seen:] if line.get("event") == "decision")
            self._counted[id(daemon)] = len(daemon.lines)
        return self._decided

    def decisions(self) -> list[dict[str, Any]]:
        return [line for d in (*self.retired, *self.replicas) for line in d.lines if line.get("event") == "decision"]

    # ------------------------------------------------------------------ Karpenter
    def _karpenter_resolves(self, block: Block) -> None:
        """Karpenter's part (on the kube loop): an active block carrying the EC2NodeClass's selector
        tags joins its ``status.capacityReservations`` (aws/karpenter-provider-aws v1.14.1
        pkg/providers/capacityreservation resolves capacityReservationSelectorTerms; the entry's
        fields: pkg/apis/v1/ec2nodeclass_status.go)."""
        if not self.karpenter or block.state != "active" or any(block.tags.get(k) != v for k, v in BLOCK_TAGS.items()):
            return
        current = self.kube.server.get("ec2nodeclasses.karpenter.k8s.aws", NODECLASS) or {}
        listed = list((current.get("status") or {}).get("capacityReservations") or [])
        if any(r.get("id") == block.reservation_id for r in listed):
            return
        listed.append({"id": block.reservation_id, "instanceType": block.instance_type,
                       "availabilityZone": block.availability_zone, "ownerID": ACCOUNT,
                       "instanceMatchCriteria": "targeted", "reservationType": "capacity-block",
                       "state": "active", "endTime": block.end.strftime("%Y-%m-%dT%H:%M:%SZ")})
        self.kube.server.patch("ec2nodeclasses.karpenter.k8s.aws", NODECLASS,
                               {"status": {"capacityReservations": listed}})

    # ------------------------------------------------------------------ backends
    def queue_counts(self, url: str | None = None) -> tuple[int, int]:
        attrs = self.sqs.get_queue_attributes(QueueUrl=url or self.queue_url, AttributeNames=["All"])["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])

    def dead_letters(self) -> list[dict[str, Any]]:
        """Every message in the DLQ (:func:`read_dead_letters`)."""
        return read_dead_letters(self.sqs, self.dlq_url, hidden_for_s=self.visibility)

    def send(self, bodies: list[str]) -> None:
        for start in range(0, len(bodies), 10):
            entries = [{"Id": str(i), "MessageBody": b} for i, b in enumerate(bodies[start:start + 10])]
            failed = self.sqs.send_message_batch(QueueUrl=self.queue_url, Entries=entries).get("Failed")
            assert not failed, failed

    def put_checkpoint(self, n: int, *, step: int, saved: datetime) -> None:
        """A whole checkpoint of run ``trial-n/train``: the files, then the manifest."""
        prefix = f"trial-{n}/train/step-{step}"
        files = {"__0_0.distcp": b"a" * 300, ".metadata": b"m"}
        for name, data in files.items():
            self.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
        manifest = {"format": "resilienced-checkpoint/1", "step": step, "world_size": 1,
                    "time": saved.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
                    "saved_at_unix": saved.timestamp(), "reason": "preemption",
                    "files": [{"path": k, "size": len(v), "sha256": hashlib.sha256(v).hexdigest()}
                              for k, v in files.items()]}
        self.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json", Body=json.dumps(manifest).encode())

    def seed_run(self, n: int, *, reservation: str | None = None) -> None:
        job = self.kube.call(self.kube.server.create, run_job(n))
        self.kube.call(self.kube.server.seed, *run_objects(n, job_uid=job["metadata"]["uid"], reservation=reservation))

    def run_events(self, n: int, reason: str) -> list[dict[str, Any]]:
        events = self.kube.call(self.kube.server.list, "events", namespace=f"trial-{n}")
        return [e for e in events if e.get("reason") == reason and e["involvedObject"]["kind"] == "RayJob"]

    def close(self) -> None:
        for daemon in [*self.replicas]:
            daemon.kill()
        self.kube.run(self.aws_proxy.stop())
        self.kube.close()
        if self._own_moto:
            self.moto.stop()


@contextmanager
def world(workdir: Path, **kwargs: Any) -> Iterator[World]:
    os.makedirs(workdir, exist_ok=True)
    w = World(workdir, **kwargs)
    try:
        yield w
    finally:
        w.close()


def expiry_notice(reservation_id: str, *, end: datetime, event_id: str, when: datetime) -> dict[str, Any]:
    """A Capacity Block Reservation Expiration Warning (EC2 User Guide, "Monitor Capacity Blocks
    using EventBridge"; the envelope as handlers/capacity_block_expiry.py reads it)."""
    return {"version": "0", "id": event_id, "detail-type": "Capacity Block Reservation Expiration Warning",
            "source": "aws.ec2", "account": ACCOUNT, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "region": REGION,
            "resources": [f"arn:aws:ec2:{REGION}:{ACCOUNT}:capacity-reservation/{reservation_id}"],
            "detail": {"capacity-reservation-id": reservation_id, "end-date": end.strftime("%Y-%m-%dT%H:%M:%SZ")}}


def notice(n: int, *, event_id: str, when: datetime, account: str = ACCOUNT, source: str = "aws.ec2",
           detail_type: str = "EC2 Spot Instance Interruption Warning") -> dict[str, Any]:
    return {"version": "0", "id": event_id, "detail-type": detail_type, "source": source, "account": account,
            "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "region": REGION, "resources": [],
            "detail": {"instance-id": instance(n), "instance-action": "terminate"}}
