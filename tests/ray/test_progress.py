"""Ray mode's look at a requeued run (``RayProgress``) and the withdrawal of a replacement that never
joined (``RayModeRequeuer.withdraw``), on in-process stand-ins of the GCS and the node provider."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from resilienced.model import Capacity
from resilienced.model import RunFacts, Target
from resilienced.ports import ProvidedNode, RayNode
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, RESERVATION_LABEL
from resilienced.ray.progress import RayProgress
from resilienced.ray.requeue import REPLACES_LABEL, RayModeRequeuer

pytestmark = pytest.mark.unit

LOST = "i-0aaa0000000000001"
TARGET = Target(instance_id=LOST, node="10.0.0.1", ray_cluster=None, ray_job=None, ray_node_ids=(),
                checkpoint_uri=None, ray_address="10.0.0.9:6379", facts=RunFacts(lost_instance_ids=(LOST,)))


class Nodes:
    def __init__(self, nodes: list[RayNode]) -> None:
        self.list = nodes

    async def nodes(self) -> list[RayNode]:
        return self.list


def ray_node(n: int, labels: Mapping[str, str], *, alive: bool = True) -> RayNode:
    return RayNode(node_id=f"{n:02x}" * 28, address=f"10.0.0.{n}", labels=dict(labels), alive=alive)


BLOCK = {REPLACES_LABEL: LOST, CAPACITY_TYPE_LABEL: "capacity-block", RESERVATION_LABEL: "cr-1"}


@pytest.mark.parametrize("nodes, joined", [
    ([], False),
    ([ray_node(2, {**BLOCK, REPLACES_LABEL: "i-other"})], False),  # replaces another instance
    ([ray_node(2, {**BLOCK, CAPACITY_TYPE_LABEL: "on-demand"})], False),  # not the decided capacity
    ([ray_node(2, {**BLOCK, RESERVATION_LABEL: "cr-2"})], False),  # another block
    ([ray_node(2, BLOCK, alive=False)], False),  # joined and gone
    ([ray_node(2, BLOCK)], True),
], ids=["nothing", "another instance", "other capacity", "other block", "dead", "joined"])
async def test_joined_means_an_alive_replacement_with_the_decided_labels(nodes: list[RayNode], joined: bool) -> None:
    seen = await RayProgress(Nodes(nodes)).placed(TARGET, capacity=Capacity.CAPACITY_BLOCK, reservation_id="cr-1")
    assert seen.reached is joined
    if not joined:
        assert LOST in seen.detail and "cr-1" in seen.detail


class Provider:
    def __init__(self, nodes: list[ProvidedNode]) -> None:
        self.up = nodes
        self.released: list[str] = []

    async def nodes(self) -> list[ProvidedNode]:
        return list(self.up)

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        self.released += [n.instance_id for n in nodes]
        self.up = [n for n in self.up if n not in nodes]


async def test_withdraw_gives_back_only_the_stalled_capacity_replacing_the_lost_instance() -> None:
    provider = Provider([ProvidedNode("i-b1", Capacity.CAPACITY_BLOCK, {REPLACES_LABEL: LOST, RESERVATION_LABEL: "cr-1"}),
                         ProvidedNode("i-d1", Capacity.ON_DEMAND, {REPLACES_LABEL: LOST}),
                         ProvidedNode("i-b2", Capacity.CAPACITY_BLOCK, {REPLACES_LABEL: "i-other"})])
    requeuer = RayModeRequeuer(provider)  # type: ignore[arg-type]
    said = await requeuer.withdraw(TARGET, capacity=Capacity.CAPACITY_BLOCK, reservation_id="cr-1")
    assert provider.released == ["i-b1"] and len(said) == 1 and "i-b1" in said[0]
    assert await requeuer.withdraw(TARGET, capacity=Capacity.CAPACITY_BLOCK, reservation_id="cr-1") == []
