"""Kubernetes objects for the requeue tests, built as KubeRay, Kueue and Volcano write them."""

from __future__ import annotations

import copy
from typing import Any

NS = "ml"
SPOT_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]},
                          {"key": "node.kubernetes.io/instance-type", "operator": "In",
                           "values": ["p5.48xlarge"]}]}]}}}


def pod_template(*, selector: dict | None = None, affinity: dict | None = None,
                 tolerations: list | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}]}
    if selector is not None:
        spec["nodeSelector"] = dict(selector)
    if affinity is not None:
        spec["affinity"] = copy.deepcopy(affinity)
    if tolerations is not None:
        spec["tolerations"] = list(tolerations)
    return {"metadata": {"labels": {"app": "train"}}, "spec": spec}


def cluster_spec(**template_kwargs: Any) -> dict[str, Any]:
    return {
        "headGroupSpec": {"rayStartParams": {}, "template": pod_template(selector={"karpenter.sh/capacity-type": "on-demand"})},
        "workerGroupSpecs": [
            {"groupName": "gpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2, "rayStartParams": {},
             "template": pod_template(**template_kwargs)},
            {"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "rayStartParams": {},
             "template": pod_template(**template_kwargs)},
        ],
    }


def raycluster(name: str = "train", *, labels: dict | None = None, owner: dict | None = None,
               **template_kwargs: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": dict(labels or {})}
    if owner:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": meta,
            "spec": cluster_spec(**template_kwargs), "status": {"state": "ready"}}


def rayjob(name: str = "job", *, cluster: str | None = "train", labels: dict | None = None,
           suspend: bool = False, **template_kwargs: Any) -> dict[str, Any]:
    obj = {"apiVersion": "ray.io/v1", "kind": "RayJob",
           "metadata": {"name": name, "namespace": NS, "labels": dict(labels or {})},
           "spec": {"entrypoint": "python train.py", "shutdownAfterJobFinishes": True, "suspend": suspend,
                    "rayClusterSpec": cluster_spec(**template_kwargs)},
           "status": {"jobDeploymentStatus": "Running"}}
    if cluster:
        obj["status"]["rayClusterName"] = cluster
    return obj


def node(name: str, *, capacity: str, reservation: str | None = None) -> dict[str, Any]:
    labels = {"karpenter.sh/capacity-type": capacity, "node.kubernetes.io/instance-type": "p5.48xlarge",
              "topology.kubernetes.io/zone": "us-east-1a"}
    if reservation:
        labels["karpenter.k8s.aws/capacity-reservation-id"] = reservation
        labels["karpenter.k8s.aws/capacity-reservation-type"] = "capacity-block"
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"providerID": f"aws:///us-east-1a/i-{abs(hash(name)) % 10**17:017d}"}}


def ray_pod(name: str, *, cluster: str = "train", group: str = "gpu", node_type: str = "worker",
            node_name: str | None = None, selector: dict | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}]}
    if node_name:
        spec["nodeName"] = node_name
    if selector:
        spec["nodeSelector"] = dict(selector)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"ray.io/cluster": cluster, "ray.io/node-type": node_type, "ray.io/group": group,
                                    "ray.io/is-ray-node": "yes"}},
            "spec": spec, "status": {"phase": "Running"}}
