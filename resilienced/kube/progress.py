"""Kubernetes mode: how far a requeued run got on its way back (``ports.Progress``).

Read, never written, for the follow-up (``resilienced.followup.follower``); each look returns a
``model.StageSeen`` whose ``detail`` is the evidence of a stall when the stage is not reached:

* **admitted** (Kueue-managed runs): the run's active Workload (found as the requeuer finds it,
  ``KueueRequeuer.find_workload``) has ``QuotaReserved`` and ``Admitted`` true, and every worker
  PodSet was assigned flavors whose ``spec.nodeLabels`` match the decided capacity (a label the
  flavor sets on one of the placement's keys must equal it, and it sets at least one: Kueue
  merges those labels into the pods, ``pkg/podset/podset.go`` ``FromAssignment``, v0.19.2).  A
  pending Workload's ``QuotaReserved`` condition message says why (``couldn't assign flavors to
  pod set ...: insufficient quota ...``, ``pkg/scheduler/scheduler.go``).
* **scheduled**: every worker pod of the gang (``ray.io/cluster=<the run's RayCluster>,
  ray.io/node-type=worker``, not terminating; as many as the RayCluster's worker groups ask for,
  ``replicas x numOfHosts``) is bound (``spec.nodeName``) to a Node carrying the decided
  capacity's labels (``requeue.placement.Placement.node_matches``).  The evidence: pods whose
  ``PodScheduled`` condition is ``False/Unschedulable`` (the scheduler's message), pods bound
  elsewhere, and Karpenter's launch failures: NodeClaims whose ``Launched`` condition is false
  (``LaunchFailed``), and ``InsufficientCapacityError`` Events on NodeClaims, which Karpenter
  records before it deletes a NodeClaim EC2 had no capacity for
  (kubernetes-sigs/karpenter ``pkg/controllers/nodeclaim/lifecycle/launch.go`` and ``events.go``,
  v1.x).

Where it reads (issue #45: no run's follow-up polls the API in a loop): the daemon's watch caches
(``kube.cluster_caches.ClusterCaches``: RayJobs, RayClusters, Ray pods, Nodes, and where
discovery says the cluster serves them Workloads, ResourceFlavors, NodeClaims and Karpenter's
InsufficientCapacityError Events), so that a look at a waiting run sends no request.  The API is
read only where no cache holds the object: a resource with no cache (not discovered yet; a
Workload version other than the requeuer's; a namespace the caches do not watch), and to confirm
an absence (an object missing from a cache may be younger than the cache's last event: the API
says whether it is gone).  A cache that has not synced, or whose watch is failing or re-listing
(``Informer.answers`` false), is no answer: the look raises :class:`NoAnswerYet` (a
``TemporaryError``: the follow-up looks again next pass) instead of judging on a stale or empty
store.

RBAC (``resilienced.ops.permissions``): ``kueue.x-k8s.io resourceflavors get``, ``karpenter.sh
nodeclaims list``, ``events list`` besides what the requeuers have; the caches' ``list``/``watch``
of Workloads, NodeClaims and Events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from kubernetes_asyncio import client as k8s

from resilienced.clock import parse_time
from resilienced.errors import TemporaryError
from resilienced.kube.api import JsonObj, KubeStatusError, call
from resilienced.kube.cache import Informer
from resilienced.kube.cluster_caches import (
    ICE_EVENTS,
    ICE_REASON,
    ICE_SELECTOR,
    NODECLAIMS,
    RESOURCEFLAVORS,
    WORKLOADS,
    ClusterCaches,
)
from resilienced.kube.discovery import CustomResource
from resilienced.kube.locate import NODE_TYPE_LABEL, labels
from resilienced.model import Capacity, CapacityDecision, JsonValue, StageSeen, Target
from resilienced.requeue.kueue import KueueRequeuer, active_workload, is_active, owned_by
from resilienced.requeue.objects import RAYCLUSTER, RAYJOB, Kind, Objects, split_key
from resilienced.requeue.placement import Placement

#: How many pieces of evidence a detail names (the rest are counted).
EVIDENCE = 3


def _condition(obj: Mapping[str, JsonValue], kind: str) -> Mapping[str, JsonValue]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def _true(obj: Mapping[str, JsonValue], kind: str) -> bool:
    return _condition(obj, kind).get("status") == "True"


def flavor_matches(node_labels: Mapping[str, str], placement: Placement) -> bool:
    """Whether a flavor with ``node_labels`` puts pods on ``placement``'s capacity."""
    shared = [k for k in placement.node_selector if k in node_labels]
    return bool(shared) and all(node_labels[k] == placement.node_selector[k] for k in shared)


