"""The stage of the daemon's cluster tests: a training run on the real control plane, the daemon as
deployed beside it, and the trainer's part played by the test.

* :func:`queue_world` / :func:`node_world`: kwok Nodes of each capacity (Karpenter-labelled Spot,
  Capacity Block and On-Demand GPU nodes, an EKS node group's, a system node for the Ray head),
  Kueue's ResourceFlavors, a ClusterQueue and a LocalQueue named after the test's namespace;
* :func:`rayjob`: a RayJob as a user writes it (a head on the system node, one worker group of
  8-GPU workers), reconciled by the real KubeRay operator and, with a queue, admitted by the real
  Kueue;
* :class:`Daemon`: ``python -m tests.support.controlplane.daemon`` with ``resilienced run``'s
  flags, the ServiceAccount's token in its kubeconfig, moto for SQS and S3; the GCS of each
  RayCluster is the recording stand-in, its Ray nodes at the pods' real IPs (:meth:`Daemon.see`);
* :class:`Trainer`: what the trainer would write to S3: the checkpoint of the save the drain asked
  for (once the stand-in recorded the drain), and the resume record once the requeued pods run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3

from resilienced.local.aws import FAKE_CREDENTIALS
from tests.support.controlplane import ControlPlane
from tests.support.controlplane.world import (GPU, World, daemon_token, karpenter_labels, kwok_node,
                                              nodegroup_labels)
from trainer import resume

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"
BUCKET = "ckpt"
BLOCK = "cr-0aaaaaaaaaaaaaaa1"
SYSTEM = {"resilienced.test/role": "system"}
JsonObj = dict[str, Any]


def instance(n: int) -> str:
    return f"i-{n:017x}"


# --------------------------------------------------------------------------- nodes and queues
@dataclass
class Nodes:
    """The Nodes made, by name, and the instance id behind each."""

    instances: dict[str, str] = field(default_factory=dict)

    def instance_of(self, node: str) -> str:
        return self.instances[node]


_instances = itertools.count(0x5000)


def node_world(world: World, *, spot: int = 2, block: int = 2, on_demand: int = 0, shape: str = "karpenter") -> Nodes:
    """A system node and GPU nodes (8 GPUs each) of each capacity, in ``shape``'s labels:
    ``karpenter`` (Karpenter's well-known labels, no NodePool: the "neither" shape of
    docs/requeue.md) or ``eks-nodegroup`` (``eks.amazonaws.com/capacityType``)."""
    made = Nodes()
    ns = world.namespace
    specs: list[tuple[str, dict[str, str]]] = [(f"{ns}-sys", {**SYSTEM, **karpenter_labels("on-demand")})]
    for i in range(spot):
        specs.append((f"{ns}-spot-{i}", karpenter_labels("spot") if shape == "karpenter" else nodegroup_labels("SPOT")))
    for i in range(block):
        specs.append((f"{ns}-block-{i}", karpenter_labels("reserved", reservation=BLOCK) if shape == "karpenter"
                      else nodegroup_labels("CAPACITY_BLOCK", nodegroup="gpu-block")))
    for i in range(on_demand):
        specs.append((f"{ns}-od-{i}", karpenter_labels("on-demand") if shape == "karpenter"
                      else nodegroup_labels("ON_DEMAND", nodegroup="gpu-od")))
    nodes = []
    for name, labels in specs:
        made.instances[name] = instance(next(_instances))
        nodes.append(kwok_node(name, made.instances[name], labels, gpus=0 if name.endswith("-sys") else 8))
    world.nodes(*nodes)
    return made


FLAVOR_LABELS = {"spot": karpenter_labels("spot"), "block": {"karpenter.sh/capacity-type": "reserved",
                                                              "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"},
                 "od": karpenter_labels("on-demand")}


def queue_world(world: World, *, spot: int = 16, block: int = 16, od: int = 16, cohort: str | None = None) -> str:
    """ResourceFlavors, a ClusterQueue (GPU quota per flavor as given; cpu and memory on a flavor of
    no labels, as deploy/examples/kueue.yaml has it; in ``cohort`` when given) and a LocalQueue
    ``training``; the queue's name."""
    ns = world.namespace
    world.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                  "metadata": {"name": f"{ns}-default"}, "spec": {}})
    for name, labels in FLAVOR_LABELS.items():
        world.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                      "metadata": {"name": f"{ns}-{name}"}, "spec": {"nodeLabels": labels}})
    quota = {"spot": spot, "block": block, "od": od}
    cq: JsonObj = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
    if cohort:
        cq["cohortName"] = f"{ns}-{cohort}"
    world.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": f"{ns}-cq"},
                  "spec": {**cq,
                           "queueingStrategy": "BestEffortFIFO",
                           "resourceGroups": [
                               {"coveredResources": ["cpu", "memory"], "flavors": [{"name": f"{ns}-default", "resources": [
                                   {"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "10Ti"}]}]},
                               {"coveredResources": [GPU], "flavors": [
                                   {"name": f"{ns}-{name}", "resources": [{"name": GPU, "nominalQuota": str(quota[name])}]}
                                   for name in ("spot", "block", "od")]}]}})
    world.create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                  "metadata": {"name": "training"}, "spec": {"clusterQueue": f"{ns}-cq"}})
    return "training"


def rayjob(world: World, *, queue: str | None, workers: int = 2, selector: Mapping[str, str] | None = None,
           name: str = "train") -> JsonObj:
    """The run: a RayJob whose workers ask for 8 GPUs each; ``queue``: Kueue's LocalQueue (None: KubeRay
    alone, the workers' ``selector`` then says where they go)."""
    def container(kind: str, gpus: int) -> JsonObj:
        resources: JsonObj = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
        if gpus:
            resources["requests"][GPU] = resources["limits"][GPU] = str(gpus)
        return {"name": f"ray-{kind}", "image": "rayproject/ray:2.60.0", "resources": resources}

    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    worker_template: JsonObj = {"spec": {"containers": [container("worker", 8)]}}
    if selector:
        worker_template["spec"]["nodeSelector"] = dict(selector)
    return world.create({
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"resilienced.io/checkpoint-uri": f"s3://{BUCKET}/{world.namespace}/{name}"}},
        "spec": {"entrypoint": "python -m trainer",
                 # Kueue's webhook refuses a managed RayJob without it ("a kueue managed job should
                 # delete the cluster after finishing", v0.17.0 pkg/controller/jobs/rayjob)
                 "shutdownAfterJobFinishes": True,
                 "submitterPodTemplate": {"spec": {"restartPolicy": "Never", "nodeSelector": dict(SYSTEM),
                                                   "containers": [container("submitter", 0)]}},
                 "rayClusterSpec": {
                     "rayVersion": "2.60.0",
                     "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
                         "nodeSelector": dict(SYSTEM), "containers": [container("head", 0)]}}},
                     "workerGroupSpecs": [{"groupName": "gpu", "replicas": workers, "minReplicas": workers,
                                           "maxReplicas": workers, "rayStartParams": {},
                                           "template": worker_template}]}},
    })


