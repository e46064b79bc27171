"""A stand-in for KubeRay's pod reconciliation on a spec change (test support only).

KubeRay cannot run here; this plays the one rule of its RayCluster controller that decides
whether a template change touches running pods (ray-project/kuberay v1.6.0, unchanged in v1.7.0),
and (:meth:`KubeRaySim.scale_workers`) how it keeps each worker group at its replicas:

* ``ray-operator/controllers/ray/raycluster_controller.go`` ``createHeadPod``: the head pod is
  annotated ``ray.io/upgrade-strategy-recreate-hash`` with the spec's hash
  (``utils.GenerateHashWithoutReplicasAndWorkersToDelete``, ``ray-operator/controllers/ray/utils/util.go``:
  a hash of the RayClusterSpec with replicas, min/maxReplicas, workersToDelete, every template's
  tolerations and schedulingGates, and upgradeStrategy muted; a nodeSelector change counts).
* ``reconcilePods`` -> ``shouldRecreatePodsForUpgrade``: only with ``spec.upgradeStrategy.type:
  Recreate``, when the head pod's annotation is set and differs from the current hash,
  ``deleteAllPods``: every pod of the cluster, **head included**.  Without ``Recreate`` a
  template change leaves running pods alone (only missing replicas are created from it).

The simulation is sequential: call :meth:`KubeRaySim.step` after the code under test acted.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from tests.support.kubeapi import KubeApiServer

HASH_ANNOTATION = "ray.io/upgrade-strategy-recreate-hash"


def spec_hash(spec: dict[str, Any]) -> str:
    """``GenerateHashWithoutReplicasAndWorkersToDelete`` (the muted fields as in v1.6.0)."""
    muted = copy.deepcopy(spec)
    head = ((muted.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}
    for key in ("tolerations", "schedulingGates"):
        head.pop(key, None)
    for group in muted.get("workerGroupSpecs") or []:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        (group.get("scaleStrategy") or {}).pop("workersToDelete", None)
        for key in ("tolerations", "schedulingGates"):
            ((group.get("template") or {}).get("spec") or {}).pop(key, None)
    muted.pop("upgradeStrategy", None)
    return hashlib.sha1(json.dumps(muted, sort_keys=True).encode()).hexdigest()  # noqa: S324 (not security)


class KubeRaySim:
    """``step()`` applies the Recreate rule to every RayCluster of ``namespace``."""

    def __init__(self, server: KubeApiServer, *, namespace: str) -> None:
        self.server = server
        self.namespace = namespace
        self.recreated: list[str] = []  # clusters whose pods were all deleted, in order
        self.created = 0  # worker pods made by scale_workers

    def stamp_head(self, cluster: str) -> None:
        """What ``createHeadPod`` does: annotate the head pod with the cluster's current hash."""
        obj = self.server.get("rayclusters", cluster, namespace=self.namespace)
        assert obj is not None
        for pod in self._pods(cluster, node_type="head"):
            pod["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(obj["spec"])
            self.server.put(pod)

    def step(self) -> None:
        for cluster in self.server.list("rayclusters", namespace=self.namespace):
            spec = cluster["spec"]
            if ((spec.get("upgradeStrategy") or {}).get("type")) != "Recreate":
                continue
            name = cluster["metadata"]["name"]
            heads = self._pods(name, node_type="head")
            actual = ((heads[0]["metadata"].get("annotations") or {}).get(HASH_ANNOTATION)) if heads else None
            if actual and actual != spec_hash(spec):
                for pod in self._pods(name):
                    self.server.delete("pods", pod["metadata"]["name"], namespace=self.namespace)
                self.recreated.append(name)

    def scale_workers(self, cluster: str) -> None:
        """``reconcilePods``' worker loop (ray-project/kuberay v1.7.0, same from v1.4.0,
        ``ray-operator/controllers/ray/raycluster_controller.go``), per worker group (pods by the labels
        ``ray.io/cluster`` and ``ray.io/group``): delete the pods named in ``scaleStrategy.workersToDelete``
        ("Always remove the specified WorkersToDelete - regardless of the value of Replicas"; NotFound is
        fine; the stored list is not cleared, only KubeRay's copy); a pod being deleted (a
        ``deletionTimestamp``, held by a finalizer here) is listed and counts as present until it is
        gone, unless named in ``workersToDelete`` (``runningPods`` leaves out only those); then ``diff`` = desired
        (``utils.GetWorkerGroupDesiredReplicas``: 0 when suspended, else replicas clamped to
        [minReplicas, maxReplicas], times numOfHosts) - the pods left; ``diff > 0``: create that many
        pods from the group's template (Pending, unscheduled here); ``diff < 0`` without the in-tree
        autoscaler: delete ``-diff`` of the pods left, in list order ("randomlyRemovedWorkers")."""
        obj = self.server.get("rayclusters", cluster, namespace=self.namespace)
        assert obj is not None
        autoscaling = bool(obj["spec"].get("enableInTreeAutoscaling"))
        for group in obj["spec"].get("workerGroupSpecs") or []:
            name = group["groupName"]
            pods = [p for p in self._pods(cluster, node_type="worker") if p["metadata"]["labels"].get("ray.io/group") == name]
            doomed = set((group.get("scaleStrategy") or {}).get("workersToDelete") or [])
            for pod in pods:
                if pod["metadata"]["name"] in doomed:
                    self.server.delete("pods", pod["metadata"]["name"], namespace=self.namespace)
            running = [p for p in pods if p["metadata"]["name"] not in doomed]
            diff = self.desired(group) - len(running)
            for _ in range(max(diff, 0)):
                self.created += 1
                self.server.create({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{cluster}-{name}-worker-{self.created:05d}", "namespace": self.namespace,
                                 "labels": {**((group["template"].get("metadata") or {}).get("labels") or {}),
                                            "ray.io/cluster": cluster, "ray.io/group": name,
                                            "ray.io/node-type": "worker"}},
                    "spec": copy.deepcopy(group["template"]["spec"]), "status": {"phase": "Pending"}})
            if diff < 0 and not autoscaling:
                for pod in running[:-diff]:
                    self.server.delete("pods", pod["metadata"]["name"], namespace=self.namespace)

    @staticmethod
    def desired(group: dict[str, Any]) -> int:
        """``utils.GetWorkerGroupDesiredReplicas`` (v1.7.0 ``ray-operator/controllers/ray/utils/util.go``)."""
        if group.get("suspend"):
            return 0
        low, high = int(group.get("minReplicas") or 0), group.get("maxReplicas")
        replicas = group.get("replicas")
        count = low if replicas is None or replicas < low else replicas
        if high is not None and count > high:
            count = high
        return int(count) * max(int(group.get("numOfHosts") or 1), 1)

    def _pods(self, cluster: str, *, node_type: str | None = None) -> list[dict[str, Any]]:
        selector = f"ray.io/cluster={cluster}" + (f",ray.io/node-type={node_type}" if node_type else "")
        return self.server.list("pods", namespace=self.namespace, label_selector=selector)
