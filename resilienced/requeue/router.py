"""The requeue front door: pick the applier for a target, then count it and tell the operator.

:class:`RequeueRouter` routes a kubernetes-mode target:

    facts.volcano_job set                               -> VolcanoRequeuer
    RayJob (else RayCluster) labelled kueue queue-name  -> KueueRequeuer
      (a RayJob with spec.clusterSelector is never Kueue's: Kueue skips it; its RayCluster may be)
    RayCluster owned by a RayJob with that label        -> KueueRequeuer (through the RayJob)
    otherwise                                           -> KubeRayRequeuer

:class:`ReportingRequeuer` wraps any requeuer (the Kubernetes router or the ray-mode one) with what every
requeue does besides the change itself: the metric ``resilienced_requeues_total{capacity}``
(``capacity``: spot | capacity-block | on-demand | wait; counted when a requeue changed something,
and for every ``wait`` outcome) and a Kubernetes Event through ``Cluster.record`` (reason
``Requeued``, or ``RequeueWaiting`` as a warning).  A requeue that changed nothing (the same
decision applied again) is neither counted nor recorded; a dry run never is.
"""

from __future__ import annotations

from dataclasses import replace

from kubernetes_asyncio import client as k8s
from prometheus_client import CollectorRegistry, Counter

from resilienced.errors import PermanentError, ResilienceError
from resilienced.log import get as get_logger
from resilienced.model import Capacity, CapacityDecision, Event, RequeueResult, Target
from resilienced.ports import Cluster, Requeuer, Withdraws
from resilienced.requeue.elastic import with_fallback
from resilienced.requeue.kuberay import KubeRayRequeuer
from resilienced.requeue.kueue import KueueRequeuer, is_kueue_managed
from resilienced.requeue.objects import RAYCLUSTER, RAYJOB, Objects, split_key
from resilienced.requeue.volcano import VolcanoRequeuer

log = get_logger(__name__)

REASON_REQUEUED = "Requeued"
REASON_WAITING = "RequeueWaiting"
REASON_REFUSED = "RequeueRefused"