def running_workers(world: World, *, count: int, cluster: str | None = None) -> list[JsonObj]:
    """Wait until ``count`` worker pods of the run's RayCluster run (kwok gave them IPs); them."""
    def ready() -> list[JsonObj] | None:
        selector = "ray.io/node-type=worker" + (f",ray.io/cluster={cluster}" if cluster else "")
        pods = [p for p in world.pods(selector) if not p["metadata"].get("deletionTimestamp")
                and p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return pods if len(pods) == count else None

    return world.wait(f"{count} worker pods Running", ready, timeout=120)


def raycluster_of(world: World, job: str = "train") -> JsonObj:
    def found() -> JsonObj | None:
        name = ((world.get("ray.io/v1", "rayjobs", job) or {}).get("status") or {}).get("rayClusterName")
        cluster = world.get("ray.io/v1", "rayclusters", name) if name else None
        head = ((cluster or {}).get("status") or {}).get("head") or {}
        return cluster if head.get("podIP") or head.get("serviceIP") else None

    return world.wait(f"the RayCluster of {job} with its head's address", found, timeout=120)


# --------------------------------------------------------------------------- the daemon
class Daemon:
    """One daemon replica (see the module docstring); ``start()``, ``stop()`` (SIGTERM), ``kill()``."""

    def __init__(self, *, plane: ControlPlane, world: World, aws: Any, queue_url: str, workdir: Path,
                 name: str = "replica-a", blocks: Iterable[JsonObj] = (), flags: Iterable[str] = ()) -> None:
        self.plane, self.world, self.aws, self.queue_url = plane, world, aws, queue_url
        self.name = name
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.stand_ins = workdir / "stand-ins.json"
        self.drains = workdir / "drains.jsonl"
        self.log = workdir / f"{name}.log"
        self._world: JsonObj = {"gcs": {"nodes": {}, "drains": str(self.drains)}, "blocks": list(blocks)}
        self._write()
        self.kubeconfig = plane.write_kubeconfig(workdir / f"{name}.kubeconfig", token=daemon_token(plane))
        self.flags = list(flags)
        self.proc: subprocess.Popen[bytes] | None = None

    def _write(self) -> None:
        tmp = self.stand_ins.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._world))
        tmp.replace(self.stand_ins)

    def see(self, cluster: JsonObj, pods: Iterable[JsonObj]) -> None:
        """The Ray side of a RayCluster: its GCS at the head's address, a Ray node per pod at its IP."""
        head = cluster["status"]["head"]
        nodes = []
        for pod in pods:
            ip = pod["status"]["podIP"]
            nodes.append({"node_id": hashlib.sha256(pod["metadata"]["uid"].encode()).hexdigest()[:56],
                          "address": ip, "is_head": pod["metadata"]["labels"].get("ray.io/node-type") == "head"})
        for host in {head.get("serviceIP"), head.get("podIP")} - {None, ""}:
            self._world["gcs"]["nodes"][f"{host}:6379"] = nodes
        self._write()

    def drained(self) -> list[JsonObj]:
        if not self.drains.exists():
            return []
        return [json.loads(line) for line in self.drains.read_text().splitlines() if line.strip()]

    def start(self) -> Daemon:
        env = {**os.environ, **FAKE_CREDENTIALS, "AWS_DEFAULT_REGION": REGION, "HOSTNAME": self.name,
               "PYTHONPATH": str(ROOT)}
        for key in [k for k in env if k.startswith("RESILIENCED_")]:
            env.pop(key)
        argv = [sys.executable, "-m", "tests.support.controlplane.daemon", "--stand-ins", str(self.stand_ins),
                "--mode", "kubernetes", "--kubeconfig", str(self.kubeconfig), "--queue-url", self.queue_url,
                "--region", REGION, "--endpoint-url", self.aws.endpoint_url, "--http-port", "0",
                "--http-host", "127.0.0.1", "--wait-seconds", "1", "--visibility-timeout", "30",
                "--durable-poll-seconds", "0.5", "--interruption-threshold", "1",
                "--follow-up-interval-seconds", "1", "--log-level", "info", *self.flags]
        self._log = open(self.log, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def lines(self) -> list[JsonObj]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines() if self.log.exists() else []:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""


# --------------------------------------------------------------------------- AWS and the trainer
@dataclass
class Aws:
    """moto's SQS (the interruption queue with its DLQ) and S3 (the checkpoint bucket), through boto3."""

    endpoint_url: str
    sqs: Any = None
    s3: Any = None
    queue_url: str = ""

    def open(self) -> Aws:
        kwargs = dict(region_name=REGION, endpoint_url=self.endpoint_url, aws_access_key_id="testing",
                      aws_secret_access_key="testing", aws_session_token="testing")
        self.sqs = boto3.client("sqs", **kwargs)
        self.s3 = boto3.client("s3", **kwargs)
        self.s3.create_bucket(Bucket=BUCKET)
        dlq = self.sqs.create_queue(QueueName="interruptions-dlq")["QueueUrl"]
        arn = self.sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self.queue_url = self.sqs.create_queue(QueueName="interruptions", Attributes={
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "5"})})["QueueUrl"]
        return self

    def notice(self, instance_id: str, *, when: datetime | None = None, event_id: str = "") -> str:
        """An EC2 Spot Instance Interruption Warning as EventBridge delivers it (shared/events/)."""
        when = when or datetime.now(timezone.utc)
        event_id = event_id or f"7e9d2f6c-0000-4000-8000-{int(time.time() * 1000) % 10**12:012d}"
        body = json.dumps({"version": "0", "id": event_id, "detail-type": "EC2 Spot Instance Interruption Warning",
                           "source": "aws.ec2", "account": "123456789012",
                           "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "region": REGION,
                           "resources": [f"arn:aws:ec2:{REGION}:123456789012:instance/{instance_id}"],
                           "detail": {"instance-id": instance_id, "instance-action": "terminate"}})
        self.sqs.send_message(QueueUrl=self.queue_url, MessageBody=body)
        return event_id

    def in_flight(self) -> int:
        attrs = self.sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]) + int(attrs["ApproximateNumberOfMessagesNotVisible"])