def flavors_on(flavors: Mapping[str, Mapping[str, str] | None], placement: Placement) -> str | None:
    """None when the flavors a worker PodSet was assigned put it on ``placement``'s capacity, else
    what they are instead.

    Kueue assigns a flavor per resource, one from each resource group of the ClusterQueue
    (``pkg/scheduler/flavorassigner/flavorassigner.go``, v0.17.0: ``podSetAssignment.Flavors`` is
    keyed by resource): with deploy/examples/kueue.yaml's queue a GPU worker gets ``cpu`` and
    ``memory`` from a flavor of no node labels and ``nvidia.com/gpu`` from the capacity's flavor.
    So a flavor that sets none of the placement's keys says nothing either way; one that sets a key
    to another value (or is gone) contradicts it; at least one must match (:func:`flavor_matches`).
    Seen on the real Kueue (issue #40): every flavor had to match, so such a run stayed at
    ``admitted`` until its bound and was moved again.
    """
    def shown(name: str, labels: Mapping[str, str] | None) -> str:
        if labels is None:
            return f"{name} (not found)"
        return f"{name} ({', '.join(f'{k}={v}' for k, v in sorted(labels.items())) or 'no node labels'})"

    wrong = [shown(f, labels) for f, labels in flavors.items()
             if labels is None or (any(k in labels for k in placement.node_selector)
                                   and not flavor_matches(labels, placement))]
    if wrong:
        return ", ".join(wrong)
    if not any(labels is not None and flavor_matches(labels, placement) for labels in flavors.values()):
        return ", ".join(shown(f, labels) for f, labels in flavors.items()) or "none named"
    return None


def _listed(items: Sequence[str], what: str) -> str:
    if not items:
        return ""
    more = f" and {len(items) - EVIDENCE} more" if len(items) > EVIDENCE else ""
    return f"; {what}: " + "; ".join(items[:EVIDENCE]) + more


class NoAnswerYet(TemporaryError):
    """A cache the look reads has not synced, or lags its server now: no verdict from it."""