class RequeueMetrics:
    """``resilienced_requeues_total{capacity}`` on ``registry`` (the daemon's ``Metrics.registry``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requeues = Counter(
            "resilienced_requeues", "Runs requeued, by the capacity they were sent to (wait: none yet).",
            ["capacity"], registry=registry)
        for capacity in Capacity:
            self.requeues.labels(capacity=capacity.value)  # every series exists from the start


class RequeueRouter:
    """Routes a kubernetes-mode target to the Kueue, KubeRay or Volcano requeuer."""

    kind = "kubernetes"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        kueue: KueueRequeuer | None = None,
        kuberay: KubeRayRequeuer | None = None,
        volcano: VolcanoRequeuer | None = None,
        request_timeout_s: float = 10.0,
    ) -> None:
        self.objects = Objects(api_client, request_timeout_s=request_timeout_s)
        self.kueue = kueue or KueueRequeuer(api_client, request_timeout_s=request_timeout_s)
        self.kuberay = kuberay or KubeRayRequeuer(api_client, request_timeout_s=request_timeout_s)
        self.volcano = volcano or VolcanoRequeuer(api_client, request_timeout_s=request_timeout_s)

    async def resolve(self, target: Target) -> tuple[Requeuer, Target]:
        """The applier for ``target``, and the target as that applier needs it.

        A RayCluster that a RayJob owns is requeued through that RayJob when Kueue manages the
        job (Kueue admits the RayJob; its cluster has no queue label of its own).
        """
        if target.facts.volcano_job:
            return self.volcano, target
        if target.ray_job:
            namespace, name = split_key(target.ray_job, what="target.ray_job")
            job = await self.objects.find(RAYJOB, namespace, name)
            if job is None:
                raise PermanentError(f"requeue: RayJob {target.ray_job} no longer exists")
            if is_kueue_managed(job):
                return self.kueue, target
            if (job.get("spec") or {}).get("clusterSelector") and target.ray_cluster:
                # Kueue skips a RayJob on an existing cluster; the cluster may be Kueue's itself.
                cns, cname = split_key(target.ray_cluster, what="target.ray_cluster")
                cluster = await self.objects.find(RAYCLUSTER, cns, cname)
                if cluster is not None and is_kueue_managed(cluster):
                    return self.kueue, replace(target, ray_job=None)
            return self.kuberay, target
        if target.ray_cluster:
            namespace, name = split_key(target.ray_cluster, what="target.ray_cluster")
            cluster = await self.objects.find(RAYCLUSTER, namespace, name)
            if cluster is None:
                raise PermanentError(f"requeue: RayCluster {target.ray_cluster} no longer exists")
            if is_kueue_managed(cluster):
                return self.kueue, target
            owner = next((ref for ref in (cluster.get("metadata") or {}).get("ownerReferences") or []
                          if ref.get("kind") == RAYJOB.kind and ref.get("controller")), None)
            if owner is not None:
                job = await self.objects.find(RAYJOB, namespace, owner["name"])
                if job is not None and is_kueue_managed(job):
                    return self.kueue, replace(target, ray_job=f"{namespace}/{owner['name']}")
            return self.kuberay, target
        raise PermanentError(f"requeue: target {target.run_key} names no RayJob, RayCluster or Volcano Job")

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        applier, resolved = await self.resolve(target)
        result = await applier.requeue(resolved, decision=decision, event=event, dry_run=dry_run)
        if target.facts.elastic is True and applier is self.volcano:
            return with_fallback(result, "a Volcano Job restarts as a whole (RestartJob); requeued as a gang")
        # The locate step found the run marked elastic but not scalable (Kueue) or the annotation malformed.
        return with_fallback(result, target.facts.elastic_fallback or target.facts.elastic_error)


class ReportingRequeuer:
    """A requeuer plus its metric and its Events.

    Args:
        requeuer: the applier (``RequeueRouter`` or ``RayModeRequeuer``).
        cluster: where Events go (``Cluster.record``); None records nothing.
        metrics: the counter; None counts nothing.
    """

    def __init__(self, requeuer: Requeuer, *, cluster: Cluster | None = None,
                 metrics: RequeueMetrics | None = None) -> None:
        self.requeuer = requeuer
        self.cluster = cluster
        self.metrics = metrics

    @property
    def kind(self) -> str:
        """The applier's kind (``kubernetes`` or ``ray``)."""
        return self.requeuer.kind

    async def withdraw(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> list[str]:
        """The applier's ``withdraw`` (ray mode); Kubernetes appliers have nothing to give back: the
        next requeue replaces the pods that wait on the stalled capacity."""
        if isinstance(self.requeuer, Withdraws):
            return await self.requeuer.withdraw(target, capacity=capacity, reservation_id=reservation_id)
        return []

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        result = await self.requeuer.requeue(target, decision=decision, event=event, dry_run=dry_run)
        if dry_run:
            return result
        if result.refused:
            await self._record(target, REASON_REFUSED, f"requeue of run {result.run_key} refused: {result.reason}",
                               warning=True)
            return result
        waiting = result.capacity is Capacity.WAIT
        if not result.changed and not waiting:
            return result
        if self.metrics is not None:
            self.metrics.requeues.labels(capacity=result.capacity.value).inc()
        if self.cluster is not None:
            if waiting:
                message = f"run {result.run_key} waits for capacity: {result.reason}"
            else:
                where = result.capacity.value + (f" {result.reservation_id}" if result.reservation_id else "")
                message = f"requeued run {result.run_key} on {where} after event {event.event_id}: {result.reason}"
            if result.details.get("elastic_fallback"):
                message += f" (elastic run requeued as a gang: {result.details['elastic_fallback']})"
            await self._record(target, REASON_WAITING if waiting else REASON_REQUEUED, message, warning=waiting)
        return result

    async def _record(self, target: Target, reason: str, message: str, *, warning: bool) -> None:
        if self.cluster is None:
            return
        try:
            await self.cluster.record(target, reason=reason, message=message, warning=warning)
        except ResilienceError as e:  # an Event is a courtesy: the requeue itself is done
            log.warning("requeue event not recorded", run=target.run_key, error=str(e))
