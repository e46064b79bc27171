"""A stand-in for Kueue's controllers, acting on the emulated API server (test support only).

Kueue cannot run here, so this plays the parts of Kueue and KubeRay that a requeue relies on, for
RayJobs labelled ``kueue.x-k8s.io/queue-name``, each rule as the cited code does it (sources:
kubernetes-sigs/kueue at v0.19.2; the rules below read the same from v0.14.0 to v0.19.2), simplified
to one ClusterQueue with one resource group (its quota: the ClusterQueue object where the test
seeds one, else unlimited; no cohort, no preemption); PodSets are the worker groups
(Kueue also makes ``head`` and ``submitter`` PodSets, which a requeue never changes):

1. Workload controller: ``spec.active: false`` -> ``Evicted=True`` reason ``Deactivated``
   (``pkg/controller/core/workload_controller.go``).
0. Which Workload is the job's: among those it owns, not finished (a replaced slice is ``Finished``,
   reason ``WorkloadSliceReplaced``), the newest holding quota and not evicted, else the newest
   (``pkg/workloadslicing/workloadslicing.go`` ``FindNotFinishedWorkloads`` /
   ``FindLatestActiveWorkload``).
2. Job reconciler, eviction (``pkg/controller/jobframework/reconciler.go`` step 6): suspend the job
   and restore the worker templates' labels, annotations, nodeSelector, tolerations and scheduling
   gates from the Workload's PodSets (``stopJob`` -> ``RestorePodSetsInfo`` -> ``pkg/podset/podset.go``
   ``RestorePodSpec``, v0.19.2: each of the five replaced by the PodSet's, absent when it has none);
   KubeRay's part: ``jobDeploymentStatus: Suspended``; then clear the quota reservation with
   ``Requeued=False`` reason ``Deactivated``.
3. Job reconciler, ``ensureOneWorkload``: the job "matches" its Workload when
   ``EquivalentToWorkload`` holds, which compares PodSets with ``pkg/util/equality/podset.go``
   ``ComparePodSets``/``comparePodTemplate``: count, minCount, tolerations (ignored once the
   Workload is admitted), initContainers and containers, and *nothing else*: not nodeSelector,
   not affinity (:func:`equivalent`).  A suspended job whose Workload holds no quota and does
   not match -> the Workload's spec is rebuilt from the job (``updateWorkloadToMatchJob``,
   ``spec.active`` kept); a running job that does not match -> ``stopJob`` (suspend, restore).
4. Workload controller: re-activated -> ``Requeued=True`` reason ``Reactivated``.
5. Scheduler: an active Workload without quota gets, per PodSet, the first flavor whose
   nodeLabels do not contradict the PodSet's nodeSelector on the flavor's own keys
   (``pkg/scheduler/flavorassigner/flavorassigner.go`` ``checkFlavorForPodSets`` /
   ``flavorSelector``; it reads the *Workload's* PodSets, not the job) **and that has the quota**:
   where the server holds a ClusterQueue, a flavor fits when, for every resource it has a
   ``nominalQuota`` for, the reserved total (``status.flavorsReservation``) plus the PodSet's
   requests (count x the containers' requests, a limit standing for a missing request) stays within
   it (``fitsResourceQuota``: ``Available``; no cohort, no preemption here), else the next matching
   flavor is tried; none matching -> pending (``NoMatchingFlavor``); matching but none with quota
   -> pending: ``QuotaReserved=False``, reason ``Pending``, message "couldn't assign flavors to pod
   set ...: insufficient unused quota ..." (``pkg/scheduler/scheduler.go``).  ``quota_short``
   names flavors whose quota another Workload has used up since (the assigner passes over them
   the same way).  Admitting adds the Workload's requests to ``status.flavorsReservation``;
   releasing the quota (2) takes them off.  Without a ClusterQueue in the server the quota is
   unlimited.  A Workload deactivated while pending and reactivated keeps its stale
   ``Evicted=True`` (the Workload controller sets ``Requeued`` only for one that held quota) and is
   admitted all the same; admission resets ``Evicted`` to false (``pkg/workload/workload.go``
   ``SetQuotaReservation``).
6. Job reconciler, ``startJob``: unsuspend the job and merge each assigned flavor's nodeLabels
   into the job's worker templates (``RunWithPodSetsInfo`` -> ``pkg/podset/podset.go``
   ``FromAssignment`` + ``Merge``): a key the template already sets to another value is a
   ``BadPodSetsUpdateError``, permanent, and the Workload is finished with reason
   ``FailedToStart`` (reconciler.go step 7, ``workloadfinish.Finish``): the run is dead.

7. Workload webhook (``pkg/webhooks/workload_webhook.go`` ``ValidateWorkloadUpdate``, v0.17.0, the
   release the real control plane runs): while the old Workload holds quota its PodSets are
   immutable; a write over HTTP that changes them is refused 403 in the webhook's words
   (:func:`workload_webhook`, checked against the real Kueue by tests/cluster/test_plane.py).

``foreign_suspend_writes`` counts changes of a job's ``spec.suspend`` that this stand-in did not
make: resilienced must never write it (Kueue owns it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
from typing import Any

from tests.support.kubeapi import ApiError, JsonObj, KubeApiServer, ResourceType

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FLAVORS = (
    ("spot", {"karpenter.sh/capacity-type": "spot"}),
    ("capacity-block", {"karpenter.sh/capacity-type": "reserved"}),
    ("on-demand", {"karpenter.sh/capacity-type": "on-demand"}),
)
#: The flavor of no node labels that cpu and memory come from, in a resource group of their own, as
#: deploy/examples/kueue.yaml sets the queue up: Kueue assigns a flavor per resource, so an
#: admitted GPU PodSet has ``{"cpu": "default", "memory": "default", "nvidia.com/gpu": <capacity>}``
#: (v0.17.0 ``pkg/scheduler/flavorassigner``; seen on the real Kueue, tests/cluster/test_daemon.py:
#: until issue #40 this stand-in assigned one flavor under ``cpu``).
DEFAULT_FLAVOR = ("default", {})
GPU = "nvidia.com/gpu"


def capacity_flavor(assignment: dict) -> str:
    """The flavor of a PodSet assignment that carries the capacity (its GPUs')."""
    return str(assignment["flavors"][GPU])


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


def _admit(wl: dict, flavor: str | dict[str, str]) -> None:
    """Admit every PodSet on ``flavor`` (``str``) or on its own flavor (``dict`` name -> flavor)."""
    flavors = flavor if isinstance(flavor, dict) else {ps["name"]: flavor for ps in wl["spec"]["podSets"]}
    wl["status"]["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
        {"name": ps["name"], "flavors": {"cpu": DEFAULT_FLAVOR[0], "memory": DEFAULT_FLAVOR[0], GPU: flavors[ps["name"]]},
         "count": ps["count"]}
        for ps in wl["spec"]["podSets"]]}
    _set_cond(wl, "QuotaReserved", True, "QuotaReserved")
    _set_cond(wl, "Admitted", True, "Admitted")
    if _cond(wl, "Evicted") is not None:  # SetQuotaReservation resets it
        _set_cond(wl, "Evicted", False, "QuotaReserved")