class Trainer:
    """The trainer's writes to S3 (as FSx exports them): a checkpoint and a resume record."""

    def __init__(self, aws: Aws, prefix: str) -> None:
        self.aws, self.prefix = aws, prefix

    def save(self, *, step: int, world_size: int = 2) -> None:
        """Every rank's shard of ``step``, then the manifest (trainer/manifest.py's format)."""
        files = {f"rank-{r}.pt": f"step {step} rank {r}".encode() for r in range(world_size)}
        for name, data in files.items():
            self.aws.s3.put_object(Bucket=BUCKET, Key=f"{self.prefix}/step-{step}/{name}", Body=data)
        now = datetime.now(timezone.utc)
        manifest = {"format": "resilienced-checkpoint/1", "step": step, "world_size": world_size,
                    "time": now.isoformat().replace("+00:00", "Z"), "saved_at_unix": now.timestamp(),
                    "reason": "preemption",
                    "files": [{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                              for n, d in files.items()]}
        self.aws.s3.put_object(Bucket=BUCKET, Key=f"{self.prefix}/step-{step}/manifest.json",
                               Body=json.dumps(manifest).encode())

    def resumed(self, *, step: int, world_size: int = 2) -> None:
        """The first step of a new attempt trained (trainer.resume)."""
        record = resume.ResumeRecord(attempt_id=resume.new_attempt_id(), resumed_from_step=step,
                                     first_step=step + 1, world_size=world_size, min_world_size=world_size,
                                     started_at_unix=time.time())
        self.aws.s3.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{resume.FOLDER}/{record.name}",
                               Body=json.dumps(record.as_json()).encode())


def wait(what: str, check: Callable[[], Any], *, timeout: float, daemons: Iterable[Daemon] = (),
         poll: float = 0.2) -> Any:
    """Poll ``check()`` until it returns a true value; fail naming ``what`` with the daemons' logs."""
    daemons = list(daemons)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    logs = "\n".join(f"--- {d.name} (alive: {d.alive()}) ---\n{d.tail()}" for d in daemons)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


def block(available: int = 2) -> JsonObj:
    """The Capacity Block EC2 lists (StandIns.capacity): two p5 instances, active, with room."""
    now = datetime.now(timezone.utc)
    return {"reservation_id": BLOCK, "instance_type": "p5.48xlarge", "availability_zone": "us-east-1a",
            "reservation_type": "capacity-block", "state": "active", "available_instances": available,
            "total_instances": 2, "start": (now - timedelta(hours=1)).isoformat(),
            "end": (now + timedelta(days=2)).isoformat()}