class KubeProgress:
    """``ports.Progress`` on the Kubernetes API (the requeuers' client) and the daemon's caches.

    Args:
        api_client: the daemon's client.
        kueue: the Kueue requeuer, whose Workload lookup and served version are used.
        caches: the daemon's watch caches.
    """

    def __init__(self, api_client: k8s.ApiClient, *, kueue: KueueRequeuer, caches: ClusterCaches,
                 request_timeout_s: float = 10.0) -> None:
        self.objects = Objects(api_client, request_timeout_s=request_timeout_s)
        self.kueue = kueue
        self.caches = caches
        self._custom = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def _opts(self) -> dict[str, JsonValue]:
        return {"_preload_content": False, "_request_timeout": self._timeout}

    # ------------------------------------------------------------------ caches
    def _cache(self, informer: Informer | None, namespace: str | None = None) -> Informer | None:
        """The cache that answers for objects of ``namespace``: None where none holds them (read the
        API); :class:`NoAnswerYet` where it has not synced or lags its server."""
        if informer is None or not informer.source.covers(namespace):
            return None
        if not informer.answers:
            raise NoAnswerYet(f"the watch cache of {informer.source.resource} has no answer yet: "
                              f"{informer.behind or 'not listed yet'}; looked at again next pass")
        return informer

    def _optional(self, resource: CustomResource | str) -> Informer | None:
        """An optional resource's cache where discovery found it (None: none, or not discovered)."""
        found = self.caches.optional or {}
        return found.get(resource if isinstance(resource, str) else resource.key)

    def _discovered(self) -> bool:
        return self.caches.optional is not None

    def _of_kind(self, kind: Kind) -> Informer | None:
        return {RAYJOB: self.caches.rayjobs, RAYCLUSTER: self.caches.rayclusters}.get(kind)

    async def _find(self, kind: Kind, namespace: str, name: str) -> JsonObj | None:
        """A RayJob or RayCluster: from its cache; the API where none holds it or it is missing there
        (absent from the cache may be newer than its last event)."""
        cache = self._cache(self._of_kind(kind), namespace)
        found = cache.get(namespace, name) if cache is not None else None
        return found if found is not None else await self.objects.find(kind, namespace, name)

    async def _workload(self, job: Mapping[str, JsonValue], kind: Kind) -> JsonObj | None:
        """The job's Workload (``KueueRequeuer.find_workload``): from the Workloads' cache where it holds
        the requeuer's version and the job's namespace, else (or when it holds none) the API."""
        cache = self._optional(WORKLOADS)
        namespace = (job.get("metadata") or {}).get("namespace")
        if cache is not None and cache.source.args[1:2] == (self.kueue.workload.version,):
            cache = self._cache(cache, namespace)
            uid = (job.get("metadata") or {}).get("uid")
            owned = [w for w in cache.by_index("controller", str(uid or "")) if owned_by(w, job, kind)] if cache else []
            if owned:
                return active_workload(owned)
        return await self.kueue.find_workload(job, kind)

    async def _worker_pods(self, namespace: str, cluster_name: str) -> list[JsonObj]:
        cache = self._cache(self.caches.pods, namespace)
        if cache is not None:
            pods = [p for p in cache.by_index("cluster", f"{namespace}/{cluster_name}")
                    if labels(p).get(NODE_TYPE_LABEL) == "worker"]
        else:
            pods = await self.objects.pods(namespace, label_selector=f"ray.io/cluster={cluster_name},"
                                                                    f"{NODE_TYPE_LABEL}=worker")
        return [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]

    async def _node_labels(self, name: str) -> dict[str, str] | None:
        cache = self._cache(self.caches.nodes)
        node = cache.get(None, name) if cache is not None else None
        if node is None:  # not in the cache: the API says whether it is gone
            return await self.objects.node_labels(name)
        return dict((node.get("metadata") or {}).get("labels") or {})

    # ------------------------------------------------------------------ admitted
    async def admitted(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> StageSeen:
        placement = _placement(capacity, reservation_id, shape=target.facts.node_shape)
        kind, namespace, name = _job_of(target)
        job = await self._find(kind, namespace, name)
        if job is None:
            return StageSeen(False, f"{kind.kind} {namespace}/{name} is gone")
        wl = await self._workload(job, kind)
        if wl is None:
            return StageSeen(False, f"Kueue has no Workload for {kind.kind} {namespace}/{name}")
        wl_name = f"Workload {namespace}/{wl['metadata']['name']}"
        if not is_active(wl):
            return StageSeen(False, f"{wl_name} is deactivated")
        if not (_true(wl, "QuotaReserved") and _true(wl, "Admitted")):
            why = _condition(wl, "QuotaReserved")
            return StageSeen(False, f"{wl_name} is pending: QuotaReserved={why.get('status', 'unset')}"
                                    f" ({why.get('reason') or '-'}: {why.get('message') or 'no message'})")
        workers = {str(g.get("groupName", "")).lower() for g in _worker_groups(job, kind)}
        flavors: dict[str, Mapping[str, str] | None] = {}
        for assignment in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
            if str(assignment.get("name", "")).lower() in workers:
                for flavor in (assignment.get("flavors") or {}).values():
                    if flavor not in flavors:
                        flavors[flavor] = await self._flavor_labels(flavor)
        verdict = flavors_on(flavors, placement)
        if verdict is not None:
            return StageSeen(False, f"{wl_name} is admitted on flavor(s) {verdict}, not on {placement.describe()}")
        return StageSeen(True, f"{wl_name} is admitted on flavor(s) {', '.join(sorted(flavors))}",
                         facts={"flavors": sorted(flavors)})

    async def _flavor_labels(self, name: str) -> Mapping[str, str] | None:
        cache = self._cache(self._optional(RESOURCEFLAVORS))
        flavor = cache.get(None, name) if cache is not None else None
        if flavor is not None:
            return dict((flavor.get("spec") or {}).get("nodeLabels") or {})
        version = self.kueue.workload.version
        try:
            flavor = await call("get", "resourceflavors.kueue.x-k8s.io", self._custom.get_cluster_custom_object(
                "kueue.x-k8s.io", version, "resourceflavors", name, **self._opts()))
        except KubeStatusError as e:
            if e.status == 404:
                return None
            raise
        return dict((flavor.get("spec") or {}).get("nodeLabels") or {})

    # ------------------------------------------------------------------ scheduled
    async def placed(self, target: Target, *, capacity: Capacity, reservation_id: str | None,
                     since: datetime | None = None) -> StageSeen:
        placement = _placement(capacity, reservation_id, shape=target.facts.node_shape)
        namespace, cluster_name, raycluster = await self._cluster_of(target)
        pods = await self._worker_pods(namespace, cluster_name)
        need = _expected_workers(raycluster) if raycluster is not None else max(len(pods), 1)
        bound, elsewhere, pending = [], [], []
        labels_of: dict[str, dict[str, str] | None] = {}
        for pod in pods:
            pod_name, node = pod["metadata"]["name"], (pod.get("spec") or {}).get("nodeName")
            if not node:
                why = _condition(pod, "PodScheduled")
                pending.append(f"{pod_name} {why.get('reason') or 'Pending'}: {why.get('message') or 'not scheduled yet'}")
                continue
            if node not in labels_of:
                labels_of[node] = await self._node_labels(node)
            if placement.node_matches(labels_of[node]):
                bound.append(pod_name)
            else:
                elsewhere.append(f"{pod_name} on Node {node} ({_capacity_of(labels_of[node])})")
        if len(bound) >= need and not elsewhere:
            return StageSeen(True, f"{len(bound)} worker pod(s) of RayCluster {namespace}/{cluster_name} are "
                                   f"bound to Nodes with {placement.describe()}", facts={"pods": len(bound)})
        detail = (f"{len(bound)} of {need} worker pod(s) of RayCluster {namespace}/{cluster_name} bound to "
                  f"Nodes with {placement.describe()}" + _listed(pending, "unscheduled")
                  + _listed(elsewhere, "elsewhere")
                  + _listed(await self._launch_failures(placement, since=since), "Karpenter"))
        return StageSeen(False, detail, facts={"pods": len(bound), "need": need})

    async def _cluster_of(self, target: Target) -> tuple[str, str, JsonObj | None]:
        """(namespace, RayCluster name, the RayCluster or None): a RayJob's current cluster (Kueue
        deletes and recreates it), else the target's; a Volcano run has none (its pods carry the name)."""
        if target.ray_job and not target.facts.volcano_job:
            namespace, name = split_key(target.ray_job, what="target.ray_job")
            job = await self._find(RAYJOB, namespace, name)
            current = ((job or {}).get("status") or {}).get("rayClusterName")
            if current:
                return namespace, current, await self._find(RAYCLUSTER, namespace, current)
        namespace, name = split_key(target.ray_cluster or "", what="target.ray_cluster")
        if target.facts.volcano_job:
            return namespace, name, None
        return namespace, name, await self._find(RAYCLUSTER, namespace, name)

    async def _launch_failures(self, placement: Placement, *, since: datetime | None) -> list[str]:
        """NodeClaims of the placement's capacity that did not launch, and Karpenter's ICE Events."""
        found = []
        claims, events = await self._claims_and_ice()
        for claim in claims:
            launched = _condition(claim, "Launched")
            if launched.get("status") == "False" and _claims_capacity(claim, placement):
                found.append(f"NodeClaim {claim['metadata']['name']} {launched.get('reason')}: {launched.get('message')}")
        for event in events:
            when = event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
            if since is None or (when and _after(when, since)):
                found.append(f"{ICE_REASON}: {event.get('message')}")
        return found

    async def _claims_and_ice(self) -> tuple[list[JsonObj], list[JsonObj]]:
        """Karpenter's NodeClaims and its InsufficientCapacityError Events: from their caches where
        discovery found NodeClaims served, none where it found them not served (no Karpenter: neither
        exists), else from the API (discovery has not answered yet)."""
        if self._discovered():
            claims, ice = self._cache(self._optional(NODECLAIMS)), self._cache(self._optional(ICE_EVENTS))
            if claims is None:
                return [], []
            assert ice is not None  # cluster_caches starts it with the NodeClaims' cache, for every namespace
            return claims.values(), ice.values()
        group, version, plural = NODECLAIMS.group, NODECLAIMS.version, NODECLAIMS.plural
        try:
            listed = await call("list", f"{plural}.{group}", self._custom.list_cluster_custom_object(
                group, version, plural, **self._opts()))
        except KubeStatusError as e:
            if e.status not in (403, 404):  # not served (no Karpenter), or not granted
                raise
            listed = {}
        return list(listed.get("items") or []), await self._ice_events()

    async def _ice_events(self) -> list[JsonObj]:
        events = await call("list", "events", self._core.list_event_for_all_namespaces(
            field_selector=ICE_SELECTOR, **self._opts()))
        return list(events.get("items") or [])


def _placement(capacity: Capacity, reservation_id: str | None, *, shape: str | None) -> Placement:
    """Where the requeuer put the run, in the labels of its node shape, as the requeuers build it
    (``Placement.for_decision(..., shape=target.facts.node_shape)``).  Seen on the real control plane
    (issue #40): without the shape the follow-up looked for Karpenter's labels on an EKS node
    group's Nodes, found the requeued workers "elsewhere" and moved a run that had arrived."""
    return Placement.for_decision(CapacityDecision(capacity, "follow-up", reservation_id=reservation_id), shape=shape)


def _job_of(target: Target) -> tuple[Kind, str, str]:
    if target.ray_job:
        return (RAYJOB, *split_key(target.ray_job, what="target.ray_job"))
    return (RAYCLUSTER, *split_key(target.ray_cluster or "", what="target.ray_cluster"))


def _worker_groups(obj: Mapping[str, JsonValue], kind: Kind) -> list[Mapping[str, JsonValue]]:
    spec = obj.get("spec") or {}
    if kind is RAYJOB:
        spec = spec.get("rayClusterSpec") or {}
    return list(spec.get("workerGroupSpecs") or [])


def _expected_workers(raycluster: Mapping[str, JsonValue]) -> int:
    """Worker pods KubeRay keeps: ``replicas x numOfHosts`` per group that is not suspended."""
    total = 0
    for group in _worker_groups(raycluster, RAYCLUSTER):
        if group.get("suspend"):
            continue
        total += int(group.get("replicas") or 0) * int(group.get("numOfHosts") or 1)
    return max(total, 1)


def _capacity_of(labels: Mapping[str, str] | None) -> str:
    if labels is None:
        return "gone"
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if "capacity" in k) or "no capacity labels"


def _claims_capacity(claim: Mapping[str, JsonValue], placement: Placement) -> bool:
    """Whether a NodeClaim's requirements ask for the placement's capacity type."""
    for req in (claim.get("spec") or {}).get("requirements") or []:
        key = req.get("key")
        if key in placement.node_selector and req.get("operator") == "In":
            return placement.node_selector[key] in (req.get("values") or [])
    return False


def _after(when: str, since: datetime) -> bool:
    try:
        return parse_time(when) >= since
    except ValueError:
        return True
