"""What the ``cluster`` tests put on the real control plane: the daemon's identity as deployed,
kwok Nodes of each node shape, namespaces, and Kueue's queues.

* :func:`install_daemon_identity` applies ``deploy/kubernetes/base``'s namespace, ServiceAccount
  and RBAC (ClusterRole, ClusterRoleBinding, the claims Role and RoleBinding) as kustomize renders
  them (the base's ``namespace: resilienced``), and the overlay's Ray-token Role for a training
  namespace; :func:`daemon_token` mints the ServiceAccount's token through TokenRequest.  The
  daemon then runs with exactly the manifests' grants: a verb they lack is the API's 403.
* :class:`World` creates objects with the admin's client and remembers the cluster-scoped ones
  it made (Nodes, ClusterQueues, ResourceFlavors), deleting them when the test ends; each test's
  namespaced objects live in a namespace of its own, deleted at the end (the namespace
  controller of kube-controller-manager removes what is in it).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .plane import ControlPlane
from .rest import RestError

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy" / "kubernetes" / "base"
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "example"
DAEMON_NS = "resilienced"
DAEMON_SA = "resilienced"
ZONE = "us-east-1a"
INSTANCE_TYPE = "p5.48xlarge"
GPU = "nvidia.com/gpu"
JsonObj = dict[str, Any]

_namespaces = itertools.count(1)


def _docs(path: Path) -> list[JsonObj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _apply(plane: ControlPlane, obj: JsonObj) -> JsonObj:
    """Create ``obj``, or replace it where it exists (a ``kubectl apply`` for the tests' set-up)."""
    admin = plane.admin
    try:
        return admin.create(obj)
    except RestError as err:
        if err.status != 409:
            raise
    meta = obj["metadata"]
    plural = admin.plural(obj["apiVersion"], obj["kind"])
    path = admin.path(obj["apiVersion"], plural, namespace=meta.get("namespace"), name=meta["name"])
    current = admin.request("GET", path)
    replaced = copy.deepcopy(obj)
    replaced["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    return admin.request("PUT", path, replaced)


def ensure_namespace(plane: ControlPlane, name: str) -> None:
    """The namespace ``name``, made where it is missing (the real server keeps namespaced objects,
    Leases too, only in a namespace that exists).  One that exists is left as it is: replacing it
    would drop the labels others put on it (``install_daemon_identity``'s pod-security ones)."""
    try:
        plane.admin.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    except RestError as err:
        if err.status != 409:
            raise


def install_daemon_identity(plane: ControlPlane) -> None:
    """The base's namespace, ServiceAccount and RBAC, namespaced as its kustomization sets it."""
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        for doc in _docs(BASE / name):
            if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
                doc["metadata"]["namespace"] = DAEMON_NS
            _apply(plane, doc)


def grant_ray_token(plane: ControlPlane, namespace: str, secret: str) -> None:
    """The overlay's Ray-token Role and RoleBinding, for ``secret`` in ``namespace``."""
    for doc in _docs(OVERLAY / "ray-token-rbac.yaml"):
        doc["metadata"]["namespace"] = namespace
        if doc["kind"] == "Role":
            doc["rules"][0]["resourceNames"] = [secret]
        _apply(plane, doc)


def daemon_token(plane: ControlPlane, *, seconds: int = 3600) -> str:
    """A token of the daemon's ServiceAccount (TokenRequest), as a projected token in its pod is."""
    answer = plane.admin.request(
        "POST", f"/api/v1/namespaces/{DAEMON_NS}/serviceaccounts/{DAEMON_SA}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": seconds}})
    return str(answer["status"]["token"])


def can(plane: ControlPlane, *, verb: str, resource: str, group: str = "", namespace: str | None = None,
        name: str | None = None, user: str = f"system:serviceaccount:{DAEMON_NS}:{DAEMON_SA}") -> bool:
    """What ``kubectl auth can-i --as=<user>`` answers (a SubjectAccessReview by the admin)."""
    attributes: JsonObj = {"verb": verb, "resource": resource, "group": group}
    if namespace:
        attributes["namespace"] = namespace
    if name:
        attributes["name"] = name
    review = plane.admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{DAEMON_NS}",
                                          "system:authenticated"],
                 "resourceAttributes": attributes}})
    return bool(review["status"].get("allowed"))


# --------------------------------------------------------------------------- node shapes
def karpenter_labels(capacity: str, *, nodepool: str | None = None, reservation: str | None = None) -> dict[str, str]:
    """Karpenter's well-known Node labels (aws/karpenter-provider-aws v1.6+ pkg/apis/v1/labels.go);
    ``nodepool``: the ``karpenter.sh/nodepool`` label of a node Karpenter launched (without it the
    daemon reads the node as neither Karpenter's nor a node group's, docs/requeue.md "Node shapes")."""
    labels = {"karpenter.sh/capacity-type": capacity}
    if nodepool:
        labels["karpenter.sh/nodepool"] = nodepool
    if reservation:
        labels["karpenter.k8s.aws/capacity-reservation-id"] = reservation
        labels["karpenter.k8s.aws/capacity-reservation-type"] = "capacity-block"
    return labels


