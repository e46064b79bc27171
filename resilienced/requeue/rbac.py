"""The Kubernetes RBAC the requeuers need, in one place (same :class:`Rule` as ``kube.rbac``).

Compared by tests with the verbs the emulated API server saw the requeue code send (the tests
run the emulator with RBAC limited to these rules), and meant to be merged into the deploy/
ClusterRole.  Every write is a merge patch (no ``update``); pods are deleted only by the KubeRay
requeuer (KubeRay does not roll pods on a template change); ``nodes: get`` tells whether a
worker already runs on the decided capacity.
"""

from __future__ import annotations

from resilienced.kube.rbac import Rule

RBAC_RULES: tuple[Rule, ...] = (
    Rule(("ray.io",), ("rayjobs", "rayclusters"), ("get", "patch"), "cluster",
         "requeue: read the run and its Kueue label; set every worker group's node selector and "
         "tolerations, and the resilienced.io/capacity-* annotations"),
    Rule(("",), ("pods",), ("list", "delete"), "cluster",
         "requeue (KubeRay without Kueue): delete the run's worker pods that are not on the decided "
         "capacity, together, so KubeRay recreates them from the new template"),
    Rule(("",), ("nodes",), ("get",), "cluster",
         "requeue: keep a worker pod whose Node already has the decided capacity-type labels"),
    Rule(("kueue.x-k8s.io",), ("workloads",), ("list", "patch"), "cluster",
         "requeue (Kueue): find the run's Workload (label kueue.x-k8s.io/job-uid, ownerReference); "
         "evict it with spec.active=false and requeue it with spec.active=true"),
    Rule(("batch.volcano.sh",), ("jobs",), ("get", "patch"), "cluster",
         "requeue (Volcano): read the Job; set its tasks' node selectors (refused where Volcano's "
         "webhook keeps them immutable) and the resilienced.io annotations"),
    Rule(("bus.volcano.sh",), ("commands",), ("create",), "cluster",
         "requeue (Volcano): a RestartJob Command targeting the Job restarts it as a whole"),
    Rule(("kueue.x-k8s.io",), ("resourceflavors",), ("get",), "cluster",
         "follow-up (kube.progress, Kueue): the nodeLabels of the flavors a Workload was admitted on"),
    Rule(("karpenter.sh",), ("nodeclaims",), ("list",), "cluster",
         "follow-up (kube.progress): NodeClaims that failed to launch, evidence of a stalled scheduling"),
    Rule(("",), ("events",), ("list",), "cluster",
         "follow-up (kube.progress): Karpenter's InsufficientCapacityError Events on NodeClaims"),
)


def requested_verbs() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the requeuers may send."""
    return {
        (group, resource, verb)
        for rule in RBAC_RULES
        for group in rule.api_groups for resource in rule.resources for verb in rule.verbs
    }
