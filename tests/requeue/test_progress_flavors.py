"""The follow-up's ``admitted`` rule on the flavors Kueue assigned a worker PodSet (``flavors_on``).

Kueue assigns one flavor per resource, from each resource group of the ClusterQueue
(v0.17.0 ``flavorassigner.go``): with deploy/examples/kueue.yaml's queue a GPU worker gets cpu and
memory from a flavor without node labels and GPUs from the capacity's flavor.  Found on the real
Kueue (tests/cluster/test_daemon.py): the rule asked every flavor to match, so such a run never
reached ``admitted``.
"""

from __future__ import annotations

import pytest

from resilienced.model import Capacity, CapacityDecision
from resilienced.requeue.placement import Placement
from resilienced.kube.progress import flavors_on

pytestmark = pytest.mark.unit

BLOCK = Placement.for_decision(CapacityDecision(Capacity.CAPACITY_BLOCK, "t", reservation_id="cr-1"))
BLOCK_LABELS = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}


def test_a_flavor_of_no_node_labels_beside_the_capacitys_flavor_is_on_the_capacity() -> None:
    assert flavors_on({"default": {}, "block": BLOCK_LABELS}, BLOCK) is None


def test_a_flavor_that_sets_a_placement_key_to_another_value_contradicts_it() -> None:
    found = flavors_on({"default": {}, "spot": {"karpenter.sh/capacity-type": "spot"}}, BLOCK)
    assert found is not None and "spot (karpenter.sh/capacity-type=spot)" in found


def test_flavors_that_name_no_capacity_at_all_are_not_on_it() -> None:
    assert flavors_on({"default": {}}, BLOCK) == "default (no node labels)"
    assert flavors_on({}, BLOCK) == "none named"


def test_a_flavor_that_is_gone_is_not_taken_for_the_capacity() -> None:
    assert flavors_on({"default": {}, "block": BLOCK_LABELS, "old": None}, BLOCK) == "old (not found)"
