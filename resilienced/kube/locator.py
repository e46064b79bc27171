"""Kubernetes mode's ``locate``: the runs on the instances of a notice, from the watch caches.

``locate`` reads only the caches (Nodes, Ray pods, RayClusters, RayJobs), plus one GCS call per
RayCluster to map pod IPs to Ray node ids, cached for ``gcs_ttl_s`` and shared by concurrent
callers: a burst of 500 notices costs no Kubernetes request and about one GCS call per cluster.

What a Target says in kubernetes mode:

* ``node`` the Node name, ``ray_cluster`` / ``ray_job`` as ``namespace/name`` (``ray_job`` None
  for a RayCluster no RayJob owns or names), ``ray_address`` the GCS address used,
  ``checkpoint_uri`` from the annotation ``resilienced.io/checkpoint-uri`` on the RayJob, else
  the RayCluster (a malformed one leaves the instance unresolved, with the reason).
* ``ray_node_ids``: the alive Ray nodes whose address is the IP of one of the run's worker pods
  on that Node.  May be empty (e.g. a state-change notice for an instance already gone: its Ray
  nodes are dead, yet the run still needs requeueing); ``attributes["unmapped_pods"]`` lists the
  pods with no alive Ray node.
* A head pod on the instance: the target is still returned, ``attributes["head_on_instance"]``
  is True and the head's Ray node id is in ``attributes["head_node_id"]`` but not in
  ``ray_node_ids``: draining the head is pointless, because without GCS fault tolerance the whole
  cluster fate-shares with its head, so the whole cluster goes (checkpoint, then requeue the gang).
  When that head's GCS no longer answers, the target comes back without node ids and with
  ``attributes["gcs_error"]``; a GCS that does not answer while its head is elsewhere raises
  BackendUnavailable (retry the message).
* Per instance, ``unresolved`` says why there is no target: no Node with that providerID, no Ray
  pod on the Node, a Ray pod whose RayCluster is not known, a malformed checkpoint annotation, a
  missing or refused Ray token.  An instance carrying two runs may have a target for one and an
  unresolved reason for the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from resilienced.errors import BackendUnavailable, PermanentError, RayAuthError
from resilienced.kube.api import BACKEND, JsonObj
from resilienced.kube.cluster_caches import VOLCANO_JOBS, ClusterCaches
from resilienced.kube.facts import karpenter_facts, kueue_facts
from resilienced.kube.gcs_nodes import GcsNodes
from resilienced.kube.locate import (
    VOLCANO_JOB_API_VERSION,
    accelerators_requested,
    capacity_facts,
    checkpoint_uri,
    cluster_key_of,
    gcs_address,
    instance_id_of,
    is_head,
    is_ray_pod,
    labels,
    name_of,
    namespace_of,
    owning_job_ref,
    pick_job,
    pod_ip,
    ray_nodes_by_address,
    uid_of,
    volcano_job_of,
)
from resilienced.kube.tokens import auth_mode
from resilienced.model import JsonValue, Target
from resilienced.ports import Location, RayNode


@dataclass(frozen=True)
class _View:
    """What locate needs to know about one RayCluster."""

    key: str
    raycluster: JsonObj
    job_key: str | None
    job_candidates: tuple[str, ...]
    checkpoint_uri: str | None
    address: str
    auth: str
    nodes_by_ip: Mapping[str, RayNode]
    gcs_error: str | None = None
    volcano_job: JsonObj | None = None  # Ray inside a Volcano Job: the Job (or what the pods say of it)


#: How long locating waits for the Node and pod caches to follow the API server again (a re-list
#: after a 410 Gone, a watch in its backoff) before it calls an instance unresolved (below).
CURRENT_WAIT_S = 10.0


class Locator:
    """``locate`` over the cluster's ``caches``, with the Ray node ids from each cluster's GCS (``gcs``).

    An instance the caches do not resolve (no Node, or a Node that runs no Ray pod) while the Node
    or pod cache lags the API server (``Informer.answers`` false: re-listing after a 410 Gone, or a
    watch in its backoff) is looked at again once they follow it, waited for at most
    :data:`CURRENT_WAIT_S`; still lagging, the notice is retried (``BackendUnavailable``), not
    decided on a stale cache: a run whose pods came while the watch re-listed would be
    ``not_actionable`` and its save lost (the chaos campaign's ``kube-watch-410`` fault, seen
    under load).  An instance the caches do resolve is located at once, lagging or not: its
    drain must not wait for the API server.
    """

    def __init__(self, caches: ClusterCaches, *, gcs: GcsNodes) -> None:
        self._caches = caches
        self._gcs = gcs

    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        await self._caches.wait_ready()
        location = await self._locate(instance_ids=instance_ids, capacity_reservation_id=capacity_reservation_id)
        lagging = [i for i in (self._caches.nodes, self._caches.pods) if not i.answers]
        if not location.unresolved or not lagging:
            return location
        current = await asyncio.gather(*(i.wait_until(lambda c: c.answers, timeout=CURRENT_WAIT_S) for i in lagging))
        if not all(current):
            why = "; ".join(f"{i.source.resource}: {i.behind or 'not running'}" for i in lagging if not i.answers)
            raise BackendUnavailable(BACKEND, f"instance(s) {', '.join(location.unresolved)} not found in caches that "
                                              f"lag the API server ({why}): looked at again", delay=5.0)
        return await self._locate(instance_ids=instance_ids, capacity_reservation_id=capacity_reservation_id)

    async def _locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        ids = list(dict.fromkeys(instance_ids))
        if capacity_reservation_id:
            for node in self._caches.nodes.by_index("reservation", capacity_reservation_id):
                instance = instance_id_of(node)
                if instance and instance not in ids:
                    ids.append(instance)
        unresolved: dict[str, str] = {}
        found: list[tuple[str, JsonObj, str, list[JsonObj]]] = []
        for instance in ids:
            nodes = self._caches.nodes.by_index("instance", instance)
            if not nodes:
                unresolved[instance] = f"no Kubernetes Node has spec.providerID aws:///<az>/{instance}"
                continue
            node = nodes[0]
            pods = [p for p in self._caches.pods.by_index("node", name_of(node)) if is_ray_pod(p)]
            if not pods:
                unresolved[instance] = f"Node {name_of(node)} ({instance}) runs no Ray pods"
                continue
            by_cluster: dict[str, list[JsonObj]] = {}
            for pod in pods:
                by_cluster.setdefault(cluster_key_of(pod) or "", []).append(pod)
            for key, cluster_pods in sorted(by_cluster.items()):
                found.append((instance, node, key, cluster_pods))

        located_nodes = {name_of(node) for _, node, _, _ in found}
        keys = list(dict.fromkeys(key for _, _, key, _ in found))
        results = await asyncio.gather(*(self._view(key, located_nodes) for key in keys), return_exceptions=True)
        views: dict[str, _View | str] = {}
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            views[key] = result

        targets: list[Target] = []
        for instance, node, key, pods in found:
            view = views[key]
            if isinstance(view, str):
                unresolved.setdefault(instance, view)
                continue
            targets.append(self._target(instance=instance, node=node, view=view, pods=pods))
        return Location(targets=tuple(targets), unresolved=unresolved)

    def _job_of(self, raycluster: JsonObj) -> tuple[str | None, JsonObj | None, tuple[str, ...]]:
        ns, key = namespace_of(raycluster), f"{namespace_of(raycluster)}/{name_of(raycluster)}"
        ref = owning_job_ref(raycluster)
        if ref is not None:
            job = self._caches.rayjobs.get(ns, str(ref.get("name", "")))
            if job is not None and ref.get("uid") and uid_of(job) != ref.get("uid"):
                job = None  # a RayJob of the same name, recreated: not this cluster's owner
            return f"{ns}/{ref.get('name')}", job, ()
        candidates = self._caches.rayjobs.by_index("cluster", key)
        job = pick_job(candidates)
        if job is not None:
            return f"{ns}/{name_of(job)}", job, ()
        return None, None, tuple(f"{ns}/{name_of(j)}" for j in candidates)

    async def _view(self, key: str, located_nodes: set[str]) -> _View | str:
        ns, _, name = key.partition("/")
        raycluster = self._caches.rayclusters.get(ns, name)
        volcano: JsonObj | None = None
        candidates: tuple[str, ...]
        if raycluster is None:
            found = self._volcano_run(key)
            if isinstance(found, str):
                return found
            raycluster, volcano = found  # Ray inside a Volcano Job: the Job stands for the RayCluster
            job_key, job, candidates = None, None, ()
        else:
            job_key, job, candidates = self._job_of(raycluster)
        uri, problem = checkpoint_uri(job, raycluster)
        if problem:
            return problem
        head = next((p for p in self._caches.pods.by_index("cluster", key) if is_head(p) and is_ray_pod(p)), None)
        address = gcs_address(raycluster, head)
        gcs_error = None
        try:
            nodes = await self._gcs.nodes(raycluster, address)
        except RayAuthError as err:
            return f"RayCluster {key}: {err}"
        except BackendUnavailable as err:
            head_here = head is not None and (head.get("spec") or {}).get("nodeName") in located_nodes
            if not head_here:
                raise
            nodes, gcs_error = [], str(err)
        except PermanentError as err:
            return f"RayCluster {key}: {err}"
        return _View(
            key=key, raycluster=raycluster, job_key=job_key, job_candidates=candidates, checkpoint_uri=uri,
            address=address, auth=auth_mode(raycluster), nodes_by_ip=ray_nodes_by_address(nodes),
            gcs_error=gcs_error, volcano_job=volcano,
        )

    def _volcano_run(self, key: str) -> tuple[JsonObj, JsonObj] | str:
        """(stand-in RayCluster, Volcano Job) for Ray pods that a Volcano Job created, or why not.

        The stand-in has the ``ray.io/cluster`` name, the Job's uid and annotations (so the
        checkpoint annotation is read from the Job), and no status: the GCS is found from the
        head pod.  Where the cluster serves Volcano Jobs, the Job must be in the cache (same uid).
        """
        ns, _, name = key.partition("/")
        owners: dict[str, str] = {}
        for pod in self._caches.pods.by_index("cluster", key):
            owner = volcano_job_of(pod)
            if owner is not None:
                owners[owner[0]] = owners.get(owner[0]) or owner[1]
        if not owners:
            return f"Ray pods carry ray.io/cluster={name} but RayCluster {key} is not known"
        if len(owners) > 1:
            return f"Ray pods with ray.io/cluster={name} belong to several Volcano Jobs: {', '.join(sorted(owners))}"
        (job_key, uid), = owners.items()
        job_ns, _, job_name = job_key.partition("/")
        cache = self._caches.cache_of(VOLCANO_JOBS)
        job = cache.get(job_ns, job_name) if cache is not None else None
        if cache is not None and (job is None or (uid and uid_of(job) != uid)):
            return f"Ray pods with ray.io/cluster={name} were created by Volcano Job {job_key}, which is not known"
        if job is None:
            job = {"apiVersion": VOLCANO_JOB_API_VERSION, "kind": "Job",
                   "metadata": {"name": job_name, "namespace": job_ns, "uid": uid}}
        stand_in = {"metadata": {"name": name, "namespace": ns, "uid": uid_of(job),
                                 "annotations": dict((job.get("metadata") or {}).get("annotations") or {})}}
        return stand_in, job

    def _target(self, *, instance: str, node: JsonObj, view: _View, pods: list[JsonObj]) -> Target:
        ids: list[str] = []
        unmapped: list[JsonValue] = []
        head_here = False
        head_node_id = None
        for pod in pods:
            ray_node = view.nodes_by_ip.get(pod_ip(pod) or "")
            if is_head(pod):
                head_here = True
                head_node_id = ray_node.node_id if ray_node else None
            elif ray_node is not None:
                ids.append(ray_node.node_id)
            else:
                unmapped.append(name_of(pod))
        attributes: dict[str, JsonValue] = {
            "namespace": namespace_of(view.raycluster),
            "pods": [name_of(p) for p in pods],
            "head_on_instance": head_here,
            "auth": view.auth,
            "provider_id": (node.get("spec") or {}).get("providerID"),
        }
        if head_here:
            attributes["head_node_id"] = head_node_id
        if unmapped:
            attributes["unmapped_pods"] = unmapped
        if view.gcs_error:
            attributes["gcs_error"] = view.gcs_error
        if view.job_candidates:
            attributes["ray_jobs"] = list(view.job_candidates)
        job = view.volcano_job
        volcano_job = None
        if view.volcano_job is not None:
            volcano_job = f"{namespace_of(view.volcano_job)}/{name_of(view.volcano_job)}"
        elif view.job_key:
            job_ns, job_name = view.job_key.split("/", 1)
            job = self._caches.rayjobs.get(job_ns, job_name)
        workers = [(p.get("spec") or {}).get("nodeName") or ""
                   for p in self._caches.pods.by_index("cluster", view.key) if not is_head(p)]
        facts = capacity_facts(node=node, run_objects=[o for o in (job, view.raycluster) if o],
                               worker_nodes=workers)
        groups = tuple(sorted({labels(p).get("ray.io/group", "") for p in pods} - {""}))
        facts = karpenter_facts(self._caches, node, replace(facts, volcano_job=volcano_job, groups=groups))
        facts = kueue_facts(self._caches, [o for o in (job, view.raycluster) if o], facts)
        facts = replace(facts, accelerators=accelerators_requested(
            [p for p in self._caches.pods.by_index("cluster", view.key) if not is_head(p)]))  # for the ledger
        return Target(
            instance_id=instance, node=name_of(node), ray_cluster=view.key, ray_job=view.job_key,
            ray_node_ids=tuple(dict.fromkeys(ids)), checkpoint_uri=view.checkpoint_uri,
            ray_address=view.address, attributes=attributes, facts=facts,
        )
