"""Ray mode: requeue a run on a Ray cluster without Kubernetes by adding replacement nodes.

In ray mode the capacity type is a node label (``resilienced.io/capacity-type``: ``spot`` |
``capacity-block`` | ``on-demand``).  Requeueing asks the cluster's
:class:`~resilienced.ports.NodeProvider` for as many replacement nodes as the run lost, from the
decided pool; Ray Train then restarts the worker group on them and resumes from the newest
complete checkpoint.

A pure applier: it launches the decided capacity or raises :class:`~resilienced.ports.NoCapacity`.
All or nothing: when the provider has no capacity there or gives fewer nodes than needed, a gang
gives back what it got (an elastic run keeps it: it grows by what there is) and the requeuer
raises ``NoCapacity``; :class:`resilienced.recovery.move.Mover` marks the pool out and decides
again (so Spot with no room becomes a Capacity Block, then On-Demand), as for every mode; when
nothing is left the decision is ``wait`` and nothing is held.

Idempotent: every replacement node carries ``resilienced.io/replaces=<lost instance id>``; a
second application finds the replacements alive and launches nothing.

The providers: on EC2, :class:`resilienced.aws.ec2nodes.Ec2NodeProvider` (RunInstances from a
launch template with ``MarketType`` ``spot`` or ``capacity-block`` and the reservation id; the
instance's user-data joins with the same labels, read from its tags; docs/ray.md "Ray on EC2");
the local drill's (real Ray nodes on this machine),
:class:`resilienced.local.provider.LocalNodeProvider`.  ``launch`` gets the event id as its
idempotency key (EC2: the instances' ``ClientToken``).
"""

from __future__ import annotations

from collections.abc import Sequence

from resilienced.model import Capacity, CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.ports import NoCapacity, NodeProvider, ProvidedNode
from resilienced.ray.cluster import ELASTIC_LABEL, RESERVATION_LABEL

REPLACES_LABEL = "resilienced.io/replaces"


class RayModeRequeuer:
    """:class:`~resilienced.ports.Requeuer` for ray mode: replacement nodes from a provider.

    Args:
        provider: starts nodes per capacity pool.
    """

    kind = "ray"

    def __init__(self, provider: NodeProvider) -> None:
        self.provider = provider

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        """Launch the decided capacity for the lost instances not replaced yet; raise
        :class:`~resilienced.ports.NoCapacity` when the pool gives fewer than that."""
        lost = tuple(target.facts.lost_instance_ids or (target.instance_id,))
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
        if not decision.places:
            return self._waiting(target, decision, replaced, lost, missing, elastic=elastic)
        extra = {ELASTIC_LABEL: "true"} if elastic else {}
        labels = [{REPLACES_LABEL: i, **extra} for i in missing]
        why, cause = "", ""
        try:
            got = await self.provider.launch(capacity=decision.capacity, node_labels=labels,
                                             reservation_id=decision.reservation_id, idempotency_key=event.event_id)
        except NoCapacity as e:  # its words (an EC2 quota named) go on with the one raised below
            got, why, cause = [], f": {e}", e.cause
        if len(got) == len(missing):
            return self._launched(target, decision, got, elastic=elastic)
        if got and not elastic:  # a partial gang is never left waiting: give back what was got
            await self.provider.release(got)
        raise NoCapacity(decision.capacity, f"the provider gave {len(got)} of {len(missing)}{why}", asked=len(missing),
                         given=len(got), kept=elastic and bool(got), changes=_launch_change(got) if elastic else (),
                         cause=cause)

    def _waiting(self, target: Target, decision: CapacityDecision, replaced: dict[str | None, ProvidedNode],
                 lost: Sequence[str], missing: Sequence[str], *, elastic: bool) -> RequeueResult:
        """No capacity decided: nothing launched (an elastic run goes on at the size it has)."""
        reason = decision.reason
        details: dict[str, JsonValue] = {"tried": []}
        if elastic:
            reason += (f"; the run goes on at the smaller size, nothing stopped (still short of "
                       f"{', '.join(missing)})")
            details.update(elastic=True, nodes=[replaced[i].instance_id for i in lost if i in replaced],
                           missing=list(missing))
        return RequeueResult(run_key=target.run_key, kind=self.kind, capacity=Capacity.WAIT, reason=reason,
                             decision=decision, retry_after=decision.retry_after, details=details)

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

    def _launched(self, target: Target, current: CapacityDecision, nodes: list[ProvidedNode], *,
                  elastic: bool) -> RequeueResult:
        reason = f"launched {len(nodes)} {current.capacity.value} node(s): {current.reason}"
        details: dict[str, JsonValue] = {"tried": [], "nodes": [n.instance_id for n in nodes]}
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

