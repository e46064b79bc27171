"""A stand-in for kube-scheduler's filtering, on the emulated API server (test support only).

The follow-up after a requeue waits for the gang's worker pods to be bound to Nodes of the decided
capacity, and counts a stall from pods that stay unschedulable.  This plays the parts of
kube-scheduler that decide that (kubernetes/kubernetes v1.33), sequentially (call :meth:`step`):

* ``pkg/scheduler/framework/plugins/nodeaffinity``: a Node fits only when its labels satisfy the
  pod's ``nodeSelector`` (``ErrReasonPod``: "node(s) didn't match Pod's node affinity/selector");
* ``pkg/scheduler/framework/plugins/tainttoleration``: a ``NoSchedule`` taint the pod does not
  tolerate filters the Node out ("node(s) had untolerated taint {key: value}");
* one pod per Node here (the GPU workers of a gang each take a whole Node: ``NodeResourcesFit``);
* a pod no Node fits gets ``PodScheduled=False`` with reason ``Unschedulable`` and the
  ``FitError`` message "0/N nodes are available: ..." (``pkg/scheduler/schedule_one.go``,
  ``handleSchedulingFailure``); one that fits is bound (``spec.nodeName``) and ``Running``.
"""

from __future__ import annotations

from typing import Any

from tests.support.kubeapi import KubeApiServer


def _tolerates(pod: dict[str, Any], taint: dict[str, Any]) -> bool:
    for toleration in (pod.get("spec") or {}).get("tolerations") or []:
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, taint.get("key")):
            return True
        if toleration.get("key") == taint.get("key") and toleration.get("value") == taint.get("value"):
            return True
    return False


class SchedulerSim:
    """Binds the pending pods of ``namespace`` to the Nodes that fit them, or marks them Unschedulable."""

    def __init__(self, server: KubeApiServer, *, namespace: str) -> None:
        self.server = server
        self.namespace = namespace
        self.unschedulable: list[str] = []

    def step(self) -> None:
        nodes = self.server.list("nodes")
        taken = {(p.get("spec") or {}).get("nodeName") for p in self.server.list("pods", namespace=None)}
        for pod in self.server.list("pods", namespace=self.namespace):
            if (pod.get("spec") or {}).get("nodeName") or (pod["metadata"].get("deletionTimestamp")):
                continue
            selector = (pod.get("spec") or {}).get("nodeSelector") or {}
            mismatch = [n for n in nodes if any((n["metadata"].get("labels") or {}).get(k) != v
                                               for k, v in selector.items())]
            tainted = [n for n in nodes if n not in mismatch and any(
                t.get("effect") == "NoSchedule" and not _tolerates(pod, t)
                for t in (n.get("spec") or {}).get("taints") or [])]
            busy = [n for n in nodes if n not in mismatch and n not in tainted and n["metadata"]["name"] in taken]
            fits = [n for n in nodes if n not in mismatch and n not in tainted and n not in busy]
            if fits:
                pod["spec"]["nodeName"] = fits[0]["metadata"]["name"]
                taken.add(pod["spec"]["nodeName"])
                pod["status"] = {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}
            else:
                reasons = [f"{len(group)} {what}" for group, what in (
                    (mismatch, "node(s) didn't match Pod's node affinity/selector"),
                    (tainted, "node(s) had untolerated taint"), (busy, "node(s) were full")) if group]
                message = f"0/{len(nodes)} nodes are available: {', '.join(reasons)}."
                pod["status"] = {"phase": "Pending", "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}
                self.unschedulable.append(pod["metadata"]["name"])
            self.server.put(pod)
