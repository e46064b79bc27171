"""From settings to a working responder: adapters opened, wired, and closed again.

:func:`open_runtime` is the one place that knows which adapter serves which port in each mode:

==========  ==================================  ================================================
mode        cluster / claims / GCS              requeue
==========  ==================================  ================================================
plan        none: :class:`PlanLogger` only      none
kubernetes  ``KubeCluster`` (watch caches),     ``RequeueRouter`` (Kueue, KubeRay, Volcano)
            ``KubeLeaseClaims``, a ``RayGcs``
            per RayCluster (token per cluster)
ray         ``RayModeCluster`` on one ``RayGcs``, ``RayModeRequeuer`` when a node provider is
            ``RayKvClaims`` on its GCS KV         given (:class:`StandIns`: the drill's); else no capacity
                                                  decision is made: the requeue step is
                                                  recorded as "no capacity planner or requeuer
                                                  configured", and Ray's autoscaler replaces
                                                  the nodes
==========  ==================================  ================================================

Each mode's cluster is built in one place (:func:`open_kube_cluster`; :func:`ray_gcs` and
:func:`ray_mode_cluster`), which ``replay`` reaches read-only through :func:`open_cluster` (its GCS
clients wrapped in ``doubles.ReadOnlyRay``: no second wiring of the adapters).

The follow-up after a requeue (``--follow-up``, on by default) is a ``Follower`` over the mode's
follow-up store (kubernetes: ``KubeFollowUps`` Leases; ray: ``RayKvFollowUps`` on the GCS KV)
and progress probe (``KubeProgress``; ``RayProgress``), started as the long-lived task
``resilienced.follow-up`` and stopped with the runtime.

Long-lived tasks (the follow-up, kubernetes mode's watch caches and Lease sweeper
``resilienced.lease-sweep``) are spawned on the daemon's ``supervisor.Supervisor`` (``open_runtime``'s
``supervisor``), in scopes closed before the clients they use, so ``/healthz`` sees one die.

S3 (durable), EC2 (Capacity Blocks, DescribeInstances), FSx (export tasks) and Auto Scaling
(lifecycle hooks) are aiobotocore clients of the queue's region, made by
:func:`resilienced.aws.clients.open_client` (one config, as for ``replay``); ``--endpoint-url``
applies to all of them (moto and LocalStack serve every service on one endpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiobotocore.client import AioBaseClient
from prometheus_client import Counter

from resilienced import log
from resilienced.aws.autoscaling import Lifecycle
from resilienced.aws.clients import open_client
from resilienced.doubles import MemoryClaims, ReadOnlyRay
from resilienced.errors import ConfigError, ResilienceError
from resilienced.ops.ledger_metrics import LedgerMetrics
from resilienced.ops.metrics import Metrics
from resilienced.model import Target
from resilienced.ops.notify import Notifier, NotifyMetrics, load_template
from resilienced.ports import (
    CapacitySource,
    ClaimStore,
    Cluster,
    FollowUpStore,
    NodeProvider,
    ObjectStore,
    Planner,
    Progress,
    RayControl,
    Requeuer,
    Responder,
)
from resilienced.followup.follower import Follower, FollowUpMetrics, FollowUpOptions
from resilienced.recovery.move import Mover
from resilienced.recovery.plan_only import PlanLogger
from resilienced.recovery.responder import Recovery, RecoveryMetrics, RecoveryOptions
from resilienced.settings import ExportMode, Mode, ModeSettings, Settings
from resilienced.supervisor import Supervisor

if TYPE_CHECKING:  # imported where used: the kubernetes client is loaded in kubernetes mode only
    from resilienced.kube.cluster import KubeCluster
    from resilienced.ray.cluster import RayModeCluster
    from resilienced.ray.gcs import RayGcs
    from resilienced.kube.leases import KubeLeaseClaims
    from resilienced.requeue.router import RequeueMetrics

#: how the recovery reaches a run's Ray GCS (kubernetes mode: per RayCluster; ray mode: the one GCS)
RayControlFor = Callable[[Target], Awaitable[RayControl]]


@dataclass(frozen=True)
class ModeParts:
    """The adapters one mode (kubernetes or ray) gives the recovery and its follow-up."""

    cluster: Cluster
    claims: ClaimStore
    requeuer: Requeuer | None
    ray_control: RayControlFor
    follow_ups: FollowUpStore
    progress: Progress


@dataclass(frozen=True)
class MetricGroups:
    """Every metric group the daemon registers besides :class:`Metrics`' own, on its registry."""

    recovery: RecoveryMetrics
    requeue: RequeueMetrics
    interruptions: Counter  # resilienced_interruptions_total
    notify: NotifyMetrics
    follow_up: FollowUpMetrics
    ledger: LedgerMetrics


