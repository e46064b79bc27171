"""Kubernetes mode: ``ports.Cluster`` for KubeRay, fed by watch caches.

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
import inspect
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial

from kubernetes_asyncio import client as k8s

from resilienced.capacity.request import capacity_of
from resilienced.errors import BackendUnavailable, PermanentError, RayAuthError
from resilienced.kube.api import BACKEND, JsonObj, KubeStatusError, call
from resilienced.kube.cache import CacheOptions, Informer, Source
from resilienced.kube.discovery import CustomResource, served_as
from resilienced.kube.events import EventRecorder, ObjectRef, ref_for
from resilienced.kube.karpenter import selectable_reservations
from resilienced.kube.kueue import CAPACITIES, QueueCheck, closed_capacities, worker_needs
from resilienced.kube.locate import (
    KUEUE_QUEUE_LABEL,
    RAY_POD_SELECTOR,
    RESERVATION_LABEL,
    VOLCANO_JOB_API_VERSION,
    accelerators_requested,
    capacity_facts,
    capacity_selector,
    checkpoint_uri,
    cluster_key_of,
    gcs_address,
    instance_id_of,
    is_head,
    is_ray_pod,
    job_cluster_keys,
    kueue_manages,
    labels,
    name_of,
    namespace_of,
    owning_job_ref,
    pick_job,
    pod_ip,
    ray_nodes_by_address,
    taint_value,
    uid_of,
    volcano_job_of,
)
from resilienced.kube.tokens import RayTokens, auth_mode
from resilienced.log import get as get_logger
from resilienced.model import Capacity, JsonValue, NodeShape, RunFacts, Target
from resilienced.ports import Location, RayControl, RayNode
from resilienced.supervisor import Supervisor

log = get_logger(__name__)

TAINT_KEY = "resilienced.io/interruption"
DEADLINE_ANNOTATION = "resilienced.io/interruption-deadline"

RayControlFactory = Callable[[str, str | None], RayControl]

#: Custom resources cached only where the cluster serves them (API discovery at start-up).
VOLCANO_JOBS = CustomResource("batch.volcano.sh", "v1alpha1", "jobs", namespaced=True)
NODEPOOLS = CustomResource("karpenter.sh", "v1", "nodepools", namespaced=False)
EC2NODECLASSES = CustomResource("karpenter.k8s.aws", "v1", "ec2nodeclasses", namespaced=False)
#: Kueue's queues (v1beta2 from v0.15, v1beta1 on v0.14): where a Kueue-managed run can be admitted.
LOCALQUEUES = CustomResource("kueue.x-k8s.io", "v1beta2", "localqueues", namespaced=True, older_versions=("v1beta1",))
CLUSTERQUEUES = CustomResource("kueue.x-k8s.io", "v1beta2", "clusterqueues", namespaced=False,
                               older_versions=("v1beta1",))
RESOURCEFLAVORS = CustomResource("kueue.x-k8s.io", "v1beta2", "resourceflavors", namespaced=False,
                                 older_versions=("v1beta1",))
OPTIONAL_RESOURCES = (VOLCANO_JOBS, NODEPOOLS, EC2NODECLASSES, LOCALQUEUES, CLUSTERQUEUES, RESOURCEFLAVORS)


@dataclass(frozen=True)
class KubeOptions:
    """Settings of kubernetes mode."""

    cache: CacheOptions = field(default_factory=CacheOptions)
    """How the watch caches list, watch and back off."""

    ready_timeout_s: float = 15.0
    """How long ``locate`` waits for the first lists before answering BackendUnavailable: the
    message is retried, and a 2-minute notice still has time once the caches are in."""

    request_timeout_s: float = 10.0
    """Total time for one Kubernetes request of cordon, record, token reads."""

    gcs_timeout_s: float = 5.0
    """Time allowed for one GCS node listing (seen here: ~0.5 s with token auth)."""

    gcs_ttl_s: float = 5.0
    """How long a cluster's Ray node list is reused: long enough to absorb a burst of notices,
    short enough that a pod replaced a few seconds ago is mapped to its new Ray node."""

    token_ttl_s: float = 60.0
    """How long a token read from a Secret is reused (dropped at once if the GCS refuses it)."""

    namespace: str | None = None
    """Watch Ray pods, RayClusters and RayJobs of this namespace only (None: all namespaces)."""

    service_account_token_path: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    """The daemon's own ServiceAccount token, sent to GCSes that delegate auth to Kubernetes."""

    conflict_retries: int = 5
    """Attempts of a read-modify-patch (cordon) that keeps meeting 409 Conflict."""


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


