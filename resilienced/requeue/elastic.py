"""Elastic runs: capacity for the lost workers only; the survivors are never stopped.

A run is elastic when its RayJob/RayCluster is annotated ``resilienced.io/elastic: "true"`` (read by
the locate step into ``Target.facts.elastic``; in ray mode a node label, see
:mod:`resilienced.ray.requeue`).  The notice still drains the lost node's Ray node with the
deadline and the checkpoint is still checked for durability; only the requeue differs.

KubeRay (ray-project/kuberay ray-operator, v1.4.0 to v1.7.0, ``controllers/ray/raycluster_controller.go``
``reconcilePods`` and ``utils/util.go`` ``GetWorkerGroupDesiredReplicas``):

* KubeRay keeps ``replicas`` pods per worker group, clamped to ``[minReplicas, maxReplicas]``: a lost
  worker's pod is recreated from its own group's template.  So when the decided capacity is the
  lost worker's own group's (its template asks for it), nothing is written but the bookkeeping.
* Otherwise the lost worker moves to a worker group asking for the decided capacity: an existing
  one made by resilienced for this group (template label ``resilienced.io/elastic-of``), scaled up by
  one per newly lost worker, or a new one (``<group>-<capacity>``, a copy of the group with the
  placement applied, ``minReplicas: 0``).  The lost worker's group is scaled down by one, its
  ``minReplicas`` lowered when needed (else KubeRay clamps ``replicas`` back up), and the lost pod
  named in ``scaleStrategy.workersToDelete``: without the autoscaler KubeRay deletes *random* pods
  of a group over its replicas (``randomlyRemovedWorkers``), but deletes the pods named in
  ``workersToDelete`` first ("Always remove the specified WorkersToDelete").  A lost pod that is
  still terminating (Karpenter drains at the notice) is the lost worker's pod: KubeRay counts it
  until it is gone.  When the lost pod is already gone and KubeRay made an unscheduled replacement
  in the old group, that replacement is named instead; when the replacement already runs, the
  worker counts as replaced in place.  ``workersToDelete`` keeps only names whose pod still exists
  (KubeRay never clears the list and deletes every name in it on each reconcile).
* One conditional merge patch writes the groups and the annotation
  ``resilienced.io/elastic-replaced`` (JSON ``{lost instance id: group}``): a second notice for the
  same lost instance changes nothing; another lost instance adds one more replica.
* Not elastic here (requeued as a gang, the reason in ``details.elastic_fallback``): the in-tree
  autoscaler (it owns ``replicas`` and ``workersToDelete``), ``upgradeStrategy: Recreate`` (a new
  group changes the spec hash and KubeRay deletes every pod), multi-host groups (``numOfHosts > 1``:
  a replica is all its hosts), a RayJob whose RayCluster is gone.

Kueue: see :class:`ElasticKueue`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from resilienced.capacity.request import ANNOTATION_ELASTIC_REPLACED, ANNOTATION_REQUEUED_FOR, capacity_of
from resilienced.kube.api import JsonObj
from resilienced.kube.locate import instance_id_of
from resilienced.log import get as get_logger
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.requeue.objects import RAYCLUSTER, Objects, annotations_of, modify
from resilienced.requeue.placement import Placement

log = get_logger(__name__)

ELASTIC_OF_LABEL = "resilienced.io/elastic-of"
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
GROUP_LABEL = "ray.io/group"
MAX_REPLACED = 200  # entries kept in the elastic-replaced annotation (oldest dropped)
_SUFFIX = {Capacity.SPOT: "spot", Capacity.ON_DEMAND: "on-demand", Capacity.CAPACITY_BLOCK: "block"}


@dataclass(frozen=True)
class LostWorker:
    """A lost instance's worker: its group and the pods KubeRay must delete to shrink it (may be none)."""

    instance_id: str
    group: str
    pods: tuple[str, ...] = ()


def replaced_of(obj: Mapping[str, JsonValue]) -> dict[str, str]:
    """The ``resilienced.io/elastic-replaced`` annotation (``{}`` when absent or not a JSON object)."""
    raw = annotations_of(obj).get(ANNOTATION_ELASTIC_REPLACED)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("annotation not a JSON object; starting afresh", annotation=ANNOTATION_ELASTIC_REPLACED,
                    value=raw)
        return {}
    return {str(k): str(v) for k, v in value.items()}


def group_name_for(base: str, decision: CapacityDecision) -> str:
    """``<base>-spot|on-demand|block[-<reservation id>]`` (a DNS label: 63 characters at most)."""
    name = f"{base}-{_SUFFIX[decision.capacity]}"
    if decision.reservation_id:
        name += "-" + decision.reservation_id.removeprefix("cr-")
    return name[:63].rstrip("-")


