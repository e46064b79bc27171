"""Ray mode: requeue a run on a Ray cluster without Kubernetes by adding replacement nodes.

In ray mode the capacity type is a node label (``resilienced.io/capacity-type``: ``spot`` |
``capacity-block`` | ``on-demand``).  Requeueing asks the cluster's :class:`NodeProvider` for as
many replacement nodes as the run lost, from the decided pool; Ray Train then restarts the worker
group on them and resumes from the newest complete checkpoint.

All or nothing: when the provider has no capacity there (:class:`NoCapacity`) or gives fewer
nodes than needed, the requeuer releases what it got, marks the pool unavailable in the planner's
ICE cache, and decides again (so Spot with no room becomes a Capacity Block, then On-Demand);
when nothing is left the result is ``wait`` and nothing is held.

Idempotent: every replacement node carries ``resilienced.io/replaces=<lost instance id>``; a
second application finds the replacements alive and launches nothing.

:class:`LocalNodeProvider` is the provider of the local drill and the tests: it starts real Ray
nodes on a :class:`~resilienced.localray.LocalRayCluster`, labelled with the capacity type and a
made-up instance id, from a per-capacity budget (``{"spot": 0, "capacity-block": 2}``: the
drill's ``--spot-capacity 0``).  A provider for EC2 would launch instances (RunInstances /
CreateFleet with ``MarketType`` ``spot`` or ``capacity-block`` and the reservation id) whose
``ray start`` joins with the same labels; it is not part of this package.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from resilienced.capacity.decision import Capacity, CapacityDecision
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.request import ATTR_ELASTIC, CapacityRequest
from resilienced.errors import TemporaryError
from resilienced.localray import LocalRayCluster, LocalRayNode
from resilienced.raymode import CAPACITY_TYPE_LABEL, ELASTIC_LABEL, INSTANCE_ID_LABEL, RESERVATION_LABEL
from resilienced.model import Event, Target
from resilienced.requeue.result import RequeueResult, waiting

REPLACES_LABEL = "resilienced.io/replaces"


class NoCapacity(TemporaryError):
    """The provider has no capacity in the asked pool right now (an insufficient-capacity error)."""

    def __init__(self, capacity: Capacity, message: str = "") -> None:
        super().__init__(f"no {capacity.value} capacity{': ' + message if message else ''}", delay=60.0)
        self.capacity = capacity


@dataclass(frozen=True)
class ProvidedNode:
    """A node a provider launched."""

    instance_id: str
    capacity: Capacity
    labels: Mapping[str, str] = field(default_factory=dict)
    ray_node_id: str | None = None


@runtime_checkable
class NodeProvider(Protocol):
    """Starts and stops the nodes of one Ray cluster, per capacity pool."""

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None) -> list[ProvidedNode]:
        """Start one node per entry of ``node_labels`` (extra labels each); may return fewer
        than asked when the pool runs out; raises :class:`NoCapacity` when it got none."""
        ...

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        """Stop ``nodes`` and give their capacity back."""
        ...

    async def nodes(self) -> list[ProvidedNode]:
        """The nodes this provider launched that are still up."""
        ...

    async def available(self, capacity: Capacity) -> int | None:
        """How many more nodes ``capacity`` can give (None: not known)."""
        ...


def made_up_instance_id() -> str:
    """An id of EC2's form (``i-`` and 17 hex digits) that no real instance has."""
    return "i-0" + secrets.token_hex(8)


