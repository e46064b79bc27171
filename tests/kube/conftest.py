"""Fixtures for kubernetes mode: the emulated API server, a real client to it, object builders.

Every test here talks to :class:`tests.support.kubeapi.KubeApiServer` over HTTP through the real
kubernetes_asyncio client.  The GCS side is the real ``RayGcs`` against a real local Ray cluster
in the e2e tests; elsewhere a :class:`StaticGcs` (a fixed node list behind the RayControl
protocol) stands in for the Ray cluster, because those tests are about the Kubernetes side.
An autouse fixture fails any test that leaves an asyncio task running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.errors import BackendUnavailable, RayAuthError
from resilienced.kube.cluster import KubeCluster
from resilienced.ports import DrainResult, RayNode
from tests.support.kubeoptions import FAST, LOCAL_BOUND_S
from tests.support.kubeapi import KubeApiServer, ResourceType

JsonObj = dict[str, Any]

AZ = "us-east-1a"


# --------------------------------------------------------------------------- hygiene
@pytest.fixture(autouse=True)
async def no_leftover_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks behind (caches must stop cleanly)."""
    before = set(asyncio.all_tasks())
    yield
    await asyncio.sleep(0)
    current = asyncio.current_task()
    leftover = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
    assert not leftover, f"tasks left running: {[t.get_name() for t in leftover]}"


async def eventually(predicate: Callable[[], bool], *, timeout: float = LOCAL_BOUND_S,
                     what: str = "condition") -> None:
    """Wait (bounded) until ``predicate()`` holds, polling briefly; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- server and client
#: Karpenter's karpenter.sh/v1 NodeClaim as aws/karpenter-provider-aws v1.6 serves it
#: (pkg/apis/crds/karpenter.sh_nodeclaims.yaml: scope Cluster, status subresource).
NODECLAIMS = ResourceType("karpenter.sh", ("v1",), "nodeclaims", "NodeClaim", namespaced=False)
#: Karpenter's cluster-scoped kinds, served only by the emulators of the tests that register them
#: (``server.register``): karpenter.sh/v1 NodePool and karpenter.k8s.aws/v1 EC2NodeClass, as
#: aws/karpenter-provider-aws v1.6 serves them (pkg/apis/crds/karpenter.sh_nodepools.yaml,
#: karpenter.k8s.aws_ec2nodeclasses.yaml: scope Cluster, status subresource), and NodeClaim.
KARPENTER_RESOURCES = (
    ResourceType("karpenter.sh", ("v1",), "nodepools", "NodePool", namespaced=False),
    ResourceType("karpenter.k8s.aws", ("v1",), "ec2nodeclasses", "EC2NodeClass", namespaced=False),
    NODECLAIMS,
)

#: Kueue's queue kinds as v0.19.2 serves them (config/components/crd/bases: ClusterQueue and
#: ResourceFlavor cluster-scoped, LocalQueue namespaced; v1beta2 from v0.15, v1beta1 before):
#: the Workloads are in the emulator's default resources, these only where a test registers them.
KUEUE_QUEUE_RESOURCES = (
    ResourceType("kueue.x-k8s.io", ("v1beta2", "v1beta1"), "clusterqueues", "ClusterQueue", namespaced=False),
    ResourceType("kueue.x-k8s.io", ("v1beta2", "v1beta1"), "localqueues", "LocalQueue", namespaced=True),
    ResourceType("kueue.x-k8s.io", ("v1beta2", "v1beta1"), "resourceflavors", "ResourceFlavor", namespaced=False),
)


@pytest.fixture
async def kubeapi() -> AsyncIterator[KubeApiServer]:
    async with KubeApiServer() as server:
        yield server



# --------------------------------------------------------------------------- GCS stand-in
class StaticGcs:
    """A RayControl answering its factory's node list for one address (tests of the Kubernetes side)."""

    def __init__(self, factory: GcsFactory, address: str, token: str | None) -> None:
        self._factory = factory
        self.address = address
        self.token = token
        self.calls = 0
        self.closed = False

    async def nodes(self) -> list[RayNode]:
        self.calls += 1
        hang = self._factory.hang.get(self.address, 0.0)
        if hang:
            await asyncio.sleep(hang)
        if self.address in self._factory.down:
            raise BackendUnavailable("ray", "GCS unreachable")
        expected = self._factory.expected_token.get(self.address)
        if expected is not None and self.token != expected:
            raise RayAuthError("InvalidAuthToken")
        return list(self._factory.nodes.get(self.address, []))

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        return DrainResult(node_id, "drained", True, int(deadline.timestamp() * 1000))

    async def close(self) -> None:
        self.closed = True


