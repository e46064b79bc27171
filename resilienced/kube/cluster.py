"""Kubernetes mode: ``ports.Cluster`` for KubeRay, fed by watch caches.

:class:`KubeCluster` is a facade that composes one part per job:

* ``caches`` (:mod:`resilienced.kube.cluster_caches`): the watch caches and API discovery;
* ``gcs`` (:mod:`resilienced.kube.gcs_nodes`): each RayCluster's GCS client, with its Ray token,
  and its cached node list;
* ``locator`` (:mod:`resilienced.kube.locator`): ``locate``, what a Target says in kubernetes mode,
  with the Karpenter and Kueue facts of :mod:`resilienced.kube.facts`;
* ``marks`` (:mod:`resilienced.kube.marks`): ``cordon`` (the Node's taint) and ``record`` (Events).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from kubernetes_asyncio import client as k8s

from resilienced.kube.cache import CacheOptions
from resilienced.kube.cluster_caches import ClusterCaches
from resilienced.kube.events import EventRecorder
from resilienced.kube.gcs_nodes import GcsNodes, RayControlFactory
from resilienced.kube.locator import Locator
from resilienced.kube.marks import Marks
from resilienced.kube.tokens import RayTokens
from resilienced.model import Target
from resilienced.ports import CordonClaimResult, Location, RayControl
from resilienced.supervisor import Supervisor


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

    follow_up_caches: bool = True
    """Cache what only the follow-up's probe reads (Workloads, NodeClaims and their ICE Events);
    off for a cluster that follows nothing (``replay``)."""


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
        self.options = options = options or KubeOptions()
        self.caches = ClusterCaches(
            api_client, cache=options.cache, namespace=options.namespace,
            request_timeout_s=options.request_timeout_s, ready_timeout_s=options.ready_timeout_s,
            supervisor=supervisor if supervisor is not None else Supervisor(), follow_up=options.follow_up_caches,
        )
        tokens = RayTokens(
            api_client, service_account_token_path=options.service_account_token_path,
            ttl_s=options.token_ttl_s, request_timeout_s=options.request_timeout_s,
        )
        self.gcs = GcsNodes(self.caches, factory=ray_control_factory, tokens=tokens, clock=clock,
                            gcs_timeout_s=options.gcs_timeout_s, gcs_ttl_s=options.gcs_ttl_s)
        self.locator = Locator(self.caches, gcs=self.gcs)
        events = EventRecorder(
            api_client, replica=replica or socket.gethostname(), request_timeout_s=options.request_timeout_s,
        )
        self.marks = Marks(self.caches, core=k8s.CoreV1Api(api_client), events=events,
                           request_timeout_s=options.request_timeout_s, conflict_retries=options.conflict_retries)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the caches' first lists; BackendUnavailable when they do not come."""
        await self.caches.wait_ready(timeout)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> KubeCluster:
        await self.caches.start()
        return self

    async def stop(self) -> None:
        """Stop the caches, cancel GCS calls in flight and close the GCS clients (idempotent)."""
        await self.caches.stop()
        await self.gcs.close()

    async def __aenter__(self) -> KubeCluster:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ ports.Cluster
    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        return await self.locator.locate(instance_ids=instance_ids, capacity_reservation_id=capacity_reservation_id)

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> bool:
        return await self.marks.cordon(target, reason=reason, deadline=deadline)

    async def record(self, target: Target, *, reason: str, message: str, warning: bool = False,
                     once: str | None = None) -> None:
        await self.marks.record(target, reason=reason, message=message, warning=warning, once=once)

    async def ray_control(self, target: Target) -> RayControl:
        """The GCS client for a target's RayCluster (for the signal step), with its token."""
        return await self.gcs.ray_control(target)

    # ------------------------------------------------------------------ ports.CordonClaims
    def cordon_claimable(self, instance_id: str, *, event_id: str) -> bool:
        return self.marks.cordon_claimable(instance_id, event_id=event_id)

    async def cordon_claim(self, instance_id: str, *, event_id: str, reason: str,
                           deadline: datetime | None) -> CordonClaimResult:
        return await self.marks.cordon_claim(instance_id, event_id=event_id, reason=reason, deadline=deadline)
