"""A stand-in for Kueue's controllers, acting on the emulated API server (test support only).

Kueue cannot run here, so this plays the parts of Kueue (v0.19.2) and KubeRay that a requeue
relies on, for RayJobs labelled ``kueue.x-k8s.io/queue-name``, each rule as the cited code does it
(simplified to one ClusterQueue with one resource group and unlimited quota):

1. Workload controller: ``spec.active: false`` -> ``Evicted=True`` reason ``Deactivated``
   (``pkg/controller/core/workload_controller.go``).
2. Job reconciler, eviction (``reconciler.go`` step 6): suspend the job and restore the worker
   templates' nodeSelector/tolerations from the Workload's PodSets (``stopJob`` ->
   ``RestorePodSetsInfo``); KubeRay's part: ``jobDeploymentStatus: Suspended``; then clear the
   quota reservation with ``Requeued=False`` reason ``Deactivated``.
3. Job reconciler, ``ensureOneWorkload``: a suspended job whose Workload holds no quota and no
   longer matches it -> the Workload's PodSets are updated in place (``updateWorkloadToMatchJob``,
   ``spec.active`` kept).
4. Workload controller: re-activated -> ``Requeued=True`` reason ``Reactivated``.
5. Scheduler: an active, unadmitted Workload is admitted on the first flavor whose nodeLabels
   match every PodSet's nodeSelector on the flavor's own keys (``flavorassigner.go``
   ``flavorSelector``); none matching leaves it pending (``NoMatchingFlavor``).
6. Job reconciler, ``startJob``: unsuspend the job and add the flavor's nodeLabels to the worker
   templates' nodeSelector.

``foreign_suspend_writes`` counts changes of a job's ``spec.suspend`` that this stand-in did not
make: resilienced must never write it (Kueue owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

from tests.support.kubeapi import KubeApiServer

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FLAVORS = (
    ("spot", {"karpenter.sh/capacity-type": "spot"}),
    ("capacity-block", {"karpenter.sh/capacity-type": "reserved"}),
    ("on-demand", {"karpenter.sh/capacity-type": "on-demand"}),
)


def _cond(obj: dict, type_: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def _set_cond(obj: dict, type_: str, status: bool, reason: str) -> None:
    conds = obj.setdefault("status", {}).setdefault("conditions", [])
    conds[:] = [c for c in conds if c["type"] != type_]
    conds.append({"type": type_, "status": "True" if status else "False", "reason": reason, "message": reason,
                  "lastTransitionTime": "2026-08-20T12:00:00Z"})


def _groups(job: dict) -> list[dict]:
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"]


def workload_for(job: dict, *, name: str | None = None, flavor: str | None = None) -> dict:
    """The Workload Kueue makes for ``job`` (PodSets from its templates), admitted on ``flavor``."""
    meta = job["metadata"]
    wl: dict[str, Any] = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": name or f"rayjob-{meta['name']}-1a2b3", "namespace": meta["namespace"],
                     "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                     "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayJob", "name": meta["name"],
                                          "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"active": True, "queueName": meta["labels"][QUEUE_LABEL], "podSets": [
            {"name": g["groupName"].lower(), "count": g["replicas"], "template": copy.deepcopy(g["template"])}
            for g in _groups(job)]},
        "status": {},
    }
    if flavor:
        _admit(wl, flavor)
    return wl


def _admit(wl: dict, flavor: str) -> None:
    wl["status"]["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
        {"name": ps["name"], "flavors": {"cpu": flavor}, "count": ps["count"]} for ps in wl["spec"]["podSets"]]}
    _set_cond(wl, "QuotaReserved", True, "QuotaReserved")
    _set_cond(wl, "Admitted", True, "Admitted")


def _matching_flavor(wl: dict) -> str | None:
    for name, labels in FLAVORS:
        ok = True
        for ps in wl["spec"]["podSets"]:
            selector = (ps["template"].get("spec") or {}).get("nodeSelector") or {}
            if any(k in selector and selector[k] != v for k, v in labels.items()):
                ok = False
        if ok:
            return name
    return None


class KueueSim:
    """Runs the rules above every ``interval`` seconds until stopped (use ``async with``)."""

    def __init__(self, server: KubeApiServer, *, namespace: str, interval: float = 0.01) -> None:
        self.server = server
        self.namespace = namespace
        self.interval = interval
        self.admitted: list[str] = []  # flavors admitted on, in order
        self.no_matching_flavor = 0
        self.foreign_suspend_writes = 0
        self._suspend_seen: dict[str, bool] = {}
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> KueueSim:
        self._task = asyncio.create_task(self._run(), name="kueue-sim")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            self.step()
            await asyncio.sleep(self.interval)

    # ------------------------------------------------------------------ one pass
    def step(self) -> None:
        for job in self.server.list("rayjobs", namespace=self.namespace):
            if not (job["metadata"].get("labels") or {}).get(QUEUE_LABEL):
                continue
            self._check_suspend(job)
            wls = [w for w in self.server.list("workloads", namespace=self.namespace)
                   if any(r["uid"] == job["metadata"]["uid"] for r in w["metadata"].get("ownerReferences", []))]
            if wls:
                self._reconcile(job, wls[0])

    def _check_suspend(self, job: dict) -> None:
        name, suspend = job["metadata"]["name"], bool(job["spec"].get("suspend"))
        if name in self._suspend_seen and self._suspend_seen[name] != suspend:
            self.foreign_suspend_writes += 1
        self._suspend_seen[name] = suspend

    def _put_job(self, job: dict) -> None:
        self.server.put(job)
        self._suspend_seen[job["metadata"]["name"]] = bool(job["spec"].get("suspend"))

    def _reconcile(self, job: dict, wl: dict) -> None:
        active = wl["spec"].get("active", True) is not False
        evicted = (_cond(wl, "Evicted") or {}).get("status") == "True"
        has_quota = bool(wl["status"].get("admission"))
        suspended = bool(job["spec"].get("suspend"))
        if not active and not evicted:  # 1
            _set_cond(wl, "Evicted", True, "Deactivated")
            self.server.put(wl)
            return
        if evicted and not suspended:  # 2: stop the job, restore templates
            podsets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
            for group in _groups(job):
                original = podsets[group["groupName"].lower()]["template"].get("spec") or {}
                spec = group["template"]["spec"]
                for key in ("nodeSelector", "tolerations"):
                    if key in original:
                        spec[key] = copy.deepcopy(original[key])
                    else:
                        spec.pop(key, None)
            job["spec"]["suspend"] = True
            job["status"]["jobDeploymentStatus"] = "Suspended"
            self._put_job(job)
            return
        if evicted and has_quota and job["status"].get("jobDeploymentStatus") == "Suspended":
            wl["status"].pop("admission", None)
            _set_cond(wl, "QuotaReserved", False, "Pending")
            _set_cond(wl, "Admitted", False, "NoReservation")
            _set_cond(wl, "Requeued", False, "Deactivated")
            self.server.put(wl)
            return
        if suspended and not has_quota:  # 3: keep the Workload in step with the suspended job
            wanted = [copy.deepcopy(g["template"]) for g in _groups(job)]
            if [ps["template"] for ps in wl["spec"]["podSets"]] != wanted:
                for ps, template in zip(wl["spec"]["podSets"], wanted):
                    ps["template"] = template
                self.server.put(wl)
                return
        requeued = _cond(wl, "Requeued") or {}
        if active and requeued.get("status") == "False" and requeued.get("reason") == "Deactivated":  # 4
            _set_cond(wl, "Requeued", True, "Reactivated")
            _set_cond(wl, "Evicted", False, "Reactivated")
            self.server.put(wl)
            return
        if active and not evicted and not has_quota:  # 5
            flavor = _matching_flavor(wl)
            if flavor is None:
                self.no_matching_flavor += 1
                return
            _admit(wl, flavor)
            self.admitted.append(flavor)
            self.server.put(wl)
            return
        if suspended and has_quota and active and not evicted:  # 6
            flavor = wl["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"]
            labels = dict(FLAVORS)[flavor]
            for group in _groups(job):
                group["template"]["spec"].setdefault("nodeSelector", {}).update(labels)
            job["spec"]["suspend"] = False
            job["status"]["jobDeploymentStatus"] = "Running"
            self._put_job(job)
