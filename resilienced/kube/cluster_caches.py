"""The watch caches of one Kubernetes cluster that kubernetes mode reads, and their discovery.

Nodes, Ray pods, RayClusters and RayJobs are always cached (one :class:`~resilienced.kube.cache.Informer`
each, in ``namespace`` or all namespaces); the optional resources of other projects (Volcano Jobs,
Karpenter's NodePools, EC2NodeClasses and NodeClaims, Kueue's queues, ResourceFlavors and
Workloads) only where API discovery says the cluster serves them, since a cache of a resource that
is not served would never sync.  Where NodeClaims are served, Karpenter's InsufficientCapacityError
Events on them are cached too (``ICE_EVENTS``).  The follow-up's probe (``kube.progress``) reads
Workloads (indexed by their controller's uid), ResourceFlavors, NodeClaims and those Events.  ``wait_ready``
bounds the wait for the first lists, so a caller answers BackendUnavailable (the message is
retried) instead of hanging.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kubernetes_asyncio import client as k8s

from resilienced.errors import BackendUnavailable
from resilienced.kube.api import BACKEND
from resilienced.kube.cache import CacheOptions, Indexer, Informer, Source, controller_uids
from resilienced.kube.discovery import CustomResource, served_as
from resilienced.kube.locate import (
    RAY_POD_SELECTOR,
    RESERVATION_LABEL,
    cluster_key_of,
    instance_id_of,
    job_cluster_keys,
    labels,
)
from resilienced.log import get as get_logger
from resilienced.supervisor import Supervisor

# the logger these lines had before KubeCluster was split (log lines are a contract)
log = get_logger("resilienced.kube.cluster")

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
#: Kueue's Workloads (the follow-up's ``admitted`` stage), indexed by their controller's uid ("controller").
WORKLOADS = CustomResource("kueue.x-k8s.io", "v1beta2", "workloads", namespaced=True, older_versions=("v1beta1",))
#: Karpenter's NodeClaims (the follow-up's evidence of a launch that failed).
NODECLAIMS = CustomResource("karpenter.sh", "v1", "nodeclaims", namespaced=False)
OPTIONAL_RESOURCES = (VOLCANO_JOBS, NODEPOOLS, EC2NODECLASSES, LOCALQUEUES, CLUSTERQUEUES, RESOURCEFLAVORS,
                      WORKLOADS, NODECLAIMS)
#: Those only the follow-up reads (its probe); a cluster without the follow-up (``replay``) does not cache them.
FOLLOW_UP_ONLY = (WORKLOADS, NODECLAIMS)
#: Indices of an optional resource's cache, by its key.
OPTIONAL_INDEXERS: dict[str, dict[str, Indexer]] = {WORKLOADS.key: {"controller": controller_uids}}
#: The Event reason Karpenter records on a NodeClaim EC2 had no capacity for.
ICE_REASON = "InsufficientCapacityError"
#: The cache of those Events (in ``optional`` by this key), started where NodeClaims are served.
ICE_EVENTS = f"events/{ICE_REASON}"
ICE_SELECTOR = f"involvedObject.kind=NodeClaim,reason={ICE_REASON}"


class ClusterCaches:
    """The caches of one cluster: ``await start()``, then read ``nodes``, ``pods``, ``rayclusters``,
    ``rayjobs`` and :meth:`cache_of`; ``supervisor`` owns the watch tasks."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        cache: CacheOptions,
        namespace: str | None,
        request_timeout_s: float,
        ready_timeout_s: float,
        supervisor: Supervisor,
        follow_up: bool = True,
    ) -> None:
        self._supervisor = supervisor
        self._resources = tuple(r for r in OPTIONAL_RESOURCES if follow_up or r not in FOLLOW_UP_ONLY)
        self._namespace = namespace
        self._cache = cache
        self._request_timeout_s = request_timeout_s
        self._ready_timeout_s = ready_timeout_s
        core = k8s.CoreV1Api(api_client)
        custom = k8s.CustomObjectsApi(api_client)
        ns = namespace

        def crs(plural: str) -> Source:
            if ns:
                return Source(f"{plural}.ray.io", custom.list_namespaced_custom_object, ("ray.io", "v1", ns, plural),
                              namespace=ns)
            return Source(f"{plural}.ray.io", custom.list_cluster_custom_object, ("ray.io", "v1", plural))

        self.nodes = Informer(
            Source("nodes", core.list_node), options=cache,
            indexers={
                "instance": lambda n: [instance_id_of(n) or ""],
                "reservation": lambda n: [labels(n).get(RESERVATION_LABEL, "")],
            },
        )
        pod_source = (
            Source("pods", core.list_namespaced_pod, (ns,), label_selector=RAY_POD_SELECTOR, namespace=ns) if ns
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
        self._core = core
        #: Caches of OPTIONAL_RESOURCES the cluster serves (by CustomResource.key); None until
        #: discovery has answered (start(), else the first wait_ready()).
        self.optional: dict[str, Informer] | None = None
        self._started = False

    async def start(self) -> None:
        try:
            await self._discover()
        except BackendUnavailable as err:  # asked again by wait_ready(): locate retries meanwhile
            log.warning("kubernetes discovery failed", error=str(err))
        for informer in self.informers:
            if not informer.running:
                informer.start(self._supervisor)
        self._started = True

    async def _discover(self) -> None:
        """Start a cache for each optional resource the cluster serves (once discovery answers)."""
        if self.optional is not None:
            return
        found: dict[str, Informer] = {}
        for resource in self._resources:
            version = await served_as(self._api_client, resource, timeout_s=self._request_timeout_s)
            if version is not None:
                found[resource.key] = Informer(self._source(replace(resource, version=version)),
                                               options=self._cache, indexers=OPTIONAL_INDEXERS.get(resource.key))
        if NODECLAIMS.key in found:
            found[ICE_EVENTS] = Informer(Source("events", self._core.list_event_for_all_namespaces,
                                                field_selector=ICE_SELECTOR), options=self._cache)
        self.optional = found
        for informer in found.values():
            informer.start(self._supervisor)
        self.informers = (*self.informers, *found.values())
        log.info("kubernetes: optional resources served", resources=list(found))

    def _source(self, resource: CustomResource) -> Source:
        ns = self._namespace
        args = (resource.group, resource.version)
        if resource.namespaced and ns:
            return Source(resource.key, self._custom.list_namespaced_custom_object, (*args, ns, resource.plural),
                          namespace=ns)
        return Source(resource.key, self._custom.list_cluster_custom_object, (*args, resource.plural))

    def cache_of(self, resource: CustomResource) -> Informer | None:
        """The cache of an optional resource, or None where the cluster does not serve it."""
        return (self.optional or {}).get(resource.key)

    async def stop(self) -> None:
        """Stop the caches (idempotent)."""
        self._started = False
        for informer in self.informers:
            await informer.stop()

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
        timeout = self._ready_timeout_s if timeout is None else timeout
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
