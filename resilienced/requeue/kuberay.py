"""Requeue a RayCluster, or a RayJob's cluster, that Kueue does not manage: move every worker group.

Mechanism (KubeRay, ray-project/kuberay at feeaf72):

1. Patch **every** worker group's pod template (``workerGroupSpecs[*].template.spec``): the
   Karpenter node selector of the decision (see :mod:`.placement`), stale block selectors and
   capacity affinity removed, matching tolerations.  Never a subset of the groups: the gang
   moves as a whole.  For a RayJob both ``spec.rayClusterSpec`` (so a retry's new RayCluster,
   ``backoffLimit``, gets it too) and the RayCluster it owns (``status.rayClusterName``) are
   patched (a RayJob in ``clusterSelector`` mode has no ``rayClusterSpec``: only the cluster).
2. KubeRay does **not** roll existing pods when a template changes: ``reconcilePods`` only
   recreates pods for a spec change when ``spec.upgradeStrategy.type: Recreate`` is set (KubeRay
   >= 1.6), and then it deletes *all* pods, head included (ray-project/kuberay v1.6.0
   ``ray-operator/controllers/ray/raycluster_controller.go`` ``shouldRecreatePodsForUpgrade``:
   the head pod's ``ray.io/upgrade-strategy-recreate-hash`` against
   ``utils.GenerateHashWithoutReplicasAndWorkersToDelete`` of the spec, which mutes replicas and
   tolerations but not nodeSelector), which would end the Ray cluster and its job.  So for a
   RayCluster with ``Recreate`` the requeuer changes nothing and returns a *refused* result
   (reason in it; ``ReportingRequeuer`` records a Warning Event ``RequeueRefused``): such a run is moved
   only through Kueue (a Kueue-managed RayCluster goes to the Kueue requeuer, which changes the
   templates only while the cluster is suspended and its pods deleted).  ``upgradeStrategy`` is
   only ever on a RayCluster created directly: KubeRay v1.6+ refuses to reconcile one a RayJob or
   RayService created with it (``utils/validation.go`` ``ValidateRayClusterUpgradeOptions``).  Otherwise the
   requeuer deletes the run's worker pods itself (labels ``ray.io/cluster=<name>``,
   ``ray.io/node-type=worker``), all of them together, and KubeRay recreates the missing
   replicas from the new template.  A worker pod is kept when it already asks for the decided
   capacity, or runs on a Node that is on it (a Node's ``karpenter.sh/capacity-type`` and
   reservation-id labels); this is also what makes a second application change nothing.  The
   head pod is never touched.  RBAC therefore needs ``pods: list, delete`` and ``nodes: get``.
3. Bookkeeping annotations on the RayJob/RayCluster (``resilienced.io/capacity-type``,
   ``-reservation-id``, ``-moved-at``, ``resilienced.io/requeued-for``) tell the next decision
   where the run is and since when.

Every template write is a merge patch conditional on the resourceVersion read (409: read again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone

from kubernetes_asyncio import client as k8s

from resilienced.capacity.request import (
    ANNOTATION_CAPACITY,
    ANNOTATION_MOVED_AT,
    ANNOTATION_REQUEUED_FOR,
    ANNOTATION_RESERVATION,
)
from resilienced.clock import utcnow
from resilienced.errors import PermanentError
from resilienced.kube.api import JsonObj
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.requeue.elastic import ElasticKubeRay, not_elastic_on_kuberay, with_fallback
from resilienced.requeue.objects import RAYCLUSTER, RAYJOB, Kind, Objects, annotations_of, modify, split_key
from resilienced.requeue.placement import DEFAULT_TOLERATIONS, Placement

CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
GROUP_LABEL = "ray.io/group"
#: ``spec.upgradeStrategy.type`` (KubeRay >= 1.6): ``Recreate`` | ``None`` (absent: None).
RECREATE = "Recreate"


def upgrade_strategy(cluster_spec: Mapping[str, JsonValue]) -> str | None:
    """A RayClusterSpec's ``upgradeStrategy.type`` (ray-project/kuberay v1.6.0
    ``ray-operator/apis/ray/v1/raycluster_types.go`` ``RayClusterUpgradeStrategy``)."""
    return ((cluster_spec.get("upgradeStrategy") or {}).get("type")) or None


def placed_groups(groups: Sequence[Mapping[str, JsonValue]], placement: Placement) -> tuple[list[dict], list[str]]:
    """Every worker group with ``placement`` applied, and the names of those that changed."""
    new_groups, changed = [], []
    for group in groups:
        template = dict(group.get("template") or {})
        spec = template.get("spec") or {}
        if not placement.matches(spec):
            changed.append(str(group.get("groupName", "?")))
        template["spec"] = placement.applied(spec)
        new_groups.append({**group, "template": template})
    return new_groups, changed


def groups_patch(obj: Mapping[str, JsonValue], path: Sequence[str], new_groups: list[dict], *,
                 decision: CapacityDecision, event: Event, now: datetime) -> dict[str, JsonValue]:
    """The merge patch that sets ``workerGroupSpecs`` under ``path`` and the bookkeeping annotations."""
    patch: dict[str, JsonValue] = {"workerGroupSpecs": new_groups}
    for key in reversed(path):
        patch = {key: patch}
    patch["metadata"] = {"annotations": bookkeeping(obj, decision=decision, event=event, now=now)}
    return patch


def bookkeeping(obj: Mapping[str, JsonValue], *, decision: CapacityDecision, event: Event, now: datetime) -> dict[str, JsonValue]:
    """The annotations a requeue leaves (null deletes a stale reservation id in a merge patch)."""
    before = annotations_of(obj)
    capacity = decision.capacity.value
    out: dict[str, JsonValue] = {
        ANNOTATION_CAPACITY: capacity,
        ANNOTATION_RESERVATION: decision.reservation_id,  # None -> removed
        ANNOTATION_REQUEUED_FOR: event.event_id or "",
    }
    if before.get(ANNOTATION_CAPACITY) != capacity:
        out[ANNOTATION_MOVED_AT] = now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return out


class PodTemplateRequeuer:
    """What the requeuers that edit a run's pod templates share (KubeRay, Volcano).

    Args:
        api_client: a kubernetes_asyncio ApiClient (the caller's).
        tolerations: per-capacity tolerations (default: tolerate ``karpenter.sh/capacity-type``).
        request_timeout_s: time allowed for one Kubernetes request.
        clock: the current tz-aware time (for the moved-at annotation).
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        tolerations: Mapping[Capacity, Sequence[Mapping[str, str]]] = DEFAULT_TOLERATIONS,
        request_timeout_s: float = 10.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.objects = Objects(api_client, request_timeout_s=request_timeout_s)
        self._tolerations = tolerations
        self._clock = clock


class KubeRayRequeuer(PodTemplateRequeuer):
    """:class:`~resilienced.ports.Requeuer` for KubeRay RayClusters / RayJobs without Kueue.

    Takes :class:`PodTemplateRequeuer`'s arguments.
    """

    kind = "kuberay"

    def __init__(self, api_client: k8s.ApiClient, *,
                 tolerations: Mapping[Capacity, Sequence[Mapping[str, str]]] = DEFAULT_TOLERATIONS,
                 request_timeout_s: float = 10.0, clock: Callable[[], datetime] = utcnow) -> None:
        super().__init__(api_client, tolerations=tolerations, request_timeout_s=request_timeout_s, clock=clock)
        self._elastic = ElasticKubeRay(self.objects)

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        fallback = None
        if target.facts.elastic is True:
            cluster = await self._cluster_of(target)
            if cluster is None:
                fallback = f"the RayCluster of {target.run_key} is gone (a RayJob retrying); requeued as a gang"
            else:
                fallback = not_elastic_on_kuberay(cluster.get("spec") or {})
            if fallback is None and cluster is not None:
                placement = (Placement.for_decision(decision, tolerations=self._tolerations,
                                                    shape=target.facts.node_shape) if decision.places else None)
                return await self._elastic.requeue(target, cluster, decision=decision, placement=placement,
                                                   event=event, dry_run=dry_run)
        return with_fallback(await self._gang(target, decision=decision, event=event, dry_run=dry_run), fallback)

    async def _cluster_of(self, target: Target) -> JsonObj | None:
        """The live RayCluster of the run (a RayJob's ``status.rayClusterName``), None when there is none."""
        key = target.ray_cluster
        if target.ray_job:
            namespace, name = split_key(target.ray_job, what="target.ray_job")
            job = await self.objects.find(RAYJOB, namespace, name)
            owned = ((job or {}).get("status") or {}).get("rayClusterName")
            key = f"{namespace}/{owned}" if owned else None
        if not key:
            return None
        namespace, name = split_key(key, what="target.ray_cluster")
        return await self.objects.find(RAYCLUSTER, namespace, name)

    async def _gang(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        if not decision.places:
            return RequeueResult.waiting(target, kind=self.kind, decision=decision, dry_run=dry_run)
        placement = Placement.for_decision(decision, tolerations=self._tolerations, shape=target.facts.node_shape)
        now = self._clock()
        changes: list[str] = []

        job_key, cluster_key = target.ray_job, target.ray_cluster
        job: JsonObj | None = None
        if job_key:
            namespace, name = split_key(job_key, what="target.ray_job")
            job = await self.objects.find(RAYJOB, namespace, name)
            if job is None:
                raise PermanentError(f"requeue: RayJob {job_key} no longer exists")
            owned = (job.get("status") or {}).get("rayClusterName")
            if owned:
                cluster_key = f"{namespace}/{owned}"
        cluster: JsonObj | None = None
        if cluster_key:
            namespace, name = split_key(cluster_key, what="target.ray_cluster")
            cluster = await self.objects.find(RAYCLUSTER, namespace, name)
            if cluster is None and not job_key:
                raise PermanentError(f"requeue: RayCluster {cluster_key} no longer exists")
            # else the RayJob's cluster is gone (suspended / retrying): its spec is enough
        if not job_key and not cluster_key:
            raise PermanentError(f"requeue: target {target.run_key} names no RayJob or RayCluster")
        if cluster is not None and upgrade_strategy(cluster.get("spec") or {}) == RECREATE:
            return self._refused(target, decision, cluster, dry_run=dry_run)

        if job is not None and (job.get("spec") or {}).get("rayClusterSpec"):  # none in clusterSelector mode
            namespace, name = split_key(job_key or "", what="target.ray_job")
            changes += await self._place(
                RAYJOB, namespace, name, path=("spec", "rayClusterSpec"), placement=placement,
                decision=decision, event=event, now=now, dry_run=dry_run)
        if cluster is not None:
            namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
            changes += await self._place(
                RAYCLUSTER, namespace, name, path=("spec",), placement=placement,
                decision=decision, event=event, now=now, dry_run=dry_run)
            changes += await self._replace_workers(namespace, name, placement, dry_run=dry_run)

        if changes:
            reason = f"worker groups moved to {decision.capacity.value} ({placement.describe()})"
        else:
            reason = f"already on {decision.capacity.value}: every worker group and pod asks for {placement.describe()}"
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=reason,
            reservation_id=decision.reservation_id, changes=tuple(changes), dry_run=dry_run,
            decision=decision)

    def _refused(self, target: Target, decision: CapacityDecision, cluster: JsonObj, *,
                 dry_run: bool) -> RequeueResult:
        key = f"{cluster['metadata']['namespace']}/{cluster['metadata']['name']}"
        reason = (f"RayCluster {key} has spec.upgradeStrategy.type: Recreate: KubeRay deletes every pod, "
                  "head included, when a worker template's nodeSelector changes, which would end the run; "
                  "not moved in place. Put the run under Kueue (it is then requeued through its Workload) "
                  "or use upgradeStrategy None")
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=reason,
            reservation_id=decision.reservation_id, dry_run=dry_run, decision=decision, refused=True,
            details={"upgrade_strategy": RECREATE})

    async def _place(
        self, kind: Kind, namespace: str, name: str, *, path: tuple[str, ...], placement: Placement,
        decision: CapacityDecision, event: Event, now: datetime, dry_run: bool,
    ) -> list[str]:
        """Apply ``placement`` to every worker group under ``path`` of one object."""
        changed_names: list[str] = []

        def change(obj: JsonObj) -> dict[str, JsonValue] | None:
            holder: JsonValue = obj
            for key in path:
                holder = (holder or {}).get(key) or {}
            groups = holder.get("workerGroupSpecs") or []
            if not groups:
                raise PermanentError(f"requeue: {kind.kind} {namespace}/{name} has no workerGroupSpecs")
            new_groups, changed = placed_groups(groups, placement)
            changed_names[:] = changed
            if not changed:
                return None
            return groups_patch(obj, path, new_groups, decision=decision, event=event, now=now)

        where = f"{kind.kind} {namespace}/{name}" + (" spec.rayClusterSpec" if kind is RAYJOB else "")
        if dry_run:
            change(await self.objects.get(kind, namespace, name))
        else:
            await modify(
                lambda: self.objects.get(kind, namespace, name), change,
                lambda patch: self.objects.patch(kind, namespace, name, patch),
                what=f"patch {where}")
        if not changed_names:
            return []
        verb = "would set" if dry_run else "set"
        return [f"{where}: {verb} worker groups {', '.join(changed_names)} to {placement.describe()}"]

    async def _replace_workers(self, namespace: str, cluster: str, placement: Placement, *, dry_run: bool) -> list[str]:
        """Delete the worker pods not on the decided capacity, all together, for KubeRay to recreate."""
        selector = f"{CLUSTER_LABEL}={cluster},{NODE_TYPE_LABEL}=worker"
        pods = await self.objects.pods(namespace, label_selector=selector)
        doomed = []
        node_cache: dict[str, dict[str, str] | None] = {}
        for pod in pods:
            meta = pod.get("metadata") or {}
            labels = meta.get("labels") or {}
            if labels.get(CLUSTER_LABEL) != cluster or labels.get(NODE_TYPE_LABEL) != "worker":
                continue  # belt and braces: never act on a pod the selector should not have given
            if meta.get("deletionTimestamp"):
                continue
            spec = pod.get("spec") or {}
            if placement.selector_matches(spec):
                continue
            node = spec.get("nodeName")
            if node:
                if node not in node_cache:
                    node_cache[node] = await self.objects.node_labels(node)
                if placement.node_matches(node_cache[node]):
                    continue
            doomed.append(pod)
        if not doomed:
            return []
        names = sorted(p["metadata"]["name"] for p in doomed)
        if dry_run:
            return [f"would delete worker pods {', '.join(names)} of RayCluster {namespace}/{cluster} "
                    "for KubeRay to recreate on the new capacity"]
        for pod in doomed:
            await self.objects.delete_pod(namespace, pod["metadata"]["name"], uid=pod["metadata"].get("uid"))
        return [f"deleted worker pods {', '.join(names)} of RayCluster {namespace}/{cluster} "
                "for KubeRay to recreate on the new capacity"]
