"""Decision -> node selector, node affinity and tolerations of a pod template (pure)."""

from __future__ import annotations

import copy

import pytest

from resilienced.model import Capacity, CapacityDecision
from resilienced.requeue.placement import Placement

pytestmark = pytest.mark.unit

BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "r", reservation_id="cr-0block")
SPOT = CapacityDecision(Capacity.SPOT, "r")
ON_DEMAND = CapacityDecision(Capacity.ON_DEMAND, "r")

ON_BLOCK = {
    "nodeSelector": {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-old",
                     "karpenter.k8s.aws/capacity-reservation-type": "capacity-block", "gpu": "h100"},
    "tolerations": [{"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": "reserved", "effect": "NoSchedule"},
                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["reserved"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [
                {"key": "karpenter.k8s.aws/capacity-reservation-id", "operator": "In", "values": ["cr-old"]}]}}]},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
}


@pytest.mark.parametrize(
    ("decision", "selector"),
    [
        (SPOT, {"karpenter.sh/capacity-type": "spot", "gpu": "h100"}),
        (ON_DEMAND, {"karpenter.sh/capacity-type": "on-demand", "gpu": "h100"}),
        (BLOCK, {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
                 "karpenter.k8s.aws/capacity-reservation-type": "capacity-block", "gpu": "h100"}),
    ],
    ids=["block -> spot", "block -> on-demand", "old block -> new block"],
)
def test_placement_replaces_only_what_it_manages(decision: CapacityDecision, selector: dict) -> None:
    before = copy.deepcopy(ON_BLOCK)
    spec = Placement.for_decision(decision).applied(ON_BLOCK)
    assert ON_BLOCK == before  # the input is not changed
    assert spec["nodeSelector"] == selector
    # A required term made only of capacity keys is dropped (an empty term would match nothing);
    # the preferred term likewise; unrelated affinity stays.
    assert "nodeAffinity" not in spec["affinity"] and "podAntiAffinity" in spec["affinity"]
    value = {"spot": "spot", "on-demand": "on-demand", "capacity-block": "reserved"}[decision.capacity.value]
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": value, "effect": "NoSchedule"}]


def test_matching_and_idempotence() -> None:
    placement = Placement.for_decision(BLOCK)
    spec = placement.applied(ON_BLOCK)
    assert placement.matches(spec) and not placement.matches(ON_BLOCK)
    assert placement.applied(spec) == spec
    assert placement.selector_matches({"nodeSelector": {
        "karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
        "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}})
    assert not placement.selector_matches({"nodeSelector": {"karpenter.sh/capacity-type": "reserved"}})
    assert placement.node_matches({"karpenter.sh/capacity-type": "reserved",
                                   "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
                                   "karpenter.k8s.aws/capacity-reservation-type": "capacity-block", "x": "y"})
    assert not placement.node_matches({"karpenter.sh/capacity-type": "spot"})


def test_custom_tolerations_replace_the_default_ones() -> None:
    taints = {Capacity.SPOT: [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
              Capacity.ON_DEMAND: []}
    spec = Placement.for_decision(ON_DEMAND, tolerations=taints).applied(
        {"tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]})
    assert "tolerations" not in spec  # the spot toleration is managed: gone when leaving Spot


@pytest.mark.parametrize(
    ("decision", "message"),
    [(CapacityDecision(Capacity.WAIT, "r"), "wait decision has no placement"),
     (CapacityDecision(Capacity.CAPACITY_BLOCK, "r"), "needs the reservation id")],
    ids=["wait", "block without id"],
)
def test_decisions_without_a_placement(decision: CapacityDecision, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Placement.for_decision(decision)