def _flavor_fits(flavor: str, podset: dict) -> bool:
    """Rule 5's label check: the PodSet's nodeSelector does not contradict the flavor's nodeLabels."""
    selector = (podset["template"].get("spec") or {}).get("nodeSelector") or {}
    return not any(k in selector and selector[k] != v for k, v in dict(FLAVORS)[flavor].items())


def _podset_needs(ps: dict) -> dict[str, int]:
    """count x the sum of the containers' requests (a limit standing for a missing request)."""
    needs: dict[str, int] = {}
    for container in (ps["template"].get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for name, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            needs[name] = needs.get(name, 0) + int(value) * int(ps["count"])
    return needs


class _Quota:
    """A ClusterQueue's nominal quota and reserved usage, per (flavor, resource)."""

    def __init__(self, cq: dict) -> None:
        self.cq = cq
        self.nominal = {(f["name"], r["name"]): int(r["nominalQuota"]) for g in cq["spec"]["resourceGroups"]
                        for f in g["flavors"] for r in f["resources"]}
        self.reserved = {(f["name"], r["name"]): int(r.get("total", 0))
                         for f in (cq.get("status") or {}).get("flavorsReservation") or [] for r in f["resources"]}

    def fits(self, flavor: str, needs: dict[str, int]) -> bool:
        return all(self.reserved.get((flavor, r), 0) + n <= self.nominal[(flavor, r)]
                   for r, n in needs.items() if (flavor, r) in self.nominal)

    def add(self, flavor: str, needs: dict[str, int], sign: int) -> None:
        for r, n in needs.items():
            if (flavor, r) in self.nominal:
                self.reserved[(flavor, r)] = self.reserved.get((flavor, r), 0) + sign * n
        by_flavor: dict[str, list] = {}
        for (f, r), total in sorted(self.reserved.items()):
            by_flavor.setdefault(f, []).append({"name": r, "total": str(total), "borrowed": "0"})
        self.cq.setdefault("status", {})["flavorsReservation"] = [
            {"name": f, "resources": rs} for f, rs in by_flavor.items()]


def _containers_equal(a: list | None, b: list | None) -> bool:
    return (a or []) == (b or [])  # equality.Semantic.DeepEqual: nil and empty slices are equal


def equivalent(job: dict, wl: dict) -> bool:
    """Rule 3: ``EquivalentToWorkload`` with ``ComparePodSets`` (podset.go, v0.14.0..v0.19.2).

    Count, minCount, tolerations (unless the Workload is admitted), initContainers and
    containers; nodeSelector and affinity are not compared.
    """
    podsets, groups = wl["spec"]["podSets"], _groups(job)
    if len(podsets) != len(groups):
        return False
    admitted = (_cond(wl, "Admitted") or {}).get("status") == "True"
    for ps, group in zip(podsets, groups):
        a, b = group["template"].get("spec") or {}, ps["template"].get("spec") or {}
        if group["replicas"] != ps["count"] or group.get("minCount") != ps.get("minCount"):
            return False
        if not admitted and (a.get("tolerations") or []) != (b.get("tolerations") or []):
            return False
        if not (_containers_equal(a.get("initContainers"), b.get("initContainers"))
                and _containers_equal(a.get("containers"), b.get("containers"))):
            return False
    return True


def _go_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


#: The words of rule 7's denial of one changed PodSet (index, then its JSON), as the real Kueue
#: v0.17.0 answers (tests/cluster/test_plane.py holds the real one to it).
PODSET_REFUSAL = re.compile(r'admission webhook "vworkload\.kb\.io" denied the request: '
                            r"spec\.podSets\.(\d+): Invalid value: \{.*\}: field is immutable")


def workload_webhook(rtype: ResourceType, new: JsonObj, old: JsonObj | None) -> None:
    """Rule 7: Kueue's validating webhook ``vworkload.kb.io`` on a Workload update (a denial is
    403 Forbidden with the field errors aggregated: one as it is, several in brackets; the
    invalid value is the new PodSet, or the new list when the count differs)."""
    if old is None or (rtype.group, rtype.plural) != ("kueue.x-k8s.io", "workloads"):
        return
    if (_cond(old, "QuotaReserved") or {}).get("status") != "True":
        return
    before = (old.get("spec") or {}).get("podSets") or []
    after = (new.get("spec") or {}).get("podSets") or []
    if len(after) != len(before):
        errors = [f"spec.podSets: Invalid value: {_go_json(after)}: field is immutable"]
    else:
        errors = [f"spec.podSets.{i}: Invalid value: {_go_json(a)}: field is immutable"
                  for i, (a, b) in enumerate(zip(after, before)) if a != b]
    if errors:
        text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        raise ApiError(403, f'admission webhook "vworkload.kb.io" denied the request: {text}')


class KueueSim:
    """Runs the rules above every ``interval`` seconds until stopped (use ``async with``); rule 7
    is registered on the server from the start."""

    def __init__(self, server: KubeApiServer, *, namespace: str, interval: float = 0.01) -> None:
        self.server = server
        if workload_webhook not in server.webhooks:
            server.webhooks.append(workload_webhook)
        self.namespace = namespace
        self.interval = interval
        self.admitted: list[str] = []  # flavors admitted on, in order ("a+b" when PodSets differ)
        self.no_matching_flavor = 0
        self.no_quota: list[str] = []  # rule 5: why a Workload stayed pending for quota
        self.failed_to_start: list[str] = []  # rule 6 conflicts: the message Kueue finishes the Workload with
        self.workload_updates = 0  # rule 3 rebuilds of a Workload from its job
        self.foreign_suspend_writes = 0
        self.quota_short: set[str] = set()  # rule 5: flavors whose quota is used up
        self.no_fit = 0  # rule 5 passes that left a Workload pending for quota
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
            wl = self._job_workload(wls)
            if wl is not None:
                self._reconcile(job, wl)

    @staticmethod
    def _job_workload(wls: list[dict]) -> dict | None:
        """The Workload the job reconciler acts on: not finished (a replaced slice is Finished,
        reason ``WorkloadSliceReplaced``), the newest holding quota and not evicted, else the newest
        (``pkg/workloadslicing/workloadslicing.go`` ``FindNotFinishedWorkloads`` /
        ``FindLatestActiveWorkload``, oldest-first by creationTimestamp then uid)."""
        live = sorted((w for w in wls if (_cond(w, "Finished") or {}).get("status") != "True"),
                      key=lambda w: (w["metadata"].get("creationTimestamp", ""), w["metadata"].get("uid", "")))
        holding = [w for w in live if (_cond(w, "QuotaReserved") or {}).get("status") == "True"
                   and (_cond(w, "Evicted") or {}).get("status") != "True"]
        return (holding or live or [None])[-1]

    def _check_suspend(self, job: dict) -> None:
        name, suspend = job["metadata"]["name"], bool(job["spec"].get("suspend"))
        if name in self._suspend_seen and self._suspend_seen[name] != suspend:
            self.foreign_suspend_writes += 1
        self._suspend_seen[name] = suspend

    def _put_job(self, job: dict) -> None:
        self.server.put(job)
        self._suspend_seen[job["metadata"]["name"]] = bool(job["spec"].get("suspend"))

    def _reconcile(self, job: dict, wl: dict) -> None:
        if (_cond(wl, "Finished") or {}).get("status") == "True":
            return
        active = wl["spec"].get("active", True) is not False
        evicted = (_cond(wl, "Evicted") or {}).get("status") == "True"
        has_quota = bool(wl["status"].get("admission"))
        suspended = bool(job["spec"].get("suspend"))
        if not active and not evicted:  # 1
            _set_cond(wl, "Evicted", True, "Deactivated")
            self.server.put(wl)
            return
        if (evicted or not equivalent(job, wl)) and not suspended:  # 2 (and 3, a running job that no longer matches)
            self._stop(job, wl)
            return
        if evicted and has_quota and job["status"].get("jobDeploymentStatus") == "Suspended":
            self._account(wl, -1)
            wl["status"].pop("admission", None)
            _set_cond(wl, "QuotaReserved", False, "Pending")
            _set_cond(wl, "Admitted", False, "NoReservation")
            _set_cond(wl, "Requeued", False, "Deactivated")
            self.server.put(wl)
            return
        if suspended and not has_quota and not equivalent(job, wl):  # 3: updateWorkloadToMatchJob
            for ps, group in zip(wl["spec"]["podSets"], _groups(job)):
                ps["template"], ps["count"] = copy.deepcopy(group["template"]), group["replicas"]
            self.workload_updates += 1
            self.server.put(wl)
            return
        requeued = _cond(wl, "Requeued") or {}
        if active and requeued.get("status") == "False" and requeued.get("reason") == "Deactivated":  # 4
            _set_cond(wl, "Requeued", True, "Reactivated")
            _set_cond(wl, "Evicted", False, "Reactivated")
            self.server.put(wl)
            return
        if active and not has_quota:  # 5 (a stale Evicted=True of a Workload deactivated while pending is ignored)
            self._schedule(wl)
            return
        if suspended and has_quota and active and not evicted:  # 6
            self._start(job, wl)

    def _clusterqueue(self) -> _Quota | None:
        try:
            queues = self.server.list("clusterqueues")
        except KeyError:  # the server does not serve ClusterQueues: unlimited quota
            return None
        return _Quota(queues[0]) if queues else None

    def _schedule(self, wl: dict) -> None:
        """Rule 5: a flavor per PodSet whose labels match and whose quota fits, or pending."""
        quota = self._clusterqueue()
        flavors: dict[str, str] = {}
        for ps in wl["spec"]["podSets"]:
            matching = [name for name, _ in FLAVORS if _flavor_fits(name, ps)]
            if not matching:
                self.no_matching_flavor += 1
                return
            needs = _podset_needs(ps)
            fitting = [f for f in matching
                       if f not in self.quota_short and (quota is None or quota.fits(f, needs))]
            if not fitting:
                resource = next(iter(needs), "cpu")  # the message of flavorassigner.go (v0.19.2)
                self._pending(wl, f"couldn't assign flavors to pod set {ps['name']}: " + ", ".join(
                    f"insufficient unused quota for {resource} in flavor {f}" for f in matching))
                return
            flavors[ps["name"]] = fitting[0]
            if quota is not None:
                quota.add(fitting[0], needs, +1)  # the next PodSet sees this one's usage
        _admit(wl, flavors)
        self.admitted.append("+".join(sorted(set(flavors.values()))))
        self.server.put(wl)
        if quota is not None:
            self.server.put(quota.cq)

    def _account(self, wl: dict, sign: int) -> None:
        """Add (+1) or take off (-1) an admitted Workload's requests in the ClusterQueue's status."""
        quota = self._clusterqueue()
        if quota is None or not wl["status"].get("admission"):
            return
        podsets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
        for assignment in wl["status"]["admission"]["podSetAssignments"]:
            quota.add(capacity_flavor(assignment), _podset_needs(podsets[assignment["name"]]), sign)
        self.server.put(quota.cq)

    def _pending(self, wl: dict, message: str) -> None:
        """Matching flavors but no quota: pending, written once per message (no write loop)."""
        self.no_fit += 1
        self.no_quota.append(message)
        if (_cond(wl, "QuotaReserved") or {}).get("message") != message:
            _set_cond(wl, "QuotaReserved", False, "Pending")
            wl["status"]["conditions"][-1]["message"] = message
            self.server.put(wl)

    def _stop(self, job: dict, wl: dict) -> None:
        """``stopJob``: suspend, and restore the template's labels, annotations, nodeSelector,
        tolerations and schedulingGates from the Workload's PodSet (``RestorePodSpec``)."""
        podsets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
        for group in _groups(job):
            template = podsets[group["groupName"].lower()]["template"]
            for holder, original, keys in (
                    (group["template"].setdefault("metadata", {}), template.get("metadata") or {},
                     ("labels", "annotations")),
                    (group["template"]["spec"], template.get("spec") or {},
                     ("nodeSelector", "tolerations", "schedulingGates"))):
                for key in keys:
                    if original.get(key):
                        holder[key] = copy.deepcopy(original[key])
                    else:
                        holder.pop(key, None)
        job["spec"]["suspend"] = True
        job["status"]["jobDeploymentStatus"] = "Suspended"
        self._put_job(job)

    def _start(self, job: dict, wl: dict) -> None:
        """``startJob``: merge each PodSet's flavor nodeLabels into the job's template, unsuspend.

        A conflicting key fails the merge (``PodSetInfo.Merge`` -> ``utilmaps.HaveConflict``):
        the Workload is finished with ``FailedToStart`` and the job stays suspended.
        """
        flavor_of = {a["name"]: capacity_flavor(a) for a in wl["status"]["admission"]["podSetAssignments"]}
        labels_of = dict(FLAVORS)
        for group in _groups(job):
            selector = group["template"]["spec"].setdefault("nodeSelector", {})
            labels = labels_of[flavor_of[group["groupName"].lower()]]
            conflict = {k: (selector[k], v) for k, v in labels.items() if k in selector and selector[k] != v}
            if conflict:
                message = f"invalid podSetUpdate nodeSelector: conflict on {conflict}"
                self.failed_to_start.append(message)
                _set_cond(wl, "Finished", True, "FailedToStart")
                self.server.put(wl)
                return
            selector.update(labels)
        job["spec"]["suspend"] = False
        job["status"]["jobDeploymentStatus"] = "Running"
        self._put_job(job)
