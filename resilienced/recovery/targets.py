"""From a plan to the runs it hits: resolve -> locate -> group, the one path of the daemon and ``replay``.

1. **resolve**: the plan's instances; for a Capacity Block expiry with none, the reservation's
   instances from EC2 (:meth:`CapacitySource.reservation_instances`);
2. **locate**: the Ray Train runs on those instances (:meth:`Cluster.locate`), one target per
   instance found, and why each other instance has none;
3. **group**: one target per run (:func:`group`): several instances of one run are one gang and
   are handled together.

:class:`~resilienced.recovery.responder.Recovery` acts on the runs and lets a failure of EC2 or of
the cluster fail the plan (retry later, or give up); ``replay`` passes ``record_failures=True``,
and what could not be resolved or located is then said in ``unresolved`` instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from resilienced.errors import PermanentError, ResilienceError
from resilienced.model import Plan, Target
from resilienced.ports import CapacitySource, Cluster


@dataclass(frozen=True)
class Targets:
    """What one plan hits: its instances, the targets located on them, one per run, and the misses."""

    instance_ids: list[str]
    located: list[Target]  # one per instance on a run, as the cluster found it
    runs: list[Target]  # one per run (gang): :func:`group` of ``located``
    unresolved: dict[str, str]  # instance id (or reservation id) -> why it has no run


async def resolve(plan: Plan, *, capacity: CapacitySource | None) -> list[str]:
    """The plan's instances; for a Capacity Block with none given, its instances from EC2."""
    instance_ids = list(plan.instance_ids)
    if plan.capacity_reservation_id and not instance_ids:
        if capacity is None:
            raise PermanentError(f"capacity block {plan.capacity_reservation_id}: no EC2 access "
                                 "configured to find its instances")
        instance_ids = await capacity.reservation_instances(
            reservation_id=plan.capacity_reservation_id)
    return instance_ids


async def find_targets(plan: Plan, *, cluster: Cluster, capacity: CapacitySource | None,
                       record_failures: bool = False) -> Targets:
    """Resolve, locate and group the runs of ``plan`` (see the module doc).

    ``record_failures``: an EC2 or cluster failure (or a bad reservation id) goes to
    ``unresolved`` instead of being raised: the reservation's id when its instances cannot be
    listed, every instance when locating fails.
    """
    unresolved: dict[str, str] = {}
    try:
        instance_ids = await resolve(plan, capacity=capacity)
    except (ResilienceError, ValueError) as e:
        if not record_failures:
            raise
        unresolved[str(plan.capacity_reservation_id)] = f"cannot list the reservation's instances: {e}"
        instance_ids = []
    try:
        location = await cluster.locate(instance_ids=instance_ids,
                                        capacity_reservation_id=plan.capacity_reservation_id)
    except ResilienceError as e:
        if not record_failures:
            raise
        unresolved.update({i: f"cannot locate: {e}" for i in instance_ids})
        return Targets(instance_ids=instance_ids, located=[], runs=[], unresolved=unresolved)
    unresolved.update(location.unresolved)
    located = list(location.targets)
    return Targets(instance_ids=instance_ids, located=located, runs=group(located),
                   unresolved=unresolved)


def group(targets: Sequence[Target]) -> list[Target]:
    """One target per run: several instances of one run are one gang (:func:`merged`), each
    instance once in the run's instances and lost instances."""
    runs: dict[str, list[Target]] = {}
    for target in targets:
        runs.setdefault(target.run_key, []).append(replace(target, facts=replace(
            target.facts, instance_ids=(target.instance_id,),
            lost_instance_ids=target.facts.lost_instance_ids or (target.instance_id,))))
    return [merged(first, rest) for first, *rest in runs.values()]


def merged(target: Target, others: Iterable[Target]) -> Target:
    """``target`` with the instances, lost instances and Ray nodes of ``others`` (the same run)."""
    instances = dict.fromkeys(target.facts.instance_ids or (target.instance_id,))
    lost = dict.fromkeys(target.facts.lost_instance_ids or (target.instance_id,))
    nodes = dict.fromkeys(target.ray_node_ids)
    added = False
    for other in others:
        added = True
        instances.update(dict.fromkeys(other.facts.instance_ids or (other.instance_id,)))
        lost.update(dict.fromkeys(other.facts.lost_instance_ids or (other.instance_id,)))
        nodes.update(dict.fromkeys(other.ray_node_ids))
    if not added:
        return target
    return replace(target, ray_node_ids=tuple(nodes), facts=replace(
        target.facts, instance_ids=tuple(instances), lost_instance_ids=tuple(lost)))
