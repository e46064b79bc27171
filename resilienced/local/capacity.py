"""A :class:`~resilienced.ports.CapacitySource` from a fixed list: the local drill's "EC2".

The local drill has no EC2; it declares the Capacity Blocks its local provider can start nodes
for (e.g. one block of 2 instances) and hands them to the planner through this source.  It
implements only the port (no buying), filtering as :class:`~resilienced.capacity.ec2.Ec2Capacity`
does: active ``capacity-block`` reservations, optionally of one instance type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from resilienced.capacity.decision import ACTIVE, CAPACITY_BLOCK_TYPE
from resilienced.ports import CapacityReservation


class StaticCapacity:
    """Reservations held in memory; ``set_available`` mirrors a block filling up."""

    def __init__(self, reservations: Sequence[CapacityReservation] = (),
                 instances: Mapping[str, Sequence[str]] | None = None) -> None:
        self._reservations = {r.reservation_id: r for r in reservations}
        self._instances = {k: list(v) for k, v in (instances or {}).items()}

    async def reservations(self, *, instance_type: str | None = None) -> list[CapacityReservation]:
        return [r for r in self._reservations.values()
                if r.reservation_type == CAPACITY_BLOCK_TYPE and r.state == ACTIVE
                and (instance_type is None or r.instance_type == instance_type)]

    async def reservation_instances(self, *, reservation_id: str) -> list[str]:
        return list(self._instances.get(reservation_id, ()))

    def set_available(self, reservation_id: str, available: int) -> None:
        self._reservations[reservation_id] = replace(self._reservations[reservation_id],
                                                     available_instances=available)
