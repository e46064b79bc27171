"""Where pods may run, for a capacity decision: node selector, node affinity and tolerations.

Pure functions on pod-spec JSON (``template.spec`` of a worker group, a Volcano task, a Kueue
PodSet), shared by the Kueue, KubeRay and Volcano requeuers.

The labels depend on who manages the run's Nodes (``RunFacts.node_shape``, docs/requeue.md "Node
shapes").  Karpenter's well-known labels (aws/karpenter-provider-aws,
``website/content/en/docs/concepts/scheduling.md``), for Karpenter's nodes and nodes of neither
shape::

    decision         nodeSelector
    spot             karpenter.sh/capacity-type: spot
    capacity-block   karpenter.sh/capacity-type: reserved
                     karpenter.k8s.aws/capacity-reservation-id: <cr-...>
                     karpenter.k8s.aws/capacity-reservation-type: capacity-block
    on-demand        karpenter.sh/capacity-type: on-demand

An EKS managed node group's label, for its nodes (the cluster autoscaler scales the group whose
nodes fit a pending pod; a node group does not label the reservation id, so a block decision
asks for any Capacity Block group)::

    spot             eks.amazonaws.com/capacityType: SPOT
    capacity-block   eks.amazonaws.com/capacityType: CAPACITY_BLOCK
    on-demand        eks.amazonaws.com/capacityType: ON_DEMAND

Applying a placement replaces whatever resilienced manages and leaves the rest alone: the
managed keys (the three Karpenter keys, including ``capacity-reservation-type``, and EKS's
``eks.amazonaws.com/capacityType``) are removed
from the node selector, from required and preferred node-affinity terms (a term left empty is
dropped: an empty term would match nothing), and managed tolerations are replaced.  So moving
off a block removes its reservation-id selector, and a template's own ``In [spot, on-demand]``
affinity cannot contradict the new selector.

Tolerations: NodePools are often tainted per capacity type so that only willing pods land
there.  By default a placement tolerates ``karpenter.sh/capacity-type=<value>:NoSchedule``
(harmless where no such taint exists); pass your own per-capacity tolerations otherwise.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resilienced.kube.locate import EKS_CAPACITY_LABEL, capacity_selector
from resilienced.model import Capacity, CapacityDecision, JsonValue

CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
RESERVATION_ID_LABEL = "karpenter.k8s.aws/capacity-reservation-id"
RESERVATION_TYPE_LABEL = "karpenter.k8s.aws/capacity-reservation-type"
MANAGED_KEYS = frozenset({CAPACITY_TYPE_LABEL, RESERVATION_ID_LABEL, RESERVATION_TYPE_LABEL, EKS_CAPACITY_LABEL})

#: Karpenter's value of ``karpenter.sh/capacity-type`` for each placing decision.
KARPENTER_CAPACITY = {
    Capacity.SPOT: "spot",
    Capacity.CAPACITY_BLOCK: "reserved",
    Capacity.ON_DEMAND: "on-demand",
}


def _default_tolerations() -> dict[Capacity, tuple[dict[str, str], ...]]:
    return {
        capacity: ({"key": CAPACITY_TYPE_LABEL, "operator": "Equal", "value": value, "effect": "NoSchedule"},)
        for capacity, value in KARPENTER_CAPACITY.items()
    }


DEFAULT_TOLERATIONS: Mapping[Capacity, tuple[Mapping[str, str], ...]] = _default_tolerations()


@dataclass(frozen=True)
class Placement:
    """The node selector and tolerations that put pods on one capacity."""

    capacity: Capacity
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, str], ...]
    managed_toleration_keys: frozenset[str]

    @classmethod
    def for_decision(
        cls,
        decision: CapacityDecision,
        *,
        tolerations: Mapping[Capacity, Sequence[Mapping[str, str]]] = DEFAULT_TOLERATIONS,
        shape: str | None = None,
    ) -> Placement:
        """The placement of a decision that places the run (not ``wait``), in the labels of the
        run's node shape (``RunFacts.node_shape``: EKS managed node groups have their own)."""
        if not decision.places:
            raise ValueError("a wait decision has no placement")
        if decision.capacity is Capacity.CAPACITY_BLOCK and not decision.reservation_id:
            raise ValueError("a capacity-block placement needs the reservation id (buy the block first)")
        selector = capacity_selector(decision.capacity.value, reservation_id=decision.reservation_id, shape=shape)
        managed = set(MANAGED_KEYS)
        for items in tolerations.values():
            managed.update(t.get("key", "") for t in items)
        return cls(
            capacity=decision.capacity,
            node_selector=selector,
            tolerations=tuple(dict(t) for t in tolerations.get(decision.capacity, ())),
            managed_toleration_keys=frozenset(managed - {""}),
        )

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.node_selector.items()))

    # ------------------------------------------------------------------ pod specs
    def applied(self, pod_spec: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
        """A copy of ``pod_spec`` with this placement (the input is not changed)."""
        spec = copy.deepcopy(dict(pod_spec))
        selector = {k: v for k, v in (spec.get("nodeSelector") or {}).items() if k not in MANAGED_KEYS}
        selector.update(self.node_selector)
        spec["nodeSelector"] = selector
        _scrub_affinity(spec)
        kept = [t for t in spec.get("tolerations") or [] if t.get("key") not in self.managed_toleration_keys]
        spec["tolerations"] = kept + [dict(t) for t in self.tolerations]
        if not spec["tolerations"]:
            del spec["tolerations"]
        return spec

    def matches(self, pod_spec: Mapping[str, JsonValue]) -> bool:
        """Whether ``pod_spec`` already asks for exactly this placement (applying changes nothing)."""
        return _normal(self.applied(pod_spec)) == _normal(pod_spec)

    def selector_matches(self, pod_spec: Mapping[str, JsonValue]) -> bool:
        """Whether the pod's node selector has this placement's managed keys and no other managed key."""
        selector = pod_spec.get("nodeSelector") or {}
        return {k: v for k, v in selector.items() if k in MANAGED_KEYS} == dict(self.node_selector)

    def node_matches(self, node_labels: Mapping[str, str] | None) -> bool:
        """Whether a Node with these labels is on this placement's capacity (and block)."""
        labels = node_labels or {}
        return all(labels.get(k) == v for k, v in self.node_selector.items())


def _scrub_affinity(spec: dict[str, JsonValue]) -> None:
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity")
    if not node_affinity:
        return
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required:
        terms = []
        for term in required.get("nodeSelectorTerms") or []:
            exprs = [e for e in term.get("matchExpressions") or [] if e.get("key") not in MANAGED_KEYS]
            fields = term.get("matchFields") or []
            if exprs or fields:
                new_term = dict(term)
                if exprs:
                    new_term["matchExpressions"] = exprs
                else:
                    new_term.pop("matchExpressions", None)
                terms.append(new_term)
        if terms:
            required["nodeSelectorTerms"] = terms
        else:
            del node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    preferred = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution")
    if preferred:
        kept = []
        for item in preferred:
            pref = item.get("preference") or {}
            exprs = [e for e in pref.get("matchExpressions") or [] if e.get("key") not in MANAGED_KEYS]
            if exprs or pref.get("matchFields"):
                kept.append({**item, "preference": {**pref, "matchExpressions": exprs} if exprs
                             else {k: v for k, v in pref.items() if k != "matchExpressions"}})
        if kept:
            node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = kept
        else:
            del node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    if not node_affinity:
        del spec["affinity"]["nodeAffinity"]
        if not spec["affinity"]:
            del spec["affinity"]


def _normal(spec: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
    """A comparable form: empty selector/tolerations/affinity count as absent."""
    out = {k: v for k, v in spec.items() if v not in (None, {}, [])}
    if "tolerations" in out:
        out["tolerations"] = sorted(out["tolerations"], key=lambda t: json.dumps(t, sort_keys=True))
    return out
