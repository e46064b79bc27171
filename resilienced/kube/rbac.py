"""The Kubernetes RBAC kubernetes mode needs, in one place.

``RBAC_RULES`` is compared by tests with the deploy/ manifests and with the verbs the emulated API
server saw the code use; docs/kubernetes.md explains each line.  ``scope`` says where it is bound:

* ``cluster``          a ClusterRole + ClusterRoleBinding (Nodes are cluster-scoped; Ray pods and
                       KubeRay objects live in any namespace; Events go next to them)
* ``lease-namespace``  a Role + RoleBinding in the namespace of the claims' Leases
* ``ray-namespace``    a Role + RoleBinding in each namespace running RayClusters with
                       ``authOptions.mode: token``, naming their auth Secrets in ``resourceNames``

``requested`` is False for a verb the daemon never sends itself: ``ray:write`` is checked by a Ray
GCS (SubjectAccessReview) when the daemon calls it with its ServiceAccount token.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTH_SECRETS = "<auth Secret of each token-mode RayCluster>"  # placeholder in resource_names


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    scope: str  # "cluster" | "lease-namespace" | "ray-namespace"
    why: str
    resource_names: tuple[str, ...] = ()
    requested: bool = True
    when: str = "always"


RBAC_RULES: tuple[Rule, ...] = (
    Rule(("",), ("nodes",), ("list", "watch"), "cluster",
         "cache Nodes to map an instance id (spec.providerID) to its Node"),
    Rule(("",), ("nodes",), ("get", "patch"), "cluster",
         "cordon: add the NoSchedule taint by patch; re-read the Node after a conflict"),
    Rule(("",), ("pods",), ("list", "watch"), "cluster",
         "cache Ray pods (label ray.io/node-type) to find the runs on a Node and their IPs"),
    Rule(("ray.io",), ("rayclusters", "rayjobs"), ("list", "watch"), "cluster",
         "cache RayClusters (GCS address, authOptions, checkpoint annotation) and RayJobs (owner, annotation)"),
    Rule(("batch.volcano.sh",), ("jobs",), ("list", "watch"), "cluster",
         "cache Volcano Jobs (where the cluster serves them) to locate Ray pods a Volcano Job created "
         "and read its checkpoint annotation (no CRD: no cache, the grant is unused)"),
    Rule(("karpenter.sh",), ("nodepools",), ("list", "watch"), "cluster",
         "cache NodePools (where served): a lost node's karpenter.sh/nodepool -> its EC2NodeClass"),
    Rule(("karpenter.k8s.aws",), ("ec2nodeclasses",), ("list", "watch"), "cluster",
         "cache EC2NodeClasses (where served): status.capacityReservations, the Capacity Blocks "
         "Karpenter can launch into"),
    Rule(("kueue.x-k8s.io",), ("localqueues", "clusterqueues", "resourceflavors"), ("list", "watch"), "cluster",
         "cache Kueue's queues (where served): a Kueue-managed run's LocalQueue -> ClusterQueue quota and "
         "usage, and the ResourceFlavors' nodeLabels, so a capacity without free quota is not chosen"),
    Rule(("kueue.x-k8s.io",), ("workloads",), ("list", "watch"), "cluster",
         "cache Workloads (where served): the follow-up reads whether a run's Workload is admitted, and on "
         "which flavors, from the cache (issue #45)"),
    Rule(("karpenter.sh",), ("nodeclaims",), ("list", "watch"), "cluster",
         "cache NodeClaims (where served): those that failed to launch are the follow-up's evidence of a stall"),
    Rule(("",), ("events",), ("list", "watch"), "cluster",
         "cache Karpenter's InsufficientCapacityError Events on NodeClaims (where NodeClaims are served; "
         "field selector involvedObject.kind=NodeClaim,reason=InsufficientCapacityError)"),
    Rule(("",), ("events",), ("create", "get", "patch"), "cluster",
         "Events on Nodes (namespace default) and RayJobs/RayClusters; get + patch count repeats"),
    Rule(("coordination.k8s.io",), ("leases",), ("create", "get", "update", "patch", "delete", "list"), "lease-namespace",
         "cross-replica claims: one Lease per (event, run); list to sweep done ones"),
    Rule(("",), ("secrets",), ("get",), "ray-namespace",
         "the Ray auth token of a token-mode RayCluster, read by name", resource_names=(AUTH_SECRETS,),
         when="RayClusters with authOptions.mode=token and no enableK8sTokenAuth"),
    Rule(("ray.io",), ("rayclusters",), ("ray:write",), "cluster",
         "delegated Ray auth: the GCS asks Kubernetes whether the daemon's ServiceAccount may ray:write the RayCluster",
         requested=False, when="RayClusters with authOptions.enableK8sTokenAuth=true"),
)


def requested_verbs() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the daemon itself may send (compare with an API request log)."""
    return {
        (group, resource, verb)
        for rule in RBAC_RULES if rule.requested
        for group in rule.api_groups for resource in rule.resources for verb in rule.verbs
    }