def metric_groups(metrics: Metrics) -> MetricGroups:
    """Register every group on ``metrics.registry`` once (the daemon; docs and tests list them)."""
    from resilienced.capacity.planner import interruption_counter
    from resilienced.requeue.router import RequeueMetrics

    r = metrics.registry
    return MetricGroups(recovery=RecoveryMetrics(r), requeue=RequeueMetrics(r),
                        interruptions=interruption_counter(r), notify=NotifyMetrics(r),
                        follow_up=FollowUpMetrics(r), ledger=LedgerMetrics(r))


@dataclass(frozen=True)
class StandIns:
    """Adapters given instead of those the settings would open: the seam ``resilienced/local/``
    (the drill) and tests fill, as Karpenter's operator takes the providers its tests replace
    with ``pkg/fake``.  The daemon itself passes none.

    ``capacity``: the source of Capacity Blocks instead of EC2 (the drill's static blocks,
    ``resilienced.local.capacity``); ``node_provider``: ray mode's replacement nodes (the drill's
    local provider; without one, Ray's autoscaler replaces the nodes and the requeue only records
    the capacity decision); ``ray_control``: kubernetes mode's way to a run's GCS, ``(address,
    token) -> RayControl`` (the cluster tests' recording stand-in, whose Ray nodes have the pods'
    IPs; without one, the GCS at the RayCluster's address).
    """

    capacity: CapacitySource | None = None
    node_provider: NodeProvider | None = None
    ray_control: Callable[[str, str | None], RayControl] | None = None


@dataclass
class Runtime:
    """What the daemon (and the drill) runs with."""

    responder: Responder
    claims: ClaimStore


