"""A stand-in for KubeRay's pod reconciliation on a spec change (test support only).

KubeRay cannot run here; this plays the one rule of its RayCluster controller that decides
whether a template change touches running pods (ray-project/kuberay v1.6.0, unchanged in v1.7.0):

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

    def _pods(self, cluster: str, *, node_type: str | None = None) -> list[dict[str, Any]]:
        selector = f"ray.io/cluster={cluster}" + (f",ray.io/node-type={node_type}" if node_type else "")
        return self.server.list("pods", namespace=self.namespace, label_selector=selector)