class GcsFactory:
    """``ray_control_factory``: a StaticGcs per (address, token); the dicts below are read live."""

    def __init__(self) -> None:
        self.nodes: dict[str, list[RayNode]] = {}
        self.expected_token: dict[str, str] = {}
        self.down: set[str] = set()
        self.hang: dict[str, float] = {}
        self.made: list[tuple[str, str | None]] = []
        self.controls: list[StaticGcs] = []

    def __call__(self, address: str, token: str | None) -> StaticGcs:
        self.made.append((address, token))
        control = StaticGcs(self, address, token)
        self.controls.append(control)
        return control

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.controls)


@pytest.fixture
def gcs() -> GcsFactory:
    return GcsFactory()


@pytest.fixture
async def cluster(api: k8s.ApiClient, gcs: GcsFactory) -> AsyncIterator[KubeCluster]:
    kube = KubeCluster(api, ray_control_factory=gcs, replica="replica-a", options=FAST)
    await kube.start()
    try:
        yield kube
    finally:
        await kube.stop()


# --------------------------------------------------------------------------- objects
def instance(n: int) -> str:
    return f"i-{n:017x}"


def node(name: str, instance_id: str | None, *, labels: Mapping[str, str] | None = None,
         taints: Sequence[Mapping[str, str]] | None = None) -> JsonObj:
    spec: JsonObj = {}
    if instance_id:
        spec["providerID"] = f"aws:///{AZ}/{instance_id}"
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": dict(labels or {})}, "spec": spec}


def ray_pod(name: str, *, cluster: str, node_name: str, ip: str | None, namespace: str = "ml",
            node_type: str = "worker", group: str = "workers", phase: str = "Running",
            gcs_port: int | None = None) -> JsonObj:
    container: JsonObj = {"name": "ray-head" if node_type == "head" else "ray-worker", "image": "rayproject/ray:2.60.0"}
    if gcs_port is not None:
        container["ports"] = [{"name": "gcs-server", "containerPort": gcs_port}]
    status: JsonObj = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {
            "ray.io/cluster": cluster, "ray.io/node-type": node_type,
            "ray.io/group": "headgroup" if node_type == "head" else group, "ray.io/is-ray-node": "yes"}},
        "spec": {"nodeName": node_name, "containers": [container]},
        "status": status,
    }


def pod_template(container: str = "ray-worker") -> JsonObj:
    """The smallest pod template KubeRay's CRD schema accepts (containers need a name)."""
    return {"spec": {"containers": [{"name": container, "image": "rayproject/ray:2.60.0"}]}}


def worker_group(name: str, *, replicas: int = 1) -> JsonObj:
    """A worker group as the RayCluster v1 schema requires it (groupName, min/maxReplicas, template)."""
    return {"groupName": name, "replicas": replicas, "minReplicas": 0, "maxReplicas": 10, "template": pod_template()}


def raycluster(name: str, *, namespace: str = "ml", annotations: Mapping[str, str] | None = None,
               owner_job: JsonObj | None = None, head_ip: str | None = None, service_ip: str | None = None,
               gcs_port: int | None = None, auth: Mapping[str, Any] | None = None) -> JsonObj:
    meta: JsonObj = {"name": name, "namespace": namespace, "annotations": dict(annotations or {})}
    if owner_job is not None:
        meta["ownerReferences"] = [{
            "apiVersion": "ray.io/v1", "kind": "RayJob", "name": owner_job["metadata"]["name"],
            "uid": owner_job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    spec: JsonObj = {"rayVersion": "2.60.0", "headGroupSpec": {"rayStartParams": {}, "template": pod_template("ray-head")},
                     "workerGroupSpecs": []}
    if auth is not None:
        spec["authOptions"] = dict(auth)
    status: JsonObj = {"state": "ready", "head": {}}
    if head_ip:
        status["head"]["podIP"] = head_ip
    if service_ip:
        status["head"]["serviceIP"] = service_ip
    if gcs_port is not None:
        status["endpoints"] = {"gcs-server": str(gcs_port), "dashboard": "8265"}
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta, "spec": spec, "status": status}


def rayjob(name: str, *, namespace: str = "ml", annotations: Mapping[str, str] | None = None,
           cluster_name: str | None = None, selector: str | None = None, state: str = "Running") -> JsonObj:
    spec: JsonObj = {"entrypoint": "python train.py", "shutdownAfterJobFinishes": True}
    if selector:
        spec["clusterSelector"] = {"ray.io/cluster": selector}
    status: JsonObj = {"jobDeploymentStatus": state}
    if cluster_name:
        status["rayClusterName"] = cluster_name
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
            "spec": spec, "status": status}


def ray_node(node_id_byte: int, address: str, *, alive: bool = True, head: bool = False) -> RayNode:
    return RayNode(node_id=f"{node_id_byte:02x}" * 28, address=address, labels={}, alive=alive, is_head=head)