def nodegroup_labels(capacity: str, *, nodegroup: str = "gpu-ng") -> dict[str, str]:
    """An EKS managed node group's Node labels: eks.amazonaws.com/capacityType SPOT | ON_DEMAND | CAPACITY_BLOCK."""
    return {"eks.amazonaws.com/nodegroup": nodegroup, "eks.amazonaws.com/capacityType": capacity}


def kwok_node(name: str, instance_id: str, labels: Mapping[str, str], *, gpus: int = 8, cpu: str = "192",
              taints: Sequence[Mapping[str, str]] = ()) -> JsonObj:
    """A Node kwok manages (it sets Ready and keeps the heartbeat), with an EC2 providerID and the
    well-known labels the daemon reads; ``kwok.x-k8s.io/node: fake`` tolerations are not needed
    (no taint is set unless given)."""
    capacity = {"cpu": cpu, "memory": "2000Gi", "pods": "110", GPU: str(gpus)}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": INSTANCE_TYPE, "topology.kubernetes.io/zone": ZONE,
            "type": "kwok", **labels}},
        "spec": {"providerID": f"aws:///{ZONE}/{instance_id}", "taints": [dict(t) for t in taints]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


class World:
    """A test's objects on the real control plane (see the module docstring)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.admin = plane.admin
        self.namespace = f"t{next(_namespaces)}-{int(time.time()) % 100000}"
        self._cluster_scoped: list[tuple[str, str]] = []  # (path, name)
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})

    def create(self, obj: JsonObj) -> JsonObj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        plural = self.admin.plural(obj["apiVersion"], obj["kind"])
        namespaced = self._namespaced(obj["apiVersion"], plural)
        if namespaced:
            meta.setdefault("namespace", self.namespace)
        status = obj.get("status")
        made = self.admin.create(obj)
        if not namespaced:
            self._cluster_scoped.append((self.admin.path(obj["apiVersion"], plural), meta["name"]))
        if status and obj["kind"] != "Node" and self._has_status(obj["apiVersion"], plural):
            made = self.admin.apply_status({**made, "status": status})
        return made

    def _namespaced(self, api_version: str, plural: str) -> bool:
        found = self.admin.request("GET", self.admin.base(api_version))
        for resource in found.get("resources", []):
            if resource["name"] == plural:
                return bool(resource["namespaced"])
        raise KeyError(f"{api_version} serves no {plural}")

    def _has_status(self, api_version: str, plural: str) -> bool:
        found = self.admin.request("GET", self.admin.base(api_version))
        return any(r["name"] == f"{plural}/status" for r in found.get("resources", []))

    def nodes(self, *nodes: JsonObj) -> list[JsonObj]:
        """Create kwok Nodes and wait until each is Ready without the ``node.kubernetes.io/not-ready``
        taint the node-lifecycle controller puts on a new Node (until then the scheduler reports
        "had untolerated taint(s)")."""
        for node in nodes:
            self.create(node)

        def ready(name: str) -> bool:
            found = self.get("v1", "nodes", name, namespace=None) or {}
            conditions = (found.get("status") or {}).get("conditions") or []
            taints = (found.get("spec") or {}).get("taints") or []
            return (any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
                    and not any(t["key"].startswith("node.kubernetes.io/") for t in taints))

        names = [n["metadata"]["name"] for n in nodes]
        self.wait(f"Nodes {names} Ready and untainted", lambda: all(ready(n) for n in names))
        return [self.get("v1", "nodes", n, namespace=None) or {} for n in names]

    def get(self, api_version: str, plural: str, name: str, *, namespace: str | None = "") -> JsonObj | None:
        ns = self.namespace if namespace == "" else namespace
        try:
            return self.admin.request("GET", self.admin.path(api_version, plural, namespace=ns, name=name))
        except RestError as err:
            if err.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, *, namespace: str | None = "", selector: str | None = None) -> list[JsonObj]:
        ns = self.namespace if namespace == "" else namespace
        query = {"labelSelector": selector} if selector else None
        return list(self.admin.request("GET", self.admin.path(api_version, plural, namespace=ns),
                                       query=query).get("items", []))

    def patch(self, api_version: str, plural: str, name: str, body: JsonObj, *, namespace: str | None = "",
              sub: str | None = None) -> JsonObj:
        ns = self.namespace if namespace == "" else namespace
        return self.admin.request("PATCH", self.admin.path(api_version, plural, namespace=ns, name=name, sub=sub),
                                  body, content_type="application/merge-patch+json")

    def pods(self, selector: str | None = None) -> list[JsonObj]:
        return self.list("v1", "pods", selector=selector)

    def wait(self, what: str, check: Callable[[], Any], *, timeout: float = 90.0) -> Any:
        return self.plane.wait_for(what, check, timeout=timeout)

    def close(self) -> None:
        for path, name in reversed(self._cluster_scoped):
            try:
                self.admin.request("DELETE", f"{path}/{name}")
            except RestError as err:
                if err.status != 404:
                    raise
        try:
            self.admin.request("DELETE", f"/api/v1/namespaces/{self.namespace}")
        except RestError as err:
            if err.status != 404:
                raise