class LocalNodeProvider:
    """A :class:`NodeProvider` that starts Ray nodes on a local cluster, from a per-capacity budget.

    Args:
        cluster: a started :class:`~resilienced.localray.LocalRayCluster`.
        capacity: how many nodes each capacity type can give, e.g. ``{"spot": 0,
            "capacity-block": 2}``; a type not listed has none.
        num_cpus: CPUs of each node started.
        stop_timeout_s: how long a released node may take to drain and exit before it is killed.
    """

    def __init__(self, cluster: LocalRayCluster, *, capacity: Mapping[str | Capacity, int],
                 num_cpus: int = 1, stop_timeout_s: float = 30.0) -> None:
        self._cluster = cluster
        self._budget: dict[Capacity, int] = {}
        for key, count in capacity.items():
            cap = Capacity(key)
            if cap is Capacity.WAIT:
                raise ValueError("capacity 'wait' is not a pool")
            if count < 0:
                raise ValueError(f"capacity[{cap.value!r}] must be >= 0, got {count}")
            self._budget[cap] = count
        self._num_cpus = num_cpus
        self._stop_timeout_s = stop_timeout_s
        self._nodes: dict[str, tuple[ProvidedNode, LocalRayNode]] = {}
        self._lock = asyncio.Lock()

    async def available(self, capacity: Capacity) -> int | None:
        return self._budget.get(Capacity(capacity), 0)

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None) -> list[ProvidedNode]:
        capacity = Capacity(capacity)
        async with self._lock:
            n = min(len(node_labels), self._budget.get(capacity, 0))
            if n == 0:
                raise NoCapacity(capacity, "the local provider's budget for it is used up")
            self._budget[capacity] -= n
        started: list[ProvidedNode] = []
        try:
            for extra in node_labels[:n]:
                instance_id = made_up_instance_id()
                labels = {**dict(extra), CAPACITY_TYPE_LABEL: capacity.value, INSTANCE_ID_LABEL: instance_id}
                if reservation_id:
                    labels[RESERVATION_LABEL] = reservation_id
                node = await asyncio.to_thread(self._cluster.add_node, labels=labels, num_cpus=self._num_cpus)
                provided = ProvidedNode(instance_id, capacity, labels, node.node_id)
                self._nodes[instance_id] = (provided, node)
                started.append(provided)
        except BaseException:
            await self.release(started)
            async with self._lock:
                self._budget[capacity] += n - len(started)
            raise
        return started

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        """Stop the nodes: SIGTERM first (Ray drains an idle node and unregisters it from the GCS at
        once), then the whole process group is killed after ``stop_timeout_s`` at the latest."""
        for provided in nodes:
            entry = self._nodes.pop(provided.instance_id, None)
            if entry is None:
                continue
            await asyncio.to_thread(self._stop, entry[1])
            async with self._lock:
                self._budget[provided.capacity] = self._budget.get(provided.capacity, 0) + 1

    def _stop(self, node: LocalRayNode) -> None:
        self._cluster.sigterm_node(node)
        try:
            node.process.wait(timeout=self._stop_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._cluster.kill_node(node)

    async def nodes(self) -> list[ProvidedNode]:
        return [p for p, node in self._nodes.values() if node.running()]


class RayModeRequeuer:
    """:class:`~resilienced.requeue.result.Requeuer` for ray mode: replacement nodes from a provider.

    Args:
        provider: starts nodes per capacity pool.
        planner: decides again when a pool turns out to have no capacity (None: report ``wait``).
        instance_type: the pool's instance type when the target does not say (the local drill).
        max_attempts: decisions tried before giving up with ``wait`` (spot, block, on-demand).
    """

    kind = "ray"

    def __init__(self, provider: NodeProvider, *, planner: CapacityPlanner | None = None,
                 instance_type: str | None = None, max_attempts: int = 4) -> None:
        self.provider = provider
        self.planner = planner
        self._instance_type = instance_type
        self._max_attempts = max_attempts

    def _request(self, target: Target, event: Event) -> CapacityRequest | None:
        attrs: dict[str, Any] = dict(target.attributes)
        if not attrs.get("instance_type") and self._instance_type:
            attrs["instance_type"] = self._instance_type
        try:
            return CapacityRequest.from_target(replace(target, attributes=attrs), event=event)
        except ValueError:
            return None

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        request = self._request(target, event)
        lost = tuple(request.lost_instance_ids if request else
                     target.attributes.get("lost_instance_ids") or (target.instance_id,))
        replaced = {n.labels.get(REPLACES_LABEL): n for n in await self.provider.nodes()}
        missing = [i for i in lost if i not in replaced]
        if not missing:
            capacities = sorted({replaced[i].capacity.value for i in lost})
            return RequeueResult(
                run_key=target.run_key, kind=self.kind, capacity=replaced[lost[0]].capacity,
                reason=f"already replaced: {', '.join(lost)} -> {', '.join(capacities)} nodes",
                dry_run=dry_run, decision=decision)
        if dry_run:
            if not decision.places:
                return waiting(target, kind=self.kind, decision=decision, dry_run=True)
            return RequeueResult(
                run_key=target.run_key, kind=self.kind, capacity=decision.capacity,
                reservation_id=decision.reservation_id, dry_run=True, decision=decision,
                reason="plan only",
                changes=(f"would launch {len(missing)} {decision.capacity.value} node(s) replacing "
                         f"{', '.join(missing)}",))

        elastic = target.attributes.get(ATTR_ELASTIC) is True
        tried: list[str] = []
        kept: list[ProvidedNode] = []  # elastic: what a pool gave, kept even when short
        current = decision
        for _ in range(self._max_attempts):
            if not current.places:
                break
            extra = {ELASTIC_LABEL: "true"} if elastic else {}
            labels = [{REPLACES_LABEL: i, **extra} for i in missing]
            asked = len(missing)
            try:
                got = await self.provider.launch(capacity=current.capacity, node_labels=labels,
                                                 reservation_id=current.reservation_id)
            except NoCapacity:
                got = []
            if len(got) == len(missing):
                return self._launched(target, current, [*kept, *got], tried, elastic=elastic)
            if got and elastic:  # the run grows by what there is; the rest is asked for again
                kept += got
                missing = [i for i in missing if i not in {n.labels.get(REPLACES_LABEL) for n in got}]
            elif got:  # a partial gang is never left waiting: give back what was got
                await self.provider.release(got)
            tried.append(f"{current.capacity.value} gave {len(got)} of {asked}")
            if self.planner is None or request is None:
                current = CapacityDecision(Capacity.WAIT, "no planner to decide again", retry_after=None)
                break
            self.planner.mark_unavailable(request.pool, current.reservation_id or current.capacity)
            current = await self.planner.plan(replace(request, instance_count=len(missing)))
        reason = f"{'; '.join(tried)}; {current.reason}"
        details: dict[str, Any] = {"tried": tried}
        if elastic:
            reason += (f"; the run goes on at the smaller size, nothing stopped (still short of "
                       f"{', '.join(missing)})")
            details.update(elastic=True, nodes=[n.instance_id for n in kept], missing=list(missing))
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=Capacity.WAIT, reason=reason, decision=current,
            retry_after=current.retry_after or (self.planner.policy.wait_retry if self.planner else None),
            changes=tuple(_launch_change(kept)), details=details)

    def _launched(self, target: Target, current: CapacityDecision, nodes: list[ProvidedNode], tried: list[str],
                  *, elastic: bool) -> RequeueResult:
        reason = f"launched {len(nodes)} {current.capacity.value} node(s): {current.reason}"
        if tried:
            reason = f"{'; '.join(tried)}; then {reason}"
        details: dict[str, Any] = {"tried": tried, "nodes": [n.instance_id for n in nodes]}
        if elastic:
            reason += "; elastic: the other workers kept training"
            details["elastic"] = True
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=current.capacity, reason=reason,
            reservation_id=current.reservation_id, decision=current, changes=tuple(_launch_change(nodes)),
            details=details)


def _launch_change(nodes: Sequence[ProvidedNode]) -> list[str]:
    """One line per capacity: ``launched <capacity> nodes <id> (replaces <lost id>), ...``."""
    out = []
    for capacity in dict.fromkeys(n.capacity for n in nodes):
        ids = ", ".join(f"{n.instance_id} (replaces {n.labels.get(REPLACES_LABEL)})"
                        for n in nodes if n.capacity is capacity)
        out.append(f"launched {capacity.value} nodes {ids}")
    return out

