"""Which Capacity Blocks Karpenter can launch a run into, from NodePools and EC2NodeClasses (a table).

Shapes as aws/karpenter-provider-aws v1.6+ serves them (pkg/apis/v1/ec2nodeclass_status.go;
kubernetes-sigs/karpenter pkg/apis/v1/nodepool.go).
"""

from __future__ import annotations

from typing import Any

import pytest

from resilienced.kube.karpenter import selectable_reservations

pytestmark = pytest.mark.unit


def pool(name: str, nodeclass: str, *requirements: dict[str, Any], kind: str = "EC2NodeClass") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"template": {"spec": {
        "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": kind, "name": nodeclass},
        "requirements": list(requirements)}}}}


def req(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


RESERVED = req("karpenter.sh/capacity-type", "In", "reserved")
NODECLASSES = {
    "a": {"status": {"capacityReservations": [{"id": "cr-a", "state": "active"}, {"id": "cr-old", "state": "expiring"}]}},
    "b": {"status": {"capacityReservations": [{"id": "cr-b"}]}},  # state defaults to active
    "c": {"status": {}},
}
NODE = {"metadata": {"name": "n1", "labels": {"karpenter.sh/nodepool": "own"}}}


@pytest.mark.parametrize("pools, ids, sources", [
    ([pool("own", "c"), pool("blocks", "a", RESERVED)], ["cr-a"], ["blocks/a", "own/c"]),
    ([pool("own", "b")], ["cr-b"], ["own/b"]),  # the lost node's own NodePool: no capacity-type requirement
    # The lost node's own NodePool counts only when its requirements let Karpenter launch reserved
    # capacity: a reserved offering requires karpenter.sh/capacity-type=reserved
    # (aws/karpenter-provider-aws v1.14.1 pkg/providers/instancetype/offering/reserved_capacity_resolver.go).
    ([pool("own", "b", req("karpenter.sh/capacity-type", "In", "spot"))], [], []),
    ([pool("own", "b", req("karpenter.sh/capacity-type", "NotIn", "reserved"))], [], []),
    ([pool("own", "b", req("karpenter.sh/capacity-type", "In", "spot", "reserved"))], ["cr-b"], ["own/b"]),
    ([pool("own", "b", RESERVED, req("node.kubernetes.io/instance-type", "In", "p4d.24xlarge"))], [], []),
    ([pool("spot", "a", req("karpenter.sh/capacity-type", "In", "spot"))], [], []),
    ([pool("any", "a")], [], []),  # no capacity-type requirement: not known to take reserved
    ([pool("exists", "a", req("karpenter.sh/capacity-type", "Exists"))], ["cr-a"], ["exists/a"]),
    ([pool("p4", "a", RESERVED, req("node.kubernetes.io/instance-type", "In", "p4d.24xlarge"))], [], []),
    ([pool("not-p4", "a", RESERVED, req("node.kubernetes.io/instance-type", "NotIn", "p4d.24xlarge"))],
     ["cr-a"], ["not-p4/a"]),
    ([pool("no-type", "a", RESERVED, req("node.kubernetes.io/instance-type", "DoesNotExist"))], [], []),
    ([pool("missing", "zzz", RESERVED)], [], []),  # an EC2NodeClass that is not there
    ([pool("other-provider", "a", RESERVED, kind="AKSNodeClass")], [], []),
], ids=["own-and-reserved", "own-only", "own-spot-only", "own-not-reserved", "own-spot-and-reserved",
        "own-other-instance-type", "spot-pool", "no-requirement", "exists", "other-instance-type",
        "notin-other-type", "doesnotexist", "missing-nodeclass", "not-an-ec2nodeclass"])
def test_selectable_reservations(pools: list[dict], ids: list[str], sources: list[str]) -> None:
    assert selectable_reservations(node=NODE, nodepools=pools, nodeclass=NODECLASSES.get,
                                   instance_type="p5.48xlarge") == (ids, sources)
