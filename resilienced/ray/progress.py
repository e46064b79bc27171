"""Ray mode: has the replacement joined?  (``ports.Progress`` on the Ray cluster's GCS.)

A requeue in ray mode asks the node provider for one node per lost instance, labelled
``resilienced.io/replaces=<lost instance id>`` and with the decided capacity's labels
(``resilienced.io/capacity-type``, and ``resilienced.io/capacity-reservation-id`` for a block;
``resilienced.ray.requeue``).  The ``joined`` stage is reached when, for every lost instance, an
alive Ray node carries those labels.  A provider that accepted the launch but whose node never
joins (a block whose instance never boots) shows as a node listed by the provider and absent
from the GCS: the evidence says which.  There is no Kueue in ray mode: ``admitted`` holds.
"""

from __future__ import annotations

from datetime import datetime

from resilienced.model import Capacity, JsonValue, StageSeen, Target
from resilienced.ports import RayControl
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, RESERVATION_LABEL
from resilienced.ray.requeue import REPLACES_LABEL


class RayProgress:
    """``ports.Progress`` for ray mode, on the cluster's ``RayControl``."""

    def __init__(self, ray: RayControl) -> None:
        self.ray = ray

    async def admitted(self, target: Target, *, capacity: Capacity, reservation_id: str | None) -> StageSeen:
        return StageSeen(True, "ray mode: no admission step")

    async def placed(self, target: Target, *, capacity: Capacity, reservation_id: str | None,
                     since: datetime | None = None) -> StageSeen:
        lost = tuple(target.facts.lost_instance_ids or (target.instance_id,))
        joined: dict[str, str] = {}
        elsewhere: list[str] = []
        for node in await self.ray.nodes():
            replaced = node.labels.get(REPLACES_LABEL)
            if not node.alive or replaced not in lost:
                continue
            labels = node.labels
            if labels.get(CAPACITY_TYPE_LABEL) == capacity.value and (
                    capacity is not Capacity.CAPACITY_BLOCK or labels.get(RESERVATION_LABEL) == reservation_id):
                joined[replaced] = node.node_id
            else:
                elsewhere.append(f"{node.node_id[:12]} replaces {replaced} on {labels.get(CAPACITY_TYPE_LABEL)}")
        where = capacity.value + (f" {reservation_id}" if reservation_id else "")
        missing = [i for i in lost if i not in joined]
        if not missing:
            return StageSeen(True, f"replacement node(s) joined on {where}: "
                                   + ", ".join(f"{i} -> {n[:12]}" for i, n in joined.items()),
                             facts={"nodes": list[JsonValue](sorted(joined.values()))})
        detail = f"no Ray node replacing {', '.join(missing)} has joined with {where}'s labels"
        if elsewhere:
            detail += f" (alive elsewhere: {'; '.join(elsewhere)})"
        return StageSeen(False, detail, facts={"missing": list[JsonValue](missing)})
