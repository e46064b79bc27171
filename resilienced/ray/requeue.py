"""Ray mode: requeue a run on a Ray cluster without Kubernetes by adding replacement nodes.

In ray mode the capacity type is a node label (``resilienced.io/capacity-type``: ``spot`` |
``capacity-block`` | ``on-demand``).  Requeueing asks the cluster's
:class:`~resilienced.ports.NodeProvider` for as many replacement nodes as the run lost, from the
decided pool; Ray Train then restarts the worker group on them and resumes from the newest
complete checkpoint.

All or nothing: when the provider has no capacity there (:class:`NoCapacity`) or gives fewer
nodes than needed, the requeuer releases what it got, marks the pool unavailable in the planner's
ICE cache, and decides again (so Spot with no room becomes a Capacity Block, then On-Demand);
when nothing is left the result is ``wait`` and nothing is held.

Idempotent: every replacement node carries ``resilienced.io/replaces=<lost instance id>``; a
second application finds the replacements alive and launches nothing.

The local drill's provider (real Ray nodes on this machine) is
:class:`resilienced.local.provider.LocalNodeProvider`.  A provider for EC2 would launch instances
(RunInstances / CreateFleet with ``MarketType`` ``spot`` or ``capacity-block`` and the reservation
id) whose ``ray start`` joins with the same labels; it is not part of this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.request import CapacityRequest
from resilienced.errors import TemporaryError
from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.ports import NodeProvider, ProvidedNode
from resilienced.ray.cluster import ELASTIC_LABEL, RESERVATION_LABEL

REPLACES_LABEL = "resilienced.io/replaces"


class NoCapacity(TemporaryError):
    """The provider has no capacity in the asked pool right now (an insufficient-capacity error)."""

    def __init__(self, capacity: Capacity, message: str = "") -> None:
        super().__init__(f"no {capacity.value} capacity{': ' + message if message else ''}", delay=60.0)
        self.capacity = capacity


class RayModeRequeuer:
    """:class:`~resilienced.ports.Requeuer` for ray mode: replacement nodes from a provider.

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
        if not target.facts.instance_type and self._instance_type:
            target = replace(target, facts=replace(target.facts, instance_type=self._instance_type))
        try:
            return CapacityRequest.from_target(target, event=event)
        except ValueError:
            return None

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        request = self._request(target, event)
        lost = tuple(request.lost_instance_ids if request else
                     target.facts.lost_instance_ids or (target.instance_id,))
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
                return RequeueResult.waiting(target, kind=self.kind, decision=decision, dry_run=True)
            return RequeueResult(
                run_key=target.run_key, kind=self.kind, capacity=decision.capacity,
                reservation_id=decision.reservation_id, dry_run=True, decision=decision,
                reason="plan only",
                changes=(f"would launch {len(missing)} {decision.capacity.value} node(s) replacing "
                         f"{', '.join(missing)}",))

        elastic = target.facts.elastic is True
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
        details: dict[str, JsonValue] = {"tried": tried}
        if elastic:
            reason += (f"; the run goes on at the smaller size, nothing stopped (still short of "
                       f"{', '.join(missing)})")
            details.update(elastic=True, nodes=[n.instance_id for n in kept], missing=list(missing))
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=Capacity.WAIT, reason=reason, decision=current,
            retry_after=current.retry_after or (self.planner.policy.wait_retry if self.planner else None),
            changes=tuple(_launch_change(kept)), details=details)

    async def withdraw(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> list[str]:
        """Give back the replacement nodes asked of ``capacity`` for the run's lost instances
        (``ports.Withdraws``): the follow-up does it when they never joined, before it moves the run
        elsewhere, so that a second ``requeue`` launches on the new capacity."""
        lost = set(target.facts.lost_instance_ids or (target.instance_id,))
        stalled = [n for n in await self.provider.nodes()
                   if n.labels.get(REPLACES_LABEL) in lost and n.capacity is Capacity(capacity)
                   and (reservation_id is None or n.labels.get(RESERVATION_LABEL, reservation_id) == reservation_id)]
        if stalled:
            await self.provider.release(stalled)
        return [f"released {n.capacity.value} node {n.instance_id} (replaced {n.labels.get(REPLACES_LABEL)})"
                for n in stalled]

    def _launched(self, target: Target, current: CapacityDecision, nodes: list[ProvidedNode], tried: list[str],
                  *, elastic: bool) -> RequeueResult:
        reason = f"launched {len(nodes)} {current.capacity.value} node(s): {current.reason}"
        if tried:
            reason = f"{'; '.join(tried)}; then {reason}"
        details: dict[str, JsonValue] = {"tried": tried, "nodes": [n.instance_id for n in nodes]}
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

