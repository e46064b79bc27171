"""Pure rules for the Capacity Blocks Karpenter can launch a run into, read from its objects.

Karpenter (aws/karpenter-provider-aws v1.6+) launches into a Capacity Reservation only when the
EC2NodeClass of the NodePool it provisions for selects it: ``spec.capacityReservationSelectorTerms``
is resolved (pkg/providers/capacityreservation) into ``status.capacityReservations[]``, each
``{id, instanceType, availabilityZone, ownerID, instanceMatchCriteria, reservationType
(default|capacity-block), state (active|expiring), endTime}`` (pkg/apis/v1/ec2nodeclass_status.go,
read at 04101f6; ``expiring``: inside the 40 min before a block's end, when Karpenter drains it).
A NodePool names its EC2NodeClass in ``spec.template.spec.nodeClassRef`` ``{group:
karpenter.k8s.aws, kind: EC2NodeClass, name}``, and a Node its NodePool in the label
``karpenter.sh/nodepool`` (kubernetes-sigs/karpenter pkg/apis/v1/nodepool.go, labels.go).

A reserved offering carries the requirement ``karpenter.sh/capacity-type In [reserved]``
(aws/karpenter-provider-aws v1.14.1, same from v1.6.0,
``pkg/providers/instancetype/offering/reserved_capacity_resolver.go`` ``ResolveOfferings``), and
Karpenter launches an offering only for a NodePool whose requirements are compatible with it: a
NodePool that allows only ``spot`` cannot launch into a block even when its EC2NodeClass lists it.

The NodePools able to serve the run: the NodePool of the lost node when its own requirements admit
``karpenter.sh/capacity-type=reserved`` and the run's instance type (an absent requirement admits
anything, as in Karpenter's scheduling requirements), and every other NodePool whose
``spec.template.spec.requirements`` admit ``karpenter.sh/capacity-type=reserved`` explicitly
(``In`` with ``reserved``, or ``Exists``) and the run's instance type (no requirement on
``node.kubernetes.io/instance-type``, or one it satisfies).  The reservations usable for the run
are the ``active`` entries of their EC2NodeClasses' ``status.capacityReservations``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from resilienced.kube.locate import labels, name_of
from resilienced.model import JsonValue

NODEPOOL_LABEL = "karpenter.sh/nodepool"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
RESERVED = "reserved"
NODECLASS_GROUP = "karpenter.k8s.aws"
NODECLASS_KIND = "EC2NodeClass"
ACTIVE = "active"  # the CRD default of status.capacityReservations[].state


def requirements_of(nodepool: Mapping[str, JsonValue]) -> Sequence[Mapping[str, JsonValue]]:
    spec = ((nodepool.get("spec") or {}).get("template") or {}).get("spec") or {}
    return spec.get("requirements") or []


def admits(requirements: Sequence[Mapping[str, JsonValue]], key: str, value: str, *, explicit: bool = False) -> bool:
    """Whether NodeSelectorRequirements allow ``key=value`` (``explicit``: an absent key does not)."""
    found = False
    for requirement in requirements:
        if requirement.get("key") != key:
            continue
        found = True
        operator, values = requirement.get("operator"), [str(v) for v in requirement.get("values") or []]
        if operator == "In" and value not in values:
            return False
        if operator == "NotIn" and value in values:
            return False
        if operator == "DoesNotExist":
            return False
    return found or not explicit


def node_class_name(nodepool: Mapping[str, JsonValue]) -> str | None:
    """The EC2NodeClass a NodePool references (None: another provider's class, or none)."""
    spec = ((nodepool.get("spec") or {}).get("template") or {}).get("spec") or {}
    ref = spec.get("nodeClassRef") or {}
    if ref.get("kind") != NODECLASS_KIND or ref.get("group", NODECLASS_GROUP) != NODECLASS_GROUP:
        return None
    return ref.get("name") or None


def active_reservations(nodeclass: Mapping[str, JsonValue]) -> list[str]:
    """The ids of ``status.capacityReservations`` Karpenter launches into (state ``active``)."""
    return [str(r["id"]) for r in (nodeclass.get("status") or {}).get("capacityReservations") or []
            if r.get("id") and (r.get("state") or ACTIVE) == ACTIVE]


def selectable_reservations(
    *,
    node: Mapping[str, JsonValue],
    nodepools: Iterable[Mapping[str, JsonValue]],
    nodeclass: Callable[[str], Mapping[str, JsonValue] | None],
    instance_type: str | None,
) -> tuple[list[str], list[str]]:
    """(reservation ids, ``"nodepool/ec2nodeclass"`` sources) Karpenter can launch the run into."""
    own = labels(node).get(NODEPOOL_LABEL)
    ids: set[str] = set()
    sources: list[str] = []
    for pool in sorted(nodepools, key=name_of):
        requirements = requirements_of(pool)
        # The lost node's own NodePool: its requirements as they are (absent: any capacity type);
        # another NodePool must ask for reserved capacity to be counted.
        serves = admits(requirements, CAPACITY_TYPE_LABEL, RESERVED, explicit=name_of(pool) != own) and (
            instance_type is None or admits(requirements, INSTANCE_TYPE_LABEL, instance_type))
        if not serves:
            continue
        class_name = node_class_name(pool)
        found = nodeclass(class_name) if class_name else None
        if found is None:
            continue
        ids.update(active_reservations(found))
        sources.append(f"{name_of(pool)}/{class_name}")
    return sorted(ids), sources
