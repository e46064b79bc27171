"""Requeue a RayJob or RayCluster that Kueue manages (label ``kueue.x-k8s.io/queue-name``).

Kueue owns ``spec.suspend`` of the job (its webhook suspends at creation, its job reconciler
unsuspends at admission and suspends at eviction); resilienced never writes it.  Kueue admits a
Workload on the **first** flavor of the ClusterQueue's resource group that has quota *and* whose
``nodeLabels`` do not contradict the pods' node selector / required node affinity; it tracks
quota, not whether EC2 has the instances.  So a plain evict-and-requeue would land the run on the
Spot flavor again.  The mechanism (sources: kubernetes-sigs/kueue at tag v0.19.2):

1. **Evict through Kueue**: set ``Workload.spec.active: false``.  The Workload controller sets
   ``Evicted=True`` (reason ``Deactivated``); the job reconciler stops the job as a whole
   (``stopJob``: ``spec.suspend: true``, pod templates restored from the Workload's PodSets, so
   Kueue's injected flavor labels go away; KubeRay then deletes the RayCluster's pods), and once
   the job is inactive it clears the quota reservation (``status.admission``), with
   ``Requeued=False`` reason ``Deactivated`` (``pkg/controller/core/workload_controller.go``,
   ``pkg/controller/jobframework/reconciler.go`` step 6).  resilienced marks the Workload with
   ``resilienced.io/deactivated-for`` so it only ever re-activates what it deactivated.
2. **Steer** once the job is suspended and the Workload holds no quota: patch every worker
   group's node selector to the decided capacity (``karpenter.sh/capacity-type``: ``spot`` |
   ``reserved`` | ``on-demand``, plus ``karpenter.k8s.aws/capacity-reservation-id`` for a
   block); the same selector goes into the Workload's worker PodSets, in the write of step 3
   that reactivates it (one Workload write, not two: issue #45).  resilienced does not wait
   for Kueue to copy the job into the Workload: Kueue re-reads a suspended job only when it no
   longer "matches" (``EquivalentToWorkload`` -> ``pkg/util/equality/podset.go``
   ``comparePodTemplate``, v0.14 to v0.19: counts, tolerations, init containers and containers,
   never nodeSelector or affinity), so a block -> block move (only the reservation id changes)
   or identical per-capacity tolerations would never be seen, and the flavor assigner reads the
   Workload's PodSets.  The webhook lets PodSets change while there is no quota reservation
   (``pkg/webhooks/workload_webhook.go`` ``ValidateWorkloadUpdate``); the job still matches the
   Workload after the write (same tolerations and containers on both sides).
3. **Requeue through Kueue**: set ``spec.active: true``.  Kueue sets ``Requeued=True`` (reason
   ``Reactivated``) and queues it; the flavor assigner skips every flavor whose ``nodeLabels``
   contradict the selector on that flavor's own keys (``flavorassigner.go``
   ``checkFlavorForPodSets`` / ``flavorSelector``), so with ClusterQueue flavors
   spot -> capacity-block -> on-demand labelled by ``karpenter.sh/capacity-type``, the run is
   admitted on the decided flavor; Kueue then unsuspends the job and merges that flavor's
   ``nodeLabels`` and tolerations into the job's templates (``reconciler.go`` ``startJob`` ->
   ``pkg/podset/podset.go`` ``Merge``), which keep the reservation id resilienced set: the pods
   land on the decided block.  (A flavor label that contradicts the job's selector would fail
   the merge and finish the Workload with ``FailedToStart``; steering the PodSets prevents it.)

What does not work, and why it is not used: flipping ``spec.suspend`` (Kueue owns it and
reverts it); patching the templates of a *running* job (Kueue sees a job that no longer matches
its Workload, suspends it and restores the templates from the old Workload, undoing the
patch: ``stopJob`` -> ``RestorePodSetsInfo``); the scheduler's ``LastAssignment`` /
``NextFlavorToTryForPodSetResource`` (in-memory scan progress of one scheduling cycle, reset on
eviction; not an API); setting an ``Evicted`` condition by hand (status is Kueue's, and the
reasons that requeue at once, ``Preempted``/``NodeFailures``, would requeue on the same flavor).

Each step reads the current state first, so a redelivered event resumes where a previous attempt
stopped, and a second application of the same decision changes nothing.  Waiting for Kueue is
bounded (``settle_timeout_s``); when it runs out a TemporaryError leaves the message for later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import TypeVar

from kubernetes_asyncio import client as k8s

from resilienced.clock import utcnow
from resilienced.errors import PermanentError, TemporaryError
from resilienced.kube.api import JsonObj
from resilienced.kube.discovery import served_version
from resilienced.kube.locate import kueue_manages
from resilienced.log import get as get_logger
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.requeue.elastic import ElasticKueue, kueue_not_elastic, with_fallback
from resilienced.requeue.kuberay import groups_patch, placed_groups
from resilienced.requeue.objects import (
    RAYCLUSTER,
    RAYJOB,
    Kind,
    Objects,
    annotations_of,
    modify,
    split_key,
    workload_kind,
)
from resilienced.requeue.placement import DEFAULT_TOLERATIONS, Placement

T = TypeVar("T")
log = get_logger(__name__)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Workload versions in order of preference: v1beta2 from Kueue v0.15, v1beta1 only up to v0.14
#: (and still served, deprecated, by v0.15-v0.19).  Both have spec.active and spec.podSets.
WORKLOAD_VERSIONS = ("v1beta2", "v1beta1")
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
DEACTIVATED_FOR = "resilienced.io/deactivated-for"


async def discover_workload_version(api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> str | None:
    """The Workload version the API server serves (``v1beta2`` preferred), None without Kueue."""
    version = await served_version(api_client, group="kueue.x-k8s.io", plural="workloads",
                                   versions=WORKLOAD_VERSIONS, request_timeout_s=request_timeout_s)
    if version is None:
        log.warning("kueue: no Workload version served; Kueue-managed runs cannot be requeued",
                    versions=list(WORKLOAD_VERSIONS))
    else:
        log.info("kueue: Workloads served", version=f"kueue.x-k8s.io/{version}")
    return version


def is_kueue_managed(obj: Mapping[str, JsonValue]) -> bool:
    """The queue label, and not a RayJob with ``spec.clusterSelector`` (Kueue skips it:
    ``resilienced.kube.locate.kueue_manages``)."""
    return kueue_manages(obj)


def is_active(workload: Mapping[str, JsonValue]) -> bool:
    """``spec.active`` (absent means true, Kueue's default)."""
    return (workload.get("spec") or {}).get("active", True) is not False


def owned_by(workload: Mapping[str, JsonValue], job: Mapping[str, JsonValue], kind: Kind) -> bool:
    """Whether ``job`` (a ``kind``) is the Workload's controller (its ownerReference, by uid)."""
    uid = (job.get("metadata") or {}).get("uid")
    return any(ref.get("controller") and ref.get("uid") == uid and ref.get("kind") == kind.kind
               for ref in (workload.get("metadata") or {}).get("ownerReferences") or [])


def has_quota(workload: Mapping[str, JsonValue]) -> bool:
    """Whether the Workload holds a quota reservation (``status.admission`` / QuotaReserved)."""
    status = workload.get("status") or {}
    if status.get("admission"):
        return True
    return any(c.get("type") == "QuotaReserved" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def _condition_true(workload: Mapping[str, JsonValue], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (workload.get("status") or {}).get("conditions") or [])


def active_workload(workloads: Sequence[Mapping[str, JsonValue]]) -> JsonObj | None:
    """The job's Workload among those it owns, chosen as Kueue chooses it.

    With workload slices a job owns several Workloads: replaced slices stay, ``Finished`` (reason
    ``WorkloadSliceReplaced``), and a scale-up waits as a new slice without quota.  Kueue's active one
    is the newest (creationTimestamp, then uid) that is not finished, not evicted and holds a quota
    reservation (kubernetes-sigs/kueue v0.19.2 ``pkg/workloadslicing/workloadslicing.go``
    ``FindNotFinishedWorkloads`` / ``FindLatestActiveWorkload``; ``pkg/workload/finish`` ``IsFinished``,
    ``pkg/workload/evict`` ``IsEvicted``).  ``resourceVersion`` is opaque and says nothing about it.

    In order: a Workload resilienced deactivated and has not reactivated yet (a requeue under way
    resumes on it; Kueue marks it evicted); the newest not evicted holding quota; the newest not
    evicted (pending, no quota yet); the newest not finished (evicted by someone else: an
    operator's deactivation, a preemption).  Deleted and finished Workloads are never chosen.
    """
    live = [w for w in workloads
            if not (w.get("metadata") or {}).get("deletionTimestamp") and not _condition_true(w, "Finished")]
    live.sort(key=lambda w: (str((w.get("metadata") or {}).get("creationTimestamp") or ""),
                             str((w.get("metadata") or {}).get("uid") or "")))
    ours = [w for w in live if not is_active(w) and annotations_of(w).get(DEACTIVATED_FOR)]
    admitted = [w for w in live if has_quota(w) and not _condition_true(w, "Evicted")]
    pending = [w for w in live if not _condition_true(w, "Evicted")]
    for chosen in (ours, admitted, pending, live):
        if chosen:
            return dict(chosen[-1])
    return None


def _worker_groups(job: Mapping[str, JsonValue], path: tuple[str, ...]) -> list[dict[str, JsonValue]]:
    holder: JsonValue = job
    for key in path:
        holder = (holder or {}).get(key) or {}
    return list(holder.get("workerGroupSpecs") or [])


def _suspended(job: Mapping[str, JsonValue]) -> bool:
    return bool((job.get("spec") or {}).get("suspend"))


class KueueRequeuer:
    """:class:`~resilienced.ports.Requeuer` for Kueue-managed RayJobs and RayClusters.

    Args:
        api_client: a kubernetes_asyncio ApiClient (the caller's).
        workload_version: ``v1beta2`` (Kueue >= 0.15) or ``v1beta1`` (Kueue 0.14), as
            :func:`discover_workload_version` finds it; None: the server serves no Workloads
            (Kueue not installed), and every Kueue requeue is refused saying so.
        tolerations: per-capacity tolerations for the worker templates.
        settle_timeout_s: how long to wait for Kueue at each step before a TemporaryError.
        poll_interval_s: how often Kueue's progress is read while waiting.
        request_timeout_s: time allowed for one Kubernetes request.
        clock: the current tz-aware time (for the moved-at annotation).
    """

    kind = "kueue"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        workload_version: str | None = "v1beta2",
        tolerations: Mapping[Capacity, Sequence[Mapping[str, str]]] = DEFAULT_TOLERATIONS,
        settle_timeout_s: float = 60.0,
        poll_interval_s: float = 0.5,
        request_timeout_s: float = 10.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        if settle_timeout_s <= 0 or poll_interval_s <= 0:
            raise ValueError("settle_timeout_s and poll_interval_s must be positive")
        self.objects = Objects(api_client, request_timeout_s=request_timeout_s)
        self._workload = workload_kind(workload_version) if workload_version else None
        self._tolerations = tolerations
        self._settle = settle_timeout_s
        self._poll = poll_interval_s
        self._clock = clock
        self._elastic = ElasticKueue(self.objects)

    @property
    def workload(self) -> Kind:
        """The Workload kind in the served version."""
        if self._workload is None:
            raise PermanentError("requeue: the API server serves no Kueue Workload version")
        return self._workload

    # ------------------------------------------------------------------ finding things
    def _job_ref(self, target: Target) -> tuple[Kind, str, str, tuple[str, ...]]:
        if target.ray_job:
            namespace, name = split_key(target.ray_job, what="target.ray_job")
            return RAYJOB, namespace, name, ("spec", "rayClusterSpec")
        if target.ray_cluster:
            namespace, name = split_key(target.ray_cluster, what="target.ray_cluster")
            return RAYCLUSTER, namespace, name, ("spec",)
        raise PermanentError(f"requeue: target {target.run_key} names no RayJob or RayCluster")

    async def find_workload(self, job: Mapping[str, JsonValue], kind: Kind) -> JsonObj | None:
        """The job's Workload as Kueue chooses it (:func:`active_workload`) among those it owns
        (controller ownerReference to the job's uid).

        Listed by Kueue's ``kueue.x-k8s.io/job-uid`` label first; Kueue omits the label when
        the uid is not a valid label value, so fall back to every Workload of the namespace.
        """
        meta = job["metadata"]
        uid, namespace = meta.get("uid"), meta["namespace"]
        candidates = [w for w in await self.objects.list(self.workload, namespace,
                                                         label_selector=f"{JOB_UID_LABEL}={uid}")
                      if owned_by(w, job, kind)]
        if not candidates:
            candidates = [w for w in await self.objects.list(self.workload, namespace) if owned_by(w, job, kind)]
        return active_workload(candidates)

    async def _wait(self, read: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str) -> T:
        deadline = time.monotonic() + self._settle
        while True:
            state = await read()
            if done(state):
                return state
            if time.monotonic() >= deadline:
                raise TemporaryError(f"requeue: timed out after {self._settle:g}s waiting for {what}",
                                     delay=self._poll * 10)
            await asyncio.sleep(self._poll)

    # ------------------------------------------------------------------ the requeue
    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        fallback = None
        if target.facts.elastic is True:
            kind, namespace, name, _path = self._job_ref(target)
            if kind is RAYJOB:
                fallback = (f"Kueue manages RayJob {namespace}/{name}: Kueue (v0.14 - v0.19) scales a RayJob's "
                            "Workload only through the Ray autoscaler; requeued as a gang")
            else:
                cluster = await self.objects.find(kind, namespace, name)
                wl = await self.find_workload(cluster, kind) if cluster is not None and self._workload else None
                fallback = kueue_not_elastic(wl, f"RayCluster {namespace}/{name}")
                if fallback is None and cluster is not None:
                    placement = (Placement.for_decision(decision, tolerations=self._tolerations,
                                                        shape=target.facts.node_shape)
                                 if decision.places else None)
                    return await self._elastic.requeue(target, cluster, decision=decision, placement=placement,
                                                       event=event, dry_run=dry_run)
        return with_fallback(await self._gang(target, decision=decision, event=event, dry_run=dry_run), fallback)

    async def _gang(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        kind, namespace, name, path = self._job_ref(target)
        key = f"{kind.kind} {namespace}/{name}"
        job = await self.objects.find(kind, namespace, name)
        if job is None:
            raise PermanentError(f"requeue: {key} no longer exists")
        if not is_kueue_managed(job):
            raise PermanentError(f"requeue: {key} has no {QUEUE_LABEL} label, or is a RayJob with "
                                 "spec.clusterSelector (Kueue skips those): Kueue does not manage it")
        if not decision.places:
            return RequeueResult.waiting(target, kind=self.kind, decision=decision, dry_run=dry_run)
        if self._workload is None:
            raise PermanentError(f"requeue: {key} is Kueue-managed but the API server serves no Kueue "
                                 f"Workload version ({', '.join(WORKLOAD_VERSIONS)}): is Kueue installed?")
        placement = Placement.for_decision(decision, tolerations=self._tolerations, shape=target.facts.node_shape)
        wl = await self.find_workload(job, kind)

        def placed(j: Mapping[str, JsonValue]) -> bool:
            # The node selector decides the flavor; Kueue adds the flavor's own tolerations.
            return all(placement.selector_matches((g.get("template") or {}).get("spec") or {})
                       for g in _worker_groups(j, path))

        ours = wl is not None and bool(annotations_of(wl).get(DEACTIVATED_FOR))
        if placed(job) and not (wl is not None and not is_active(wl) and ours):
            return self._result(target, decision, placement, [], dry_run,
                                f"already on {decision.capacity.value}: Kueue admitted it on a flavor with "
                                f"{placement.describe()}")
        if wl is None:
            raise TemporaryError(f"requeue: Kueue has not made the Workload of {key} yet", delay=5.0)
        wl_key = f"Workload {namespace}/{wl['metadata']['name']}"

        if dry_run:
            steps = _planned_steps(key, wl_key, placement, placed=placed(job))
            return self._result(target, decision, placement, steps, True, "plan only")
        changes = await self._move(kind, namespace, name, path, job=job, wl=wl, placement=placement, placed=placed,
                                   event=event, decision=decision)
        reason = (f"requeued through Kueue onto {decision.capacity.value}" if changes
                  else f"already on {decision.capacity.value}")
        return self._result(target, decision, placement, changes, False, reason)

    async def _move(self, kind: Kind, namespace: str, name: str, path: tuple[str, ...], *, job: JsonObj,
                    wl: JsonObj, placement: Placement, placed: Callable[[Mapping[str, JsonValue]], bool],
                    decision: CapacityDecision, event: Event) -> list[str]:
        """Evict the run through Kueue, steer its job and its Workload to ``placement``, requeue it;
        the changes made, in words."""
        key = f"{kind.kind} {namespace}/{name}"
        wl_key = f"Workload {namespace}/{wl['metadata']['name']}"
        changes: list[str] = []
        # 1. evict through Kueue
        if not placed(job) and is_active(wl):
            await self.objects.patch(self.workload, namespace, wl["metadata"]["name"], {
                "metadata": {"annotations": {DEACTIVATED_FOR: event.event_id or "resilienced"}},
                "spec": {"active": False},
            })
            changes.append(f"deactivated {wl_key}: Kueue evicts the whole run and suspends {key}")

        async def state() -> tuple[JsonObj, JsonObj | None]:
            j = await self.objects.get(kind, namespace, name)
            return j, await self.find_workload(j, kind)

        # 2. wait until Kueue stopped the job and released its quota, then steer the job
        if not placed(job):
            await self._wait(state, lambda s: _suspended(s[0]) and (s[1] is None or not has_quota(s[1])),
                             what=f"Kueue to suspend {key} and release its quota")
            changes += await self._steer_job(kind, namespace, name, path, placement, decision=decision, event=event)

        # 3. make the Workload's PodSets ask for the decided capacity and requeue it, in one write
        job, wl = await state()
        if wl is not None and not is_active(wl) and annotations_of(wl).get(DEACTIVATED_FOR):
            job, wl = await self._wait(
                state, lambda s: _suspended(s[0]) and s[1] is not None and not has_quota(s[1]),
                what=f"Kueue to suspend {key} and release its quota")
            assert wl is not None
            changes += await self._requeue_workload(namespace, wl["metadata"]["name"], _worker_groups(job, path),
                                                    placement)
        return changes

    async def _steer_job(self, kind: Kind, namespace: str, name: str, path: tuple[str, ...], placement: Placement,
                         *, decision: CapacityDecision, event: Event) -> list[str]:
        """Set every worker group of the suspended job to ``placement`` (conditional merge patch)."""
        key = f"{kind.kind} {namespace}/{name}"
        now = self._clock()

        def change(j: JsonObj) -> dict[str, JsonValue] | None:
            if not _suspended(j):
                raise TemporaryError(f"requeue: {key} was unsuspended before its templates were set",
                                     delay=self._poll * 10)
            new_groups, changed = placed_groups(_worker_groups(j, path), placement)
            if not changed:
                return None
            return groups_patch(j, path, new_groups, decision=decision, event=event, now=now)

        _, written = await modify(
            lambda: self.objects.get(kind, namespace, name), change,
            lambda patch: self.objects.patch(kind, namespace, name, patch), what=f"patch {key}")
        return [f"set every worker group of {key} to {placement.describe()}"] if written else []

    async def _requeue_workload(self, namespace: str, name: str, groups: Sequence[Mapping[str, JsonValue]],
                                placement: Placement) -> list[str]:
        """Reactivate the Workload resilienced deactivated, its worker PodSets set to ``placement``
        in the same write (only while it holds no quota); the changes made, in words.

        Why resilienced writes the PodSets: Kueue re-reads a suspended job into its Workload only
        when ``EquivalentToWorkload`` fails, and that compares counts, tolerations and containers,
        never nodeSelector or affinity (``pkg/util/equality/podset.go`` ``comparePodTemplate``,
        v0.14-v0.19).  A move that changes only the node selector (block -> block: only the
        reservation id; or per-capacity tolerations that are identical) leaves the old selector in
        the Workload, and the flavor assigner reads the Workload's PodSets: it would admit on the
        old flavor and ``startJob``'s merge of that flavor's labels would conflict with the job's
        selector (``FailedToStart``).  The webhook allows PodSet changes while the Workload has no
        quota reservation (``pkg/webhooks/workload_webhook.go`` ``ValidateWorkloadUpdate``, which
        reads the old object's admission): the update that sets ``spec.active`` back is such a
        change, so the PodSets go with it (issue #45: one Workload write, not two).
        """
        names = {str(g.get("groupName", "")).lower() for g in groups}
        wl_key = f"Workload {namespace}/{name}"
        steered = False

        def change(wl: JsonObj) -> dict[str, JsonValue] | None:
            nonlocal steered
            if is_active(wl) or not annotations_of(wl).get(DEACTIVATED_FOR):
                return None  # requeued already (an earlier attempt's write landed)
            if has_quota(wl):
                raise TemporaryError(f"requeue: {wl_key} holds quota again; not steering it", delay=self._poll * 10)
            podsets, steered = [], False
            for ps in (wl.get("spec") or {}).get("podSets") or []:
                template = dict(ps.get("template") or {})
                spec = template.get("spec") or {}
                if str(ps.get("name", "")).lower() in names and not placement.selector_matches(spec):
                    template["spec"], steered = placement.applied(spec), True
                podsets.append({**ps, "template": template})
            wanted: dict[str, JsonValue] = {"active": True}
            if steered:
                wanted["podSets"] = podsets
            return {"metadata": {"annotations": {DEACTIVATED_FOR: None}}, "spec": wanted}

        async def read() -> JsonObj:  # by list: RBAC grants workloads list and patch, not get
            found = [w for w in await self.objects.list(self.workload, namespace) if w["metadata"]["name"] == name]
            if not found:
                raise TemporaryError(f"requeue: {wl_key} is gone", delay=self._poll * 10)
            return found[0]

        _, written = await modify(read, change,
                                  lambda patch: self.objects.patch(self.workload, namespace, name, patch),
                                  what=f"patch {wl_key}")
        if not written:
            return []
        return ([f"set the worker PodSets of {wl_key} to {placement.describe()}"] if steered else []) + [
            f"reactivated {wl_key}: Kueue requeues it and admits it on the flavor matching {placement.describe()}"]

    def _result(self, target: Target, decision: CapacityDecision, placement: Placement,
                changes: list[str], dry_run: bool, reason: str) -> RequeueResult:
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=reason,
            reservation_id=decision.reservation_id, changes=tuple(changes), dry_run=dry_run,
            decision=decision, details={"node_selector": dict(placement.node_selector)})


def _planned_steps(key: str, wl_key: str, placement: Placement, *, placed: bool) -> list[str]:
    """What a requeue through Kueue would do, in words (a dry run)."""
    steps = []
    if not placed:
        steps += [f"would deactivate {wl_key} (Kueue evicts and suspends the whole run)",
                  f"would set every worker group of {key} to {placement.describe()}"]
    steps.append(f"would set the worker PodSets of {wl_key} to {placement.describe()} if Kueue has not")
    steps.append(f"would reactivate {wl_key} (Kueue requeues it on the matching flavor)")
    return steps
