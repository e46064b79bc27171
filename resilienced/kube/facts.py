"""What Karpenter's and Kueue's objects add to a run's facts, read from the cluster's caches.

The rules are pure and live beside their project (:mod:`resilienced.kube.karpenter`,
:mod:`resilienced.kube.kueue`); here they are fed from the caches of the resources the cluster
serves.  Where it serves none of them, or the run is not theirs, the facts come back as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from resilienced.capacity.request import capacity_of
from resilienced.kube.api import JsonObj
from resilienced.kube.cluster_caches import (
    CLUSTERQUEUES,
    EC2NODECLASSES,
    LOCALQUEUES,
    NODEPOOLS,
    RESOURCEFLAVORS,
    ClusterCaches,
)
from resilienced.kube.karpenter import selectable_reservations
from resilienced.kube.kueue import QueueCheck, closed_capacities, worker_needs
from resilienced.kube.locate import KUEUE_QUEUE_LABEL, capacity_selector, kueue_manages, labels, name_of, namespace_of
from resilienced.log import get as get_logger
from resilienced.model import CAPACITY_NAMES, Capacity, NodeShape, RunFacts

# the logger these lines had before KubeCluster was split (log lines are a contract)
log = get_logger("resilienced.kube.cluster")


def karpenter_facts(caches: ClusterCaches, node: JsonObj, facts: RunFacts) -> RunFacts:
    """Where the cluster serves EC2NodeClasses and Karpenter manages the run's Node (its
    ``karpenter.sh/nodepool`` label): the Capacity Blocks Karpenter can launch the run into
    (``selectable_reservations``) and the NodePool/EC2NodeClass pairs they come from.
    Nothing otherwise (no Karpenter, or the run's nodes are an EKS managed node group's or
    nobody's): the capacity decision then takes any block of the account."""
    nodeclasses = caches.cache_of(EC2NODECLASSES)
    if nodeclasses is None or facts.node_shape != NodeShape.KARPENTER.value:
        return facts
    pools = caches.cache_of(NODEPOOLS)
    ids, sources = selectable_reservations(
        node=node, nodepools=pools.values() if pools is not None else (),
        nodeclass=lambda name: nodeclasses.get(None, name), instance_type=facts.instance_type)
    return replace(facts, selectable_reservations=tuple(ids), selectable_from=tuple(sources))


def kueue_facts(caches: ClusterCaches, run_objects: Sequence[JsonObj], facts: RunFacts) -> RunFacts:
    """Where the cluster serves Kueue's queues and Kueue manages the run (not an elastic one):
    the capacities its ClusterQueue cannot admit it on now (``closed_capacity``, see
    ``resilienced.kube.kueue``).  Nothing otherwise: the follow-up after the requeue sees the rest."""
    localqueues, clusterqueues, flavors = (caches.cache_of(r) for r in (LOCALQUEUES, CLUSTERQUEUES, RESOURCEFLAVORS))
    owner = next((o for o in run_objects if kueue_manages(o)), None)
    if owner is None or facts.elastic or localqueues is None or clusterqueues is None or flavors is None:
        return facts
    queue = labels(owner)[KUEUE_QUEUE_LABEL]
    localqueue = localqueues.get(namespace_of(owner), queue)
    name = ((localqueue or {}).get("spec") or {}).get("clusterQueue")
    clusterqueue = clusterqueues.get(None, name) if name else None
    if clusterqueue is None:
        return facts
    spec = owner.get("spec") or {}
    groups = (spec.get("rayClusterSpec") or {}).get("workerGroupSpecs") if owner.get("kind") == "RayJob" \
        else spec.get("workerGroupSpecs")
    try:
        needs = worker_needs(groups or [])
        current = capacity_of(str(facts.capacity_type), facts.reservation_type) if facts.capacity_type else None
    except ValueError as e:
        log.warning("kueue quota not checked", run=f"{namespace_of(owner)}/{name_of(owner)}", error=str(e))
        return facts
    own = None if spec.get("suspend") or current in (None, Capacity.WAIT) else capacity_selector(
        current.value, reservation_id=facts.reservation_id, shape=facts.node_shape)
    check = QueueCheck(clusterqueue, needs=needs, own_selector=own, flavor_labels=lambda f: (
        None if (flavor := flavors.get(None, f)) is None
        else (flavor.get("spec") or {}).get("nodeLabels") or {}))
    closed = closed_capacities(check, {c: capacity_selector(c, shape=facts.node_shape) for c in CAPACITY_NAMES})
    return replace(facts, closed_capacity=closed)