class KubeCluster:
    """``ports.Cluster`` on Kubernetes with KubeRay: ``await start()``, then ``locate``/``cordon``/``record``.

    ``api_client`` is the caller's (closed by the caller); ``ray_control_factory(address, token)``
    builds the GCS client of one Ray cluster (``resilienced.ray.gcs.RayGcs`` in production);
    ``replica`` names this daemon replica in Events (``reportingInstance``); ``supervisor`` owns
    the caches' watch tasks (the daemon's, so that /healthz sees one die; else one of its own).
    """

    mode = "kubernetes"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        ray_control_factory: RayControlFactory,
        replica: str | None = None,
        options: KubeOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.options = options or KubeOptions()
        self._supervisor = supervisor if supervisor is not None else Supervisor()
        self._factory = ray_control_factory
        self._clock = clock
        core = k8s.CoreV1Api(api_client)
        custom = k8s.CustomObjectsApi(api_client)
        self._core = core
        ns = self.options.namespace
        cache = self.options.cache

        def crs(plural: str) -> Source:
            if ns:
                return Source(f"{plural}.ray.io", custom.list_namespaced_custom_object, ("ray.io", "v1", ns, plural))
            return Source(f"{plural}.ray.io", custom.list_cluster_custom_object, ("ray.io", "v1", plural))

        self.nodes = Informer(
            Source("nodes", core.list_node), options=cache,
            indexers={
                "instance": lambda n: [instance_id_of(n) or ""],
                "reservation": lambda n: [labels(n).get(RESERVATION_LABEL, "")],
            },
        )
        pod_source = (
            Source("pods", core.list_namespaced_pod, (ns,), label_selector=RAY_POD_SELECTOR) if ns
            else Source("pods", core.list_pod_for_all_namespaces, label_selector=RAY_POD_SELECTOR)
        )
        self.pods = Informer(
            pod_source, options=cache,
            indexers={
                "node": lambda p: [(p.get("spec") or {}).get("nodeName") or ""],
                "cluster": lambda p: [cluster_key_of(p) or ""],
            },
        )
        self.rayclusters = Informer(crs("rayclusters"), options=cache)
        self.rayjobs = Informer(crs("rayjobs"), options=cache, indexers={"cluster": job_cluster_keys})
        self.informers: tuple[Informer, ...] = (self.nodes, self.pods, self.rayclusters, self.rayjobs)
        self._api_client = api_client
        self._custom = custom
        #: Caches of OPTIONAL_RESOURCES the cluster serves (by CustomResource.key); None until
        #: discovery has answered (start(), else the first wait_ready()).
        self.optional: dict[str, Informer] | None = None
        self.tokens = RayTokens(
            api_client, service_account_token_path=self.options.service_account_token_path,
            ttl_s=self.options.token_ttl_s, request_timeout_s=self.options.request_timeout_s,
        )
        self.events = EventRecorder(
            api_client, replica=replica or socket.gethostname(), request_timeout_s=self.options.request_timeout_s,
        )
        self._gcs: dict[tuple[str, str, str], tuple[float, list[RayNode]]] = {}
        self._inflight: dict[tuple[str, str, str], asyncio.Task[list[RayNode]]] = {}
        self._controls: dict[tuple[str, str | None], RayControl] = {}
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> KubeCluster:
        try:
            await self._discover()
        except BackendUnavailable as err:  # asked again by wait_ready(): locate retries meanwhile
            log.warning("kubernetes discovery failed", error=str(err))
        for informer in self.informers:
            if not informer.running:
                informer.start(self._supervisor)
        self._started = True
        return self

    async def _discover(self) -> None:
        """Start a cache for each optional resource the cluster serves (once discovery answers)."""
        if self.optional is not None:
            return
        found: dict[str, Informer] = {}
        for resource in OPTIONAL_RESOURCES:
            version = await served_as(self._api_client, resource, timeout_s=self.options.request_timeout_s)
            if version is not None:
                found[resource.key] = Informer(self._source(replace(resource, version=version)),
                                               options=self.options.cache)
        self.optional = found
        for informer in found.values():
            informer.start(self._supervisor)
        self.informers = (*self.informers, *found.values())
        log.info("kubernetes: optional resources served", resources=list(found))

    def _source(self, resource: CustomResource) -> Source:
        ns = self.options.namespace
        args = (resource.group, resource.version)
        if resource.namespaced and ns:
            return Source(resource.key, self._custom.list_namespaced_custom_object, (*args, ns, resource.plural))
        return Source(resource.key, self._custom.list_cluster_custom_object, (*args, resource.plural))

    def cache_of(self, resource: CustomResource) -> Informer | None:
        """The cache of an optional resource, or None where the cluster does not serve it."""
        return (self.optional or {}).get(resource.key)

    async def stop(self) -> None:
        """Stop the caches, cancel GCS calls in flight and close the GCS clients (idempotent)."""
        self._started = False
        for informer in self.informers:
            await informer.stop()
        for task in list(self._inflight.values()):
            task.cancel()
        for task in list(self._inflight.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody waits for it now
                pass
        self._inflight.clear()
        controls, self._controls = list(self._controls.values()), {}
        for control in controls:
            await _close(control)

    async def __aenter__(self) -> KubeCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def ready(self) -> bool:
        """True once discovery answered and every cache has its first list."""
        return self.optional is not None and all(i.synced.is_set() for i in self.informers)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the first lists; BackendUnavailable when they do not come."""
        if self.ready():
            return
        if not self._started:
            raise BackendUnavailable(BACKEND, "kubernetes caches are not running (start() not called)")
        try:
            await self._discover()
        except BackendUnavailable:
            pass  # the caches' own wait says more; discovery is asked again below
        dead = [f"{i.source.resource}: {i.failure!r}" for i in self.informers if i.failure is not None]
        if dead:
            raise BackendUnavailable(BACKEND, f"kubernetes caches stopped: {'; '.join(dead)}")
        timeout = self.options.ready_timeout_s if timeout is None else timeout
        waits = [asyncio.ensure_future(i.synced.wait()) for i in self.informers]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*waits)
        except TimeoutError:
            missing = [f"{i.source.resource} ({i.stats.last_error or 'no answer yet'})"
                       for i in self.informers if not i.synced.is_set()]
            raise BackendUnavailable(BACKEND, f"caches not synced within {timeout:g}s: {', '.join(missing)}") from None
        finally:
            for wait in waits:
                wait.cancel()
        await self._discover()  # the caches answered: discovery does too, or it says why not

    # ------------------------------------------------------------------ locate
    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        await self.wait_ready()
        ids = list(dict.fromkeys(instance_ids))
        if capacity_reservation_id:
            for node in self.nodes.by_index("reservation", capacity_reservation_id):
                instance = instance_id_of(node)
                if instance and instance not in ids:
                    ids.append(instance)
        unresolved: dict[str, str] = {}
        found: list[tuple[str, JsonObj, str, list[JsonObj]]] = []
        for instance in ids:
            nodes = self.nodes.by_index("instance", instance)
            if not nodes:
                unresolved[instance] = f"no Kubernetes Node has spec.providerID aws:///<az>/{instance}"
                continue
            node = nodes[0]
            pods = [p for p in self.pods.by_index("node", name_of(node)) if is_ray_pod(p)]
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
            job = self.rayjobs.get(ns, ref.get("name", ""))
            if job is not None and ref.get("uid") and uid_of(job) != ref.get("uid"):
                job = None  # a RayJob of the same name, recreated: not this cluster's owner
            return f"{ns}/{ref.get('name')}", job, ()
        candidates = self.rayjobs.by_index("cluster", key)
        job = pick_job(candidates)
        if job is not None:
            return f"{ns}/{name_of(job)}", job, ()
        return None, None, tuple(f"{ns}/{name_of(j)}" for j in candidates)

    async def _view(self, key: str, located_nodes: set[str]) -> _View | str:
        ns, _, name = key.partition("/")
        raycluster = self.rayclusters.get(ns, name)
        volcano: JsonObj | None = None
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
        head = next((p for p in self.pods.by_index("cluster", key) if is_head(p) and is_ray_pod(p)), None)
        address = gcs_address(raycluster, head)
        gcs_error = None
        try:
            nodes = await self._gcs_nodes(raycluster, address)
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
        for pod in self.pods.by_index("cluster", key):
            owner = volcano_job_of(pod)
            if owner is not None:
                owners[owner[0]] = owners.get(owner[0]) or owner[1]
        if not owners:
            return f"Ray pods carry ray.io/cluster={name} but RayCluster {key} is not known"
        if len(owners) > 1:
            return f"Ray pods with ray.io/cluster={name} belong to several Volcano Jobs: {', '.join(sorted(owners))}"
        (job_key, uid), = owners.items()
        job_ns, _, job_name = job_key.partition("/")
        cache = self.cache_of(VOLCANO_JOBS)
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
        unmapped: list[str] = []
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
            job = self.rayjobs.get(job_ns, job_name)
        workers = [(p.get("spec") or {}).get("nodeName") or ""
                   for p in self.pods.by_index("cluster", view.key) if not is_head(p)]
        facts = capacity_facts(node=node, run_objects=[o for o in (job, view.raycluster) if o],
                               worker_nodes=workers)
        groups = tuple(sorted({labels(p).get("ray.io/group", "") for p in pods} - {""}))
        facts = self._karpenter_facts(node, replace(facts, volcano_job=volcano_job, groups=groups))
        facts = self._kueue_facts([o for o in (job, view.raycluster) if o], facts)
        facts = replace(facts, accelerators=accelerators_requested(
            [p for p in self.pods.by_index("cluster", view.key) if not is_head(p)]))  # for the ledger
        return Target(
            instance_id=instance, node=name_of(node), ray_cluster=view.key, ray_job=view.job_key,
            ray_node_ids=tuple(dict.fromkeys(ids)), checkpoint_uri=view.checkpoint_uri,
            ray_address=view.address, attributes=attributes, facts=facts,
        )

    def _karpenter_facts(self, node: JsonObj, facts: RunFacts) -> RunFacts:
        """Where the cluster serves EC2NodeClasses and Karpenter manages the run's Node (its
        ``karpenter.sh/nodepool`` label): the Capacity Blocks Karpenter can launch the run into
        (``selectable_reservations``) and the NodePool/EC2NodeClass pairs they come from.
        Nothing otherwise (no Karpenter, or the run's nodes are an EKS managed node group's or
        nobody's): the capacity decision then takes any block of the account."""
        nodeclasses = self.cache_of(EC2NODECLASSES)
        if nodeclasses is None or facts.node_shape != NodeShape.KARPENTER.value:
            return facts
        pools = self.cache_of(NODEPOOLS)
        ids, sources = selectable_reservations(
            node=node, nodepools=pools.values() if pools is not None else (),
            nodeclass=lambda name: nodeclasses.get(None, name), instance_type=facts.instance_type)
        return replace(facts, selectable_reservations=tuple(ids), selectable_from=tuple(sources))

    def _kueue_facts(self, run_objects: Sequence[JsonObj], facts: RunFacts) -> RunFacts:
        """Where the cluster serves Kueue's queues and Kueue manages the run (not an elastic one):
        the capacities its ClusterQueue cannot admit it on now (``closed_capacity``, see
        ``resilienced.kube.kueue``).  Nothing otherwise: the follow-up after the requeue sees the rest."""
        caches = [self.cache_of(r) for r in (LOCALQUEUES, CLUSTERQUEUES, RESOURCEFLAVORS)]
        owner = next((o for o in run_objects if kueue_manages(o)), None)
        if owner is None or facts.elastic or any(c is None for c in caches):
            return facts
        localqueues, clusterqueues, flavors = caches
        queue = labels(owner)[KUEUE_QUEUE_LABEL]
        localqueue = localqueues.get(namespace_of(owner), queue)  # type: ignore[union-attr]
        name = ((localqueue or {}).get("spec") or {}).get("clusterQueue")
        clusterqueue = clusterqueues.get(None, name) if name else None  # type: ignore[union-attr]
        if clusterqueue is None:
            return facts
        spec = owner.get("spec") or {}
        groups = (spec.get("rayClusterSpec") or {}).get("workerGroupSpecs") if owner.get("kind") == "RayJob" \
            else spec.get("workerGroupSpecs")
        try:
            needs = worker_needs(groups or [])
            current = capacity_of(str(facts.capacity_type), facts.reservation_type) if facts.capacity_type else None
        except ValueError as e:
            log.warning("kueue quota not checked", run=f"{namespace_of(owner)}/{name_of(owner)}", error=str(e))
            return facts
        own = None if spec.get("suspend") or current in (None, Capacity.WAIT) else capacity_selector(
            current.value, reservation_id=facts.reservation_id, shape=facts.node_shape)
        check = QueueCheck(clusterqueue, needs=needs, own_selector=own, flavor_labels=lambda f: (
            None if (flavor := flavors.get(None, f)) is None  # type: ignore[union-attr]
            else (flavor.get("spec") or {}).get("nodeLabels") or {}))
        closed = closed_capacities(check, {c: capacity_selector(c, shape=facts.node_shape) for c in CAPACITIES})
        return replace(facts, closed_capacity=closed)

    # ------------------------------------------------------------------ GCS
    def _control(self, address: str, token: str | None) -> RayControl:
        control = self._controls.get((address, token))
        if control is None:
            control = self._factory(address, token)
            self._controls[(address, token)] = control
        return control

    async def ray_control(self, target: Target) -> RayControl:
        """The GCS client for a target's RayCluster (for the signal step), with its token."""
        ns, _, name = (target.ray_cluster or "").partition("/")
        raycluster = self.rayclusters.get(ns, name)
        if raycluster is None and target.facts.volcano_job and target.ray_address:
            return self._control(target.ray_address, None)  # Ray inside a Volcano Job: no KubeRay auth
        if raycluster is None:
            raise PermanentError(f"RayCluster {target.ray_cluster} is not known")
        head = next((p for p in self.pods.by_index("cluster", f"{ns}/{name}") if is_head(p) and is_ray_pod(p)), None)
        address = target.ray_address or gcs_address(raycluster, head)
        return self._control(address, await self.tokens.token_for(raycluster))

    async def _gcs_nodes(self, raycluster: JsonObj, address: str) -> list[RayNode]:
        key = (f"{namespace_of(raycluster)}/{name_of(raycluster)}", uid_of(raycluster), address)
        cached = self._gcs.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._fetch_nodes(raycluster, address), name=f"resilienced.kube.gcs[{key[0]}]")
            self._inflight[key] = task
            task.add_done_callback(partial(self._fetched, key))
        return await asyncio.shield(task)

    def _fetched(self, key: tuple[str, str, str], task: asyncio.Task[list[RayNode]]) -> None:
        self._inflight.pop(key, None)
        if task.cancelled() or task.exception() is not None:  # exception() also marks it retrieved
            return
        now = self._clock()
        for old in [k for k, (expires, _) in self._gcs.items() if expires <= now]:
            del self._gcs[old]  # clusters gone or quiet: keep the map small
        self._gcs[key] = (now + self.options.gcs_ttl_s, task.result())

    async def _fetch_nodes(self, raycluster: JsonObj, address: str) -> list[RayNode]:
        where = f"RayCluster {namespace_of(raycluster)}/{name_of(raycluster)}"
        mode = auth_mode(raycluster)
        for attempt in (1, 2):
            token = await self.tokens.token_for(raycluster)
            control = self._control(address, token)
            try:
                async with asyncio.timeout(self.options.gcs_timeout_s):
                    return list(await control.nodes())
            except TimeoutError:
                raise BackendUnavailable("ray", f"{where}: the GCS at {address} did not answer within "
                                                f"{self.options.gcs_timeout_s:g}s") from None
            except RayAuthError as err:
                # The token may have been rotated (Secret regenerated): read it again, once.
                self.tokens.forget(raycluster)
                stale = self._controls.pop((address, token), None)
                if stale is not None:
                    await _close(stale)
                if attempt == 2 or mode == "none":
                    hint = {
                        "none": "the RayCluster has no authOptions.mode=token, but its GCS wants a token",
                        "secret": "the token from its auth Secret was refused",
                        "kubernetes": "the daemon's ServiceAccount token was refused "
                                      "(does it have ray:write on the RayCluster?)",
                    }[mode]
                    raise RayAuthError(f"{where}: {hint}: {err}") from err
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ cordon, record
    async def _read_node(self, name: str) -> JsonObj | None:
        try:
            return await call(verb="get", resource="nodes", request=self._core.read_node(
                name, _preload_content=False, _request_timeout=self.options.request_timeout_s))
        except KubeStatusError as err:
            if err.status == 404:
                return None
            raise

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> None:
        """Taint the Node ``resilienced.io/interruption=<reason>:NoSchedule`` (once; patch, not replace).

        Node taints have no strategic-merge key, so the patch carries the whole list, guarded by
        the resourceVersion it was read at; a 409 re-reads the Node and tries again.
        """
        if not target.node:
            return
        taint = {"key": TAINT_KEY, "value": taint_value(reason), "effect": "NoSchedule"}
        node = self.nodes.get(None, target.node)
        for _ in range(self.options.conflict_retries):
            if node is None:
                node = await self._read_node(target.node)
                if node is None:
                    log.info("cordon: Node gone", node=target.node)
                    return
            taints = list((node.get("spec") or {}).get("taints") or [])
            if any(t.get("key") == TAINT_KEY and t.get("effect") == "NoSchedule" for t in taints):
                return
            patch: dict[str, JsonValue] = {
                "metadata": {"resourceVersion": (node.get("metadata") or {}).get("resourceVersion")},
                "spec": {"taints": [*taints, taint]},
            }
            if deadline is not None:
                patch["metadata"]["annotations"] = {
                    DEADLINE_ANNOTATION: deadline.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            try:
                await call(verb="patch", resource="nodes", request=self._core.patch_node(
                    target.node, patch, _preload_content=False, _request_timeout=self.options.request_timeout_s))
                return
            except KubeStatusError as err:
                if err.status == 404:
                    return
                if err.status != 409:
                    raise
                node = None
        raise BackendUnavailable(BACKEND, f"cordon {target.node}: the Node kept changing")

    async def record(self, target: Target, *, reason: str, message: str, warning: bool = False,
                     once: str | None = None) -> None:
        """An Event on the Node and one on the RayJob (else the RayCluster); ``once``: see
        :meth:`EventRecorder.emit` (one Event per object, reason and key, for every replica)."""
        refs: list[ObjectRef] = []
        if target.node:
            node = self.nodes.get(None, target.node)
            refs.append(ref_for(node, api_version="v1", kind="Node") if node is not None
                        else ObjectRef(api_version="v1", kind="Node", name=target.node, uid=""))
        runs = ((target.facts.volcano_job, VOLCANO_JOB_API_VERSION, "Job", self.cache_of(VOLCANO_JOBS)),
                (target.ray_job, "ray.io/v1", "RayJob", self.rayjobs),
                (target.ray_cluster, "ray.io/v1", "RayCluster", self.rayclusters))
        for key, api_version, kind, cache in runs:
            if not key:
                continue
            ns, _, name = str(key).partition("/")
            obj = cache.get(ns, name) if cache is not None else None
            refs.append(ref_for(obj, api_version=api_version, kind=kind) if obj is not None
                        else ObjectRef(api_version=api_version, kind=kind, name=name, uid="", namespace=ns))
            break
        for ref in refs:
            await self.events.emit(ref, reason=reason, message=message, warning=warning, once=once)


async def _close(control: object) -> None:
    closer = getattr(control, "close", None) or getattr(control, "aclose", None)
    if closer is None:
        return
    result = closer()
    if inspect.isawaitable(result):
        await result
