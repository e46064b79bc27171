"""The local node provider of the drill and the tests.

:class:`LocalNodeProvider` implements :class:`~resilienced.ports.NodeProvider`: it starts
real Ray nodes on a :class:`~resilienced.local.raycluster.LocalRayCluster`, labelled with the capacity type and a
made-up instance id, from a per-capacity budget (``{"spot": 0, "capacity-block": 2}``: the
drill's ``--spot-capacity 0``).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Mapping, Sequence

from resilienced.model import Capacity
from resilienced.local.raycluster import LocalRayCluster, LocalRayNode
from resilienced.ports import NoCapacity, ProvidedNode
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL, RESERVATION_LABEL


def made_up_instance_id() -> str:
    """An id of EC2's form (``i-`` and 17 hex digits) that no real instance has."""
    return "i-0" + secrets.token_hex(8)


class LocalNodeProvider:
    """A :class:`NodeProvider` that starts Ray nodes on a local cluster, from a per-capacity budget.

    Args:
        cluster: a started :class:`~resilienced.local.raycluster.LocalRayCluster`.
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
                     reservation_id: str | None = None, idempotency_key: str | None = None,
                     ) -> list[ProvidedNode]:
        """Start the nodes now (``idempotency_key`` unused: a second requeue finds them by
        :meth:`nodes`, as the requeuer looks first)."""
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