def read_token(path: str | None) -> str | None:
    """The Ray token in ``path`` (stripped), or None when no path is given."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError("--ray-token-file", f"cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise ConfigError("--ray-token-file", f"{path} is empty")
    return token


#: How often done claims older than the dedupe window are swept (kubernetes mode).
SWEEP_INTERVAL_S = 3600.0


async def _sweep_leases(claims: KubeLeaseClaims, *, older_than: float) -> None:
    """Delete done claim Leases past the dedupe window, now and then every hour."""
    logger = log.get("resilienced.claims")
    while True:
        try:
            removed = await claims.sweep(older_than=timedelta(seconds=older_than))
            if removed:
                logger.info("swept done claims", removed=removed)
        except ResilienceError as e:  # next time; a sweep is housekeeping
            logger.warning("claim sweep failed", error=str(e))
        await asyncio.sleep(SWEEP_INTERVAL_S)


def _notifier(settings: Settings, metrics: NotifyMetrics) -> Notifier | None:
    """The webhook notifier of ``--notify-webhook`` / ``--notify-webhook-file``, or None."""
    ns = settings.notify
    webhook = ns.webhook_url()
    if webhook is None:
        if ns.notify_webhook_file:
            log.get("resilienced.notify").info("no webhook file: notifications off",
                                               path=ns.notify_webhook_file)
        return None
    return Notifier(url=webhook, template=load_template(ns.notify_template),
                    timeout_s=ns.notify_timeout_seconds, retries=ns.notify_retries, metrics=metrics)


@dataclass(frozen=True)
class ReadOnly:
    """What makes a mode's cluster read-only (``replay``): every GCS client is a
    :class:`~resilienced.doubles.ReadOnlyRay` (node listings only, each bounded by ``gcs_timeout_s``;
    in kubernetes mode a GCS that does not answer is recorded in ``gcs_errors`` by address), and
    :func:`open_cluster` hands the cluster over only once it answers (kubernetes: the caches' first
    lists within ``ready_timeout_s``; ray: the GCS answers a ping), else it raises
    (BackendUnavailable, RayAuthError)."""

    gcs_timeout_s: float
    ready_timeout_s: float
    gcs_errors: dict[str, str] = field(default_factory=dict)

    def gcs(self, address: str, token: str | None) -> RayControl:
        from resilienced.ray.gcs import RayGcs

        return ReadOnlyRay(RayGcs(address, token=token), timeout_s=self.gcs_timeout_s, errors=self.gcs_errors)


async def open_kube_cluster(mode: ModeSettings, stack: AsyncExitStack, *, replica: str,
                            supervisor: Supervisor | None = None,
                            ray_control: Callable[[str, str | None], RayControl] | None = None,
                            read_only: ReadOnly | None = None) -> tuple[KubeCluster, Any]:
    """kubernetes mode's cluster and the API client its other adapters share, both closed by ``stack``:
    the client of ``--kubeconfig``/``--kube-context``, a ``KubeCluster`` on its watch caches (on
    ``supervisor``), started, with a ``RayGcs`` per RayCluster (``ray_control``: a stand-in's)."""
    from resilienced.kube.api import connect
    from resilienced.kube.cluster import KubeCluster, KubeOptions
    from resilienced.ray.gcs import RayGcs

    api = await connect(kubeconfig=mode.kubeconfig, context=mode.kube_context)
    stack.push_async_callback(api.close)
    factory: Callable[[str, str | None], RayControl] = ray_control or (lambda addr, tok: RayGcs(addr, token=tok))
    options = None
    if read_only is not None:
        factory = read_only.gcs
        options = KubeOptions(ready_timeout_s=read_only.ready_timeout_s, gcs_timeout_s=read_only.gcs_timeout_s + 5,
                              follow_up_caches=False)
    cluster = KubeCluster(api, ray_control_factory=factory, replica=replica, options=options, supervisor=supervisor)
    await cluster.start()
    stack.push_async_callback(cluster.stop)
    if read_only is not None:
        await cluster.wait_ready()
    return cluster, api


def ray_gcs(mode: ModeSettings) -> RayGcs:
    """ray mode's one GCS client: ``--ray-address`` with the token of ``--ray-token-file`` (a
    malformed address is a ConfigError naming the flag)."""
    from resilienced.ray.gcs import RayGcs

    token = read_token(mode.ray_token_file)
    try:
        return RayGcs(mode.ray_address or "", token=token)
    except ValueError as e:
        raise ConfigError("--ray-address", str(e)) from None


def ray_mode_cluster(mode: ModeSettings, *, ray: RayControl, ec2: AioBaseClient | None) -> RayModeCluster:
    """ray mode's cluster on the GCS ``ray`` (EC2's DescribeInstances where no node has the label)."""
    from resilienced.ray.cluster import RayModeCluster

    return RayModeCluster(ray=ray, checkpoint_uri=mode.checkpoint_uri, ec2=ec2,
                          instance_label=mode.instance_label, instance_type=mode.instance_type)


async def open_cluster(mode: ModeSettings, stack: AsyncExitStack, *, replica: str, ec2: AioBaseClient | None,
                       read_only: ReadOnly) -> Cluster:
    """The read-only ``Cluster`` of ``mode`` (``replay``), built as the daemon builds its own
    (:func:`open_kube_cluster`; :func:`ray_gcs` and :func:`ray_mode_cluster`), and closed by ``stack``."""
    if mode.mode is Mode.KUBERNETES:
        cluster, _ = await open_kube_cluster(mode, stack, replica=replica, read_only=read_only)
        return cluster
    ray = ReadOnlyRay(ray_gcs(mode), timeout_s=read_only.gcs_timeout_s)
    await ray.ping()
    return ray_mode_cluster(mode, ray=ray, ec2=ec2)


async def _kubernetes(settings: Settings, stack: AsyncExitStack, *, replica: str,
                      supervisor: Supervisor,
                      ray_control: Callable[[str, str | None], RayControl] | None = None) -> ModeParts:
    """kubernetes mode's adapters, closed by ``stack``; the caches and the sweeper on ``supervisor``."""
    from resilienced.kube.followup_store import KubeFollowUps
    from resilienced.kube.leases import KubeLeaseClaims
    from resilienced.requeue.kueue import KueueRequeuer, discover_workload_version
    from resilienced.kube.progress import KubeProgress
    from resilienced.requeue.router import RequeueRouter

    cluster, api = await open_kube_cluster(settings.mode, stack, replica=replica, supervisor=supervisor,
                                           ray_control=ray_control)
    claims = KubeLeaseClaims(api, namespace=settings.mode.claims_namespace)
    sweeping = await stack.enter_async_context(supervisor.scope())  # ends before the client closes
    sweeping.spawn(_sweep_leases(claims, older_than=settings.intake.dedupe_seconds),
                   name="resilienced.lease-sweep")
    workload_version: str | None = settings.mode.kueue_api_version
    if workload_version == "auto":
        workload_version = await discover_workload_version(api)
    kueue = KueueRequeuer(api, workload_version=workload_version)
    return ModeParts(cluster=cluster, claims=claims, requeuer=RequeueRouter(api, kueue=kueue),
                     ray_control=cluster.ray_control,
                     follow_ups=KubeFollowUps(api, namespace=settings.mode.claims_namespace),
                     progress=KubeProgress(api, kueue=kueue, caches=cluster.caches))


def _ec2_nodes(settings: Settings, *, ec2: AioBaseClient, capacity: CapacitySource) -> NodeProvider | None:
    """ray mode's EC2 node provider (``--ec2-launch-template``; docs/ray.md "Ray on EC2"), else None."""
    from resilienced.aws.ec2nodes import Ec2NodeProvider, parse_subnets

    s = settings.ec2_nodes
    if not s.ec2_launch_template:
        return None
    return Ec2NodeProvider(
        ec2, launch_template=s.ec2_launch_template, launch_template_version=s.ec2_launch_template_version,
        gcs_address=s.ec2_gcs_address or settings.mode.ray_address or "", owner=s.ec2_owner,
        subnets=parse_subnets(s.ec2_subnets), on_demand_reservation_preference=s.ec2_on_demand_reservation_preference,
        reservations=capacity, autoscaler_capacities=s.ec2_autoscaler_capacities)


def _ray_mode(settings: Settings, *, ec2: AioBaseClient, provider: NodeProvider | None,
              capacity: CapacitySource) -> ModeParts:
    """ray mode's adapters (no requeuer without a node provider: the stand-in's, else the EC2 one)."""
    from resilienced.ray.claims import RayKvClaims
    from resilienced.ray.followup_store import RayKvFollowUps
    from resilienced.ray.progress import RayProgress
    from resilienced.ray.requeue import RayModeRequeuer

    ray = ray_gcs(settings.mode)
    cluster = ray_mode_cluster(settings.mode, ray=ray, ec2=ec2)
    claims = RayKvClaims(kv=ray, done_ttl_seconds=settings.intake.dedupe_seconds)
    provider = provider if provider is not None else _ec2_nodes(settings, ec2=ec2, capacity=capacity)
    requeuer = RayModeRequeuer(provider) if provider is not None else None

    async def ray_control(target: Target) -> RayControl:
        return ray

    return ModeParts(cluster=cluster, claims=claims, requeuer=requeuer, ray_control=ray_control,
                     follow_ups=RayKvFollowUps(kv=ray), progress=RayProgress(ray))


def _following(settings: Settings) -> bool:
    return settings.follow_up.follow_up


def _mover(settings: Settings, parts: ModeParts, *, planner: Planner, metrics: RequeueMetrics) -> Mover | None:
    """The one owner of moving a run (None when the mode has no applier: nothing is requeued)."""
    from resilienced.ray.replacement import ReplacementAnnouncer
    from resilienced.requeue.router import ReportingRequeuer

    if parts.requeuer is None:
        return None
    following = _following(settings)
    return Mover(planner=planner, requeue=ReportingRequeuer(parts.requeuer, cluster=parts.cluster, metrics=metrics),
                 claims=parts.claims if following else None, follow_ups=parts.follow_ups if following else None,
                 replacements=ReplacementAnnouncer(parts.ray_control, priors=settings.recovery.node_join_priors),
                 claim_ttl_s=settings.follow_up.follow_up_claim_ttl_seconds)


def _follower(settings: Settings, parts: ModeParts, *, mover: Mover | None,
              store: ObjectStore, metrics: FollowUpMetrics, notifier: Notifier | None, replica: str,
              ledger: Any = None) -> Follower | None:
    """The follow-up of ``settings.follow_up`` (None when off, or when nothing is requeued)."""
    if not _following(settings) or mover is None:
        return None
    return Follower(store=parts.follow_ups, cluster=parts.cluster, progress=parts.progress,
                    mover=mover, objects=store, options=FollowUpOptions.from_settings(settings), metrics=metrics,
                    notifier=notifier, replica=replica, ledger=ledger)


async def _ledger_keeper(settings: Settings, stack: AsyncExitStack, parts: ModeParts, *, ec2: AioBaseClient,
                         store: ObjectStore, metrics: LedgerMetrics) -> Any:
    """The follow-up's ledger (issue #43): Spot prices from EC2, On-Demand from --on-demand-prices, then
    the Pricing API (its client in us-east-1, where it answers; no call is made until a price is asked)."""
    from resilienced.aws.pricing import PRICING_REGION, PriceFile, Prices
    from resilienced.recovery.ledger import LedgerKeeper

    file = PriceFile.read(settings.ledger.on_demand_prices) if settings.ledger.on_demand_prices else None
    pricing = await stack.enter_async_context(open_client("pricing", region=PRICING_REGION,
                                                          endpoint_url=settings.queue.endpoint_url))
    prices = Prices(ec2=ec2, pricing=pricing, file=file, region=settings.queue.effective_region)
    return LedgerKeeper(objects=store, prices=prices, metrics=metrics)


@asynccontextmanager
async def open_runtime(
    settings: Settings,
    *,
    metrics: Metrics,
    replica: str,
    stand_ins: StandIns = StandIns(),
    supervisor: Supervisor | None = None,
) -> AsyncIterator[Runtime]:
    """The responder and claim store for ``settings.mode``; every adapter is closed on exit.

    ``stand_ins``: adapters given instead of EC2's Capacity Blocks and ray mode's (absent) node
    provider (:class:`StandIns`).  ``supervisor``: owns the long-lived tasks started here (the
    daemon's; else one of its own).
    """
    from resilienced.aws.s3 import S3Store
    from resilienced.capacity.ec2 import Ec2Capacity
    from resilienced.capacity.planner import CapacityPlanner

    mode = settings.mode.mode
    groups = metric_groups(metrics)  # in every mode: the same series for dashboards and alerts
    groups.ledger.floor.set(settings.ledger.goodput_floor)
    if mode is Mode.PLAN:
        yield Runtime(responder=PlanLogger(),
                      claims=MemoryClaims(done_ttl_seconds=settings.intake.dedupe_seconds))
        return

    region = settings.queue.effective_region
    endpoint = settings.queue.endpoint_url
    async with AsyncExitStack() as stack:
        async def client(service: str) -> AioBaseClient:
            return await stack.enter_async_context(open_client(service, region=region,
                                                               endpoint_url=endpoint))

        store = S3Store(client=await client("s3"))
        ec2 = await client("ec2")
        capacity = stand_ins.capacity if stand_ins.capacity is not None else Ec2Capacity(ec2)
        planner = CapacityPlanner(source=capacity, policy=settings.capacity,
                                  interruptions=groups.interruptions)
        lifecycle = Lifecycle(await client("autoscaling"))
        export = None
        rs = settings.recovery
        if rs.export_mode is ExportMode.TASK:
            from resilienced.aws.fsx import FsxExportTasks

            export = FsxExportTasks(client=await client("fsx"),
                                    report_path=(rs.fsx_data_repository_path or "").rstrip("/") + "/.fsx-reports",
                                    mount_point=rs.fsx_file_system_path if rs.fsx_file_system_path.startswith("/") else "/")
        notifier = _notifier(settings, groups.notify)
        if notifier is not None:
            stack.push_async_callback(notifier.close)
        options = RecoveryOptions.from_settings(settings)

        supervisor = supervisor if supervisor is not None else Supervisor()
        if mode is Mode.KUBERNETES:
            parts = await _kubernetes(settings, stack, replica=replica, supervisor=supervisor,
                                      ray_control=stand_ins.ray_control)
        else:
            parts = _ray_mode(settings, ec2=ec2, provider=stand_ins.node_provider, capacity=capacity)
        mover = _mover(settings, parts, planner=planner, metrics=groups.requeue)
        follower = _follower(settings, parts, mover=mover, store=store,
                             metrics=groups.follow_up, notifier=notifier, replica=replica,
                             ledger=await _ledger_keeper(settings, stack, parts, ec2=ec2, store=store,
                                                         metrics=groups.ledger))
        if follower is not None:  # its scope ends first, before the clients it uses close
            following = await stack.enter_async_context(supervisor.scope())
            following.spawn(follower.run(), name="resilienced.follow-up")
        recovery = Recovery(
            cluster=parts.cluster, claims=parts.claims, ray_control=parts.ray_control, store=store,
            mover=mover, capacity=capacity, export=export,
            lifecycle=lifecycle, options=options, metrics=groups.recovery,
            notifier=notifier, follower=follower,
        )
        yield Runtime(responder=recovery, claims=parts.claims)
