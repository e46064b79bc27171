"""A small world for the responder: KubeRay objects on the emulated API server, S3 on moto.

The emulated API server enforces exactly the RBAC of ``resilienced.ops.permissions`` (the ClusterRole
plus the daemon-namespace Role and a token Role in the run's namespace), so every test here also
proves that the daemon's whole path needs no more than the manifests grant.  The world has one
RayJob (``ml/train``, annotated with its checkpoint URI) owning a RayCluster (``ml/train-rc``)
with a head on node ``n0`` and two workers on ``n1``/``n2``; the Nodes carry the Karpenter and
well-known labels the capacity decision reads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pytest
from aiobotocore.session import get_session

from resilienced.ops import permissions
from resilienced.ports import DrainResult, RayNode
from tests.support.kubeapi import KubeApiServer, RbacRule

NS = "ml"
DAEMON_NS = "resilienced"
BUCKET = "ckpt"
URI = f"s3://{BUCKET}/runs/train"
REGION = "us-east-1"
TOKEN_SECRET = "train-rc-token"
WORKER_IPS = ("127.0.0.2", "127.0.0.3")


def instance(n: int) -> str:
    return f"i-{n:017x}"


def rbac() -> list[RbacRule]:
    """The grants of deploy/ as emulator rules: ClusterRole, daemon Role, token Role."""
    def rule(r: permissions.Rule, *, namespace: str | None = None, names: Sequence[str] = ()) -> RbacRule:
        return RbacRule(verbs=frozenset(r.verbs), api_groups=frozenset({r.api_group}),
                        resources=frozenset({r.resource}), resource_names=frozenset(names),
                        namespace=namespace)
    rules = [rule(r) for r in permissions.RBAC_RULES]
    rules += [rule(r, namespace=DAEMON_NS) for r in permissions.NAMESPACED_RBAC_RULES["daemon"]]
    rules += [rule(r, namespace=NS, names=(TOKEN_SECRET,)) for r in permissions.NAMESPACED_RBAC_RULES["run"]]
    return rules


def node(name: str, instance_id: str, *, capacity: str = "spot") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "karpenter.sh/capacity-type": capacity, "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/zone": "us-east-1a"}},
            "spec": {"providerID": f"aws:///us-east-1a/{instance_id}"}}


def pod_template() -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "train"}},
            "spec": {"nodeSelector": {"karpenter.sh/capacity-type": "spot"},
                     "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}]}}


def ray_pod(name: str, *, node_name: str, ip: str, node_type: str = "worker",
            gcs_port: int | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "ray", "image": "rayproject/ray:2.60.0"}
    if gcs_port is not None:
        container["ports"] = [{"name": "gcs-server", "containerPort": gcs_port}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {
                "ray.io/cluster": "train-rc", "ray.io/node-type": node_type,
                "ray.io/group": "headgroup" if node_type == "head" else "gpu", "ray.io/is-ray-node": "yes"}},
            "spec": {"nodeName": node_name, "containers": [container]},
            "status": {"phase": "Running", "podIP": ip}}


def seed_world(kubeapi: KubeApiServer, *, gcs_port: int, head_ip: str = "127.0.0.1",
               worker_ips: Sequence[str] = WORKER_IPS, token: str | None = None) -> None:
    """Nodes n0..n2 (instances 100, 1, 2), the RayJob, its RayCluster, and the Ray pods."""
    job = kubeapi.create({
        "apiVersion": "ray.io/v1", "kind": "RayJob",
        "metadata": {"name": "train", "namespace": NS, "annotations": {"resilienced.io/checkpoint-uri": URI}},
        "spec": {"entrypoint": "python -m trainer", "shutdownAfterJobFinishes": True,
                 "rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}, "template": pod_template()},
                                    "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2, "minReplicas": 2,
                                                          "maxReplicas": 2, "rayStartParams": {},
                                                          "template": pod_template()}]}},
        "status": {"jobDeploymentStatus": "Running", "rayClusterName": "train-rc"}})
    spec: dict[str, Any] = {"rayVersion": "2.60.0",
                            "headGroupSpec": {"rayStartParams": {}, "template": pod_template()},
                            "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2, "minReplicas": 2,
                                                  "maxReplicas": 2, "rayStartParams": {},
                                                  "template": pod_template()}]}
    if token is not None:
        spec["authOptions"] = {"mode": "token", "secretName": TOKEN_SECRET}
        kubeapi.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": TOKEN_SECRET, "namespace": NS},
                        "type": "Opaque", "stringData": {"auth_token": token}})
    kubeapi.seed(
        node("n0", instance(100), capacity="on-demand"), node("n1", instance(1)), node("n2", instance(2)),
        {"apiVersion": "ray.io/v1", "kind": "RayCluster",
         "metadata": {"name": "train-rc", "namespace": NS, "ownerReferences": [{
             "apiVersion": "ray.io/v1", "kind": "RayJob", "name": "train", "uid": job["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}]},
         "spec": spec, "status": {"state": "ready", "head": {"serviceIP": head_ip}}},
        ray_pod("train-head", node_name="n0", ip=head_ip, node_type="head", gcs_port=gcs_port),
        ray_pod("train-w1", node_name="n1", ip=worker_ips[0]),
        ray_pod("train-w2", node_name="n2", ip=worker_ips[1]),
    )


@dataclass
class RecordingGcs:
    """The RayControl of a cluster that cannot run here: a fixed node list; drains are recorded.

    Used only where the test is about the Kubernetes and S3 side; the drain itself is exercised
    against a real Ray cluster in test_kubernetes_e2e.py.
    """

    nodes_: list[RayNode]
    drains: list[tuple[str, datetime, str]] = field(default_factory=list)
    address: str = "127.0.0.1:6379"
    outcome: str = "drained"  # what GCS answers (ports.DrainResult.outcome): drained | already_draining

    async def nodes(self) -> list[RayNode]:
        return list(self.nodes_)

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        self.drains.append((node_id, deadline, message))
        return DrainResult(node_id, self.outcome, self.outcome in ("drained", "already_draining"),
                           int(deadline.timestamp() * 1000))


def ray_nodes() -> list[RayNode]:
    return [RayNode(node_id="aa" * 28, address="127.0.0.1", labels={}, alive=True, is_head=True),
            RayNode(node_id="01" * 28, address=WORKER_IPS[0], labels={}, alive=True),
            RayNode(node_id="02" * 28, address=WORKER_IPS[1], labels={}, alive=True)]


# --------------------------------------------------------------------------- S3 checkpoints
async def put_checkpoint(s3: Any, *, step: int, saved: datetime, files: dict[str, bytes],
                         prefix: str = "runs/train", manifest: bool = True) -> None:
    """Write a checkpoint as the trainer + FSx export would: the files, then the manifest."""
    for name, data in files.items():
        await s3.put_object(Bucket=BUCKET, Key=f"{prefix}/step-{step}/{name}", Body=data)
    if manifest:
        body = {"format": "resilienced-checkpoint/1", "step": step, "world_size": 2,
                "time": saved.astimezone(timezone.utc).isoformat().replace("+00:00", "Z"),
                "saved_at_unix": saved.timestamp(), "reason": "preemption",
                "files": [{"path": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                          for n, d in files.items()]}
        await s3.put_object(Bucket=BUCKET, Key=f"{prefix}/step-{step}/manifest.json",
                            Body=json.dumps(body).encode())


@pytest.fixture
async def s3(aws: Any) -> AsyncIterator[Any]:
    async with get_session().create_client("s3", region_name=REGION, endpoint_url=aws.endpoint_url) as client:
        await client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
async def kubeapi() -> AsyncIterator[KubeApiServer]:
    async with KubeApiServer(rbac=rbac()) as server:
        yield server