def _base(group: Mapping[str, JsonValue]) -> str:
    labels = ((group.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return str(labels.get(ELASTIC_OF_LABEL) or group.get("groupName") or "")


def _spec(group: Mapping[str, JsonValue]) -> Mapping[str, JsonValue]:
    return (group.get("template") or {}).get("spec") or {}


def _new_group(source: Mapping[str, JsonValue], name: str, base: str, placement: Placement) -> dict[str, JsonValue]:
    group = copy.deepcopy(dict(source))
    group.pop("scaleStrategy", None)
    group.pop("suspend", None)
    group.update(groupName=name, replicas=0, minReplicas=0, maxReplicas=0)
    template = group.setdefault("template", {})
    metadata = template.setdefault("metadata", {})
    metadata["labels"] = {**(metadata.get("labels") or {}), ELASTIC_OF_LABEL: base}
    template["spec"] = placement.applied(template.get("spec") or {})
    return group


def plan_groups(groups: Sequence[Mapping[str, JsonValue]], lost: Sequence[LostWorker], placement: Placement,
                decision: CapacityDecision, *, existing: Collection[str] | None = None,
                ) -> tuple[list[dict[str, JsonValue]], dict[str, str], list[str]]:
    """The worker groups after moving each of ``lost`` to a group of the decided capacity (pure).

    ``existing``: the names of the cluster's worker pods that still exist (terminating ones
    included); a ``workersToDelete`` name not among them is dropped (None: keep every name).
    Returns (new groups, ``{instance id: group now holding its replacement}``, changes in words).
    """
    new = [copy.deepcopy(dict(g)) for g in groups]
    if existing is not None:
        for group in new:
            _prune_workers_to_delete(group, existing)
    by_name = {str(g.get("groupName")): g for g in new}
    replaced: dict[str, str] = {}
    changes: list[str] = []
    for worker in lost:
        source = by_name.get(worker.group)
        if source is None:
            raise ValueError(f"worker group {worker.group!r} of lost instance {worker.instance_id} is not in the spec")
        if placement.selector_matches(_spec(source)):  # KubeRay's recreated pod asks for it already
            replaced[worker.instance_id] = worker.group
            changes.append(f"{worker.instance_id}: KubeRay recreates its worker in group {worker.group}, "
                           f"already on {placement.describe()}")
            continue
        if not worker.pods:
            replaced[worker.instance_id] = worker.group
            changes.append(f"{worker.instance_id}: its worker was already recreated in group {worker.group}")
            continue
        base = _base(source)
        # the group it came from (back from a block to Spot) or one made for it earlier
        target = next((g for g in new if _base(g) == base and g is not source
                       and placement.selector_matches(_spec(g))), None)
        if target is None:
            target = _new_group(source, group_name_for(base, decision), base, placement)
            new.append(target)
            by_name[target["groupName"]] = target
            changes.append(f"added worker group {target['groupName']} ({placement.describe()})")
        target["replicas"] = int(target.get("replicas") or 0) + 1
        target["maxReplicas"] = max(int(target.get("maxReplicas") or 0), target["replicas"])
        remaining = max(int(source.get("replicas") or 0) - 1, 0)
        source["replicas"] = remaining
        source["minReplicas"] = min(int(source.get("minReplicas") or 0), remaining)
        strategy = source.setdefault("scaleStrategy", {})
        strategy["workersToDelete"] = list(dict.fromkeys([*(strategy.get("workersToDelete") or []), *worker.pods]))
        replaced[worker.instance_id] = str(target["groupName"])
        changes.append(f"{worker.instance_id}: group {worker.group} -> {remaining} replicas (deleting "
                       f"{', '.join(worker.pods)}), group {target['groupName']} -> {target['replicas']}")
    return new, replaced, changes


def _prune_workers_to_delete(group: dict[str, JsonValue], existing: Collection[str]) -> None:
    """Keep only the ``workersToDelete`` names whose pod still exists.

    KubeRay (v1.7.0 ``reconcilePods``) never clears the stored list and deletes every name in it on
    each reconcile (NotFound ignored): a name whose pod is gone does nothing but grow the list.
    """
    strategy = group.get("scaleStrategy")
    names = (strategy or {}).get("workersToDelete")
    if not names:
        return
    kept = [n for n in names if n in existing]
    if kept != list(names):
        strategy["workersToDelete"] = kept


def not_elastic_on_kuberay(spec: Mapping[str, JsonValue]) -> str | None:
    """Why a RayClusterSpec cannot be scaled per worker by resilienced (None: it can)."""
    if spec.get("enableInTreeAutoscaling"):
        return ("enableInTreeAutoscaling: the Ray autoscaler owns the worker groups' replicas and "
                "workersToDelete; requeued as a gang")
    if ((spec.get("upgradeStrategy") or {}).get("type")) == "Recreate":
        return ("upgradeStrategy Recreate: a new worker group changes the spec hash and KubeRay deletes "
                "every pod; requeued as a gang")
    multi = [str(g.get("groupName")) for g in spec.get("workerGroupSpecs") or [] if int(g.get("numOfHosts") or 1) > 1]
    if multi:
        return f"multi-host worker groups ({', '.join(multi)}): a replica is all its hosts; requeued as a gang"
    return None


def already_replaced(target: Target, kind: str, decision: CapacityDecision, dry_run: bool,
                     details: dict[str, JsonValue]) -> RequeueResult:
    """Every lost instance already has its replacement asked for: nothing to do, nothing to wait for."""
    replaced = details.get("replaced") or {}
    capacity = decision.capacity if decision.places else current_capacity(target)
    return RequeueResult(
        run_key=target.run_key, kind=kind, capacity=capacity, dry_run=dry_run, decision=decision, details=details,
        reason="already replaced: " + ", ".join(f"{i} -> {replaced.get(i, '?')}" for i in lost_ids(target)))


def settled(target: Target, kind: str, cluster: JsonObj, decision: CapacityDecision,
            dry_run: bool) -> tuple[RequeueResult | None, list[str], dict[str, JsonValue]]:
    """(the result when there is nothing to do, else None; the lost instances not replaced yet; details).

    Nothing to do: every lost instance is in ``resilienced.io/elastic-replaced`` already, or the decision
    is ``wait`` (no capacity anywhere: the run goes on at the smaller size, nothing is evicted).
    """
    lost = lost_ids(target)
    done = replaced_of(cluster)
    todo = [i for i in lost if i not in done]
    details: dict[str, JsonValue] = {"elastic": True, "lost": list(lost)}
    if not todo:
        return already_replaced(target, kind, decision, dry_run, {**details, "replaced": done}), todo, details
    if not decision.places:
        return RequeueResult(
            run_key=target.run_key, kind=kind, capacity=Capacity.WAIT, dry_run=dry_run, decision=decision,
            retry_after=decision.retry_after, details=details,
            reason=(f"no capacity for the lost worker(s) of {', '.join(todo)}: {decision.reason}; the run goes "
                    "on at the smaller size, nothing evicted")), todo, details
    return None, todo, details


def current_capacity(target: Target) -> Capacity:
    """The capacity the run is on (Karpenter's ``reserved``: a block, or On-Demand for an On-Demand
    Capacity Reservation, ``capacity_of``; unknown: Spot)."""
    try:
        capacity = capacity_of(str(target.facts.capacity_type or "spot"), target.facts.reservation_type)
    except ValueError:
        return Capacity.SPOT
    return Capacity.SPOT if capacity is Capacity.WAIT else capacity


def lost_ids(target: Target) -> tuple[str, ...]:
    return tuple(dict.fromkeys(target.facts.lost_instance_ids or (target.instance_id,)))


class ElasticKubeRay:
    """The per-worker requeue of an elastic RayCluster (no Kueue): see the module docstring."""

    kind = "kuberay"

    def __init__(self, objects: Objects) -> None:
        self.objects = objects

    async def lost_workers(self, cluster: JsonObj, lost: Sequence[str], *, groups_hint: Sequence[str] = (),
                           ) -> tuple[list[LostWorker], list[str], frozenset[str]]:
        """Each lost instance's worker group and the pods to delete; the instances with no worker; the
        names of the cluster's worker pods (terminating ones included).

        A terminating pod counts: KubeRay (ray-project/kuberay v1.7.0
        ``ray-operator/controllers/ray/raycluster_controller.go`` ``reconcilePods``) lists a group's pods
        with those being deleted and recreates a worker only once its pod is gone, and Karpenter starts
        draining the node at the notice, so at requeue time the lost pod is usually still terminating.
        Named in ``workersToDelete``, it leaves KubeRay's count at once and nothing is recreated in its group.
        """
        namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
        pods = await self.objects.pods(namespace, label_selector=f"{CLUSTER_LABEL}={name},{NODE_TYPE_LABEL}=worker")
        existing = frozenset(str((p.get("metadata") or {}).get("name")) for p in pods)
        on: dict[str, list[JsonObj]] = {}
        for node_name in sorted({(p.get("spec") or {}).get("nodeName") or "" for p in pods} - {""}):
            node = await self.objects.node(node_name)
            iid = instance_id_of(node) if node else None
            if iid in lost:
                on[iid] = [p for p in pods if (p.get("spec") or {}).get("nodeName") == node_name]
        found, none = [], []
        for iid in lost:
            if iid in on:
                for pod in on[iid]:
                    group = ((pod.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL, "")
                    found.append(LostWorker(iid, group, (pod["metadata"]["name"],)))
            elif len(groups_hint) == 1:  # the pod is gone: KubeRay may have made an unscheduled replacement
                pending = [p["metadata"]["name"] for p in pods
                           if ((p.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL) == groups_hint[0]
                           and not (p.get("spec") or {}).get("nodeName")
                           and not (p.get("metadata") or {}).get("deletionTimestamp")]
                found.append(LostWorker(iid, groups_hint[0], tuple(pending[:1])))
            else:
                none.append(iid)
        return found, none, existing

    async def begin(self, target: Target, cluster: JsonObj, decision: CapacityDecision, dry_run: bool, *,
                    kind: str) -> tuple[RequeueResult | None, dict[str, JsonValue], list[LostWorker], list[str],
                                        frozenset[str]]:
        """(the result when there is nothing to do, details, the lost workers to replace, instances with none,
        the names of the cluster's worker pods)."""
        early, todo, details = settled(target, kind, cluster, decision, dry_run)
        if early is not None:
            return early, details, [], [], frozenset()
        workers, no_worker, existing = await self.lost_workers(
            cluster, todo, groups_hint=list(target.facts.groups))
        return None, details, workers, no_worker, existing

    async def requeue(self, target: Target, cluster: JsonObj, *, decision: CapacityDecision, placement: Placement | None,
                      event: Event, dry_run: bool) -> RequeueResult:
        namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
        early, details, workers, no_worker, existing = await self.begin(
            target, cluster, decision, dry_run, kind=self.kind)
        if early is not None:
            return early
        assert placement is not None  # the decision places (settled() answered a wait)
        changes: list[str] = []
        written: dict[str, str] = {}

        def change(obj: JsonObj) -> dict[str, JsonValue] | None:
            now_done = replaced_of(obj)
            pending = [w for w in workers if w.instance_id not in now_done]
            if not pending:
                return None
            groups, replaced, described = plan_groups(
                (obj.get("spec") or {}).get("workerGroupSpecs") or [], pending, placement, decision,
                existing=existing)
            merged = {**now_done, **replaced}
            merged = dict(list(merged.items())[-MAX_REPLACED:])
            changes.clear()
            written.clear()
            changes.extend(described)
            written.update(replaced)
            return {"spec": {"workerGroupSpecs": groups},
                    "metadata": {"annotations": {ANNOTATION_ELASTIC_REPLACED: json.dumps(merged, sort_keys=True),
                                                 ANNOTATION_REQUEUED_FOR: event.event_id or ""}}}

        if dry_run:
            change(cluster)
            changes[:] = [f"would: {c}" for c in changes]
        elif workers:
            await modify(lambda: self.objects.get(RAYCLUSTER, namespace, name), change,
                         lambda patch: self.objects.patch(RAYCLUSTER, namespace, name, patch),
                         what=f"scale RayCluster {namespace}/{name}")
        details.update(replaced=written, no_worker=no_worker)
        reason = (f"elastic: the lost worker(s) get {decision.capacity.value} capacity ({placement.describe()}); "
                  f"the other workers keep training: {decision.reason}")
        if no_worker:
            reason += f"; no worker pod of {', '.join(no_worker)} found (nothing to replace)"
        return self._result(target, decision, tuple(f"RayCluster {namespace}/{name}: {c}" for c in changes),
                            dry_run, details=details, reason=reason)

    def _result(self, target: Target, decision: CapacityDecision, changes: tuple[str, ...], dry_run: bool, *,
                details: dict[str, JsonValue], reason: str) -> RequeueResult:
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=reason,
            reservation_id=decision.reservation_id, changes=changes, dry_run=dry_run, decision=decision,
            details=details)


#: Kueue marks the Workload of a job it treats as elastic (kubernetes-sigs/kueue v0.19.2
#: ``pkg/controller/jobframework/reconciler.go`` ``prepareWorkloadSlice``, only when ``WorkloadSliceEnabled``:
#: the ElasticJobsViaWorkloadSlices gate on and the job annotated ``kueue.x-k8s.io/elastic-job: "true"``).
KUEUE_ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"


def kueue_not_elastic(workload: Mapping[str, JsonValue] | None, key: str) -> str | None:
    """Why Kueue will not scale ``key``'s Workload (None: it will)."""
    if workload is None:
        return f"Kueue has no Workload for {key}; requeued as a gang"
    if annotations_of(workload).get(KUEUE_ELASTIC_ANNOTATION) != "true":
        return (f"the Workload {workload['metadata']['name']} of {key} is not elastic to Kueue (no "
                f"{KUEUE_ELASTIC_ANNOTATION}: \"true\"; the ElasticJobsViaWorkloadSlices feature gate is off, "
                "alpha and off by default in v0.13 - v0.17); requeued as a gang")
    return None


class ElasticKueue:
    """The per-worker requeue of an elastic RayCluster that Kueue scales through Workload slices.

    Kueue (v0.14+, feature gate ``ElasticJobsViaWorkloadSlices``) keeps the run admitted when its
    replicas change: a scale-up of an admitted Workload becomes a new slice, a scale-down updates it
    in place, but only while the PodSets keep their names (``pkg/workloadslicing/workloadslicing.go``
    ``EnsureWorkloadSlices``: ``HasSamePodSetKeys``, else "incompatible", no slice).  So resilienced
    never adds a worker group here: the lost worker's pod is recreated by KubeRay in its own group
    (the Workload still counts it) and Kueue's elastic-job ungater (``pkg/controller/elasticjobs``)
    lets it schedule on the flavor the group was admitted on.  resilienced records the decision,
    whether the group already asks for it, and the lost instance (``resilienced.io/elastic-replaced``),
    and evicts nothing.
    """

    kind = "kueue"

    def __init__(self, objects: Objects) -> None:
        self.objects = objects
        self._kuberay = ElasticKubeRay(objects)

    async def requeue(self, target: Target, cluster: JsonObj, *, decision: CapacityDecision, placement: Placement | None,
                      event: Event, dry_run: bool) -> RequeueResult:
        namespace, name = cluster["metadata"]["namespace"], cluster["metadata"]["name"]
        early, details, workers, _none, _pods = await self._kuberay.begin(
            target, cluster, decision, dry_run, kind=self.kind)
        if early is not None:
            return early
        assert placement is not None  # the decision places (settled() answered a wait)
        groups = {str(g.get("groupName")): g for g in (cluster.get("spec") or {}).get("workerGroupSpecs") or []}
        written = {w.instance_id: w.group for w in workers}
        on_decided = sorted({w.group for w in workers
                             if placement.selector_matches(_spec(groups.get(w.group) or {}))})
        elsewhere = sorted({w.group for w in workers} - set(on_decided))
        details.update(replaced=written, groups_on_decided=on_decided, groups_elsewhere=elsewhere)

        def change(obj: JsonObj) -> dict[str, JsonValue] | None:
            now_done = replaced_of(obj)
            if all(i in now_done for i in written):
                return None
            merged = dict(list({**now_done, **written}.items())[-MAX_REPLACED:])
            return {"metadata": {"annotations": {ANNOTATION_ELASTIC_REPLACED: json.dumps(merged, sort_keys=True),
                                                 ANNOTATION_REQUEUED_FOR: event.event_id or ""}}}

        if written and not dry_run:
            await modify(lambda: self.objects.get(RAYCLUSTER, namespace, name), change,
                         lambda patch: self.objects.patch(RAYCLUSTER, namespace, name, patch),
                         what=f"annotate RayCluster {namespace}/{name}")
        verb = "would record" if dry_run else "recorded"
        changes = tuple(f"RayCluster {namespace}/{name}: {verb} {w.instance_id} replaced in group {w.group} "
                        "(KubeRay recreates the worker, Kueue admits it)" for w in workers)
        reason = "elastic under Kueue: the lost worker(s) are recreated in their own group(s), nothing evicted"
        if elsewhere:
            reason += (f"; decided {decision.capacity.value} ({placement.describe()}) but group(s) "
                       f"{', '.join(elsewhere)} stay on the flavor Kueue admitted them on: a worker group of "
                       "another capacity would be a new PodSet, which Kueue does not scale into")
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=f"{reason}: {decision.reason}",
            reservation_id=decision.reservation_id, changes=changes, dry_run=dry_run, decision=decision,
            details=details)


def with_fallback(result: RequeueResult, reason: str | None) -> RequeueResult:
    """``result`` of a gang requeue of an elastic run, with why it was not elastic (``details.elastic_fallback``)."""
    if not reason:
        return result
    return replace(result, details={**dict(result.details), "elastic_fallback": reason})
