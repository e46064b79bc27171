"""What resilienced calls, in one place: Kubernetes RBAC rules and AWS IAM actions.

The manifests under ``deploy/`` grant exactly this and nothing more; ``tests/deploy`` compares
them with these constants (ClusterRole, the daemon-namespace Role, the example overlay's token
Role, the CloudFormation IAM policy).  Each entry names the module that makes the call and why,
so that a reviewer who removes a call can remove its permission, and one who adds a call sees
where its permission goes.

Format (kept plain so manifests can be generated from it or compared with it):

* :class:`Rule` is one (API group, resource) with its verbs, e.g. ``Rule("", "nodes", ...)``.
  :func:`as_rbac` turns rules into the ``rules:`` list of a ClusterRole/Role.
* ``RBAC_RULES``: the ClusterRole (cluster-wide reads of nodes/pods/Ray objects, node taints,
  Events in the run's namespace, requeue).
* ``CONDITIONAL_RBAC_RULES``: condition -> rules an operator adds only when it holds.
* ``NAMESPACED_RBAC_RULES``: scope -> rules.  ``"daemon"``: a Role in the daemon's own namespace
  (Leases for cross-replica claims).  ``"run"``: a Role in each training namespace, limited by
  ``resourceNames`` to the Ray auth-token Secrets the daemon reads (the names are per
  deployment, so they are not here; ``deploy/kubernetes/overlays/example`` shows one).
* ``IAM_ACTIONS``: IAM action -> :class:`Call` (the botocore operations that need it, the
  module, why).

The Kubernetes adapters keep their own lists (``resilienced.kube.rbac``,
``resilienced.requeue.rbac``, checked against the verbs an emulated API server saw them send) and
``resilienced.capacity.ec2.IAM_ACTIONS``; tests/deploy/test_permissions.py holds these constants
equal to them.  This module imports none of them, on purpose: it stays importable without
kubernetes_asyncio (the deploy checks read it), and the test, not an import, keeps the lists equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """Verbs on one Kubernetes resource, and who needs them."""

    api_group: str  # "" is the core group
    resource: str  # plural, with subresource if any ("pods", "workloads", "leases")
    verbs: tuple[str, ...]
    used_by: str  # module that makes the call
    why: str
    resource_names_required: bool = False  # the grant must name its objects (resourceNames)


@dataclass(frozen=True)
class Call:
    """The AWS API operations (botocore names) behind one IAM action."""

    service: str  # botocore service name ("sqs", "ec2", "s3" ...)
    operations: tuple[str, ...]
    used_by: str
    why: str


# --------------------------------------------------------------------------- Kubernetes
RBAC_RULES: tuple[Rule, ...] = (
    Rule("", "nodes", ("get", "list", "watch", "patch"), "resilienced.kube, resilienced.requeue",
         "locate: cache Nodes to map an instance id (spec.providerID) to its Node (list/watch); "
         "cordon: patch a NoSchedule taint, re-read after a conflict (get/patch); requeue: is a "
         "worker's Node already of the decided capacity (get)"),
    Rule("", "pods", ("list", "watch", "delete"), "resilienced.kube, resilienced.requeue",
         "locate: cache Ray pods to find the runs on a Node (list/watch); requeue (KubeRay without "
         "Kueue): delete the run's worker pods so KubeRay recreates them on the decided capacity"),
    Rule("", "events", ("create", "get", "patch", "list", "watch"),
         "resilienced.kube.events, resilienced.kube.cluster_caches, resilienced.kube.progress",
         "record: Events on Nodes and RayJobs/RayClusters; a repeat is read and its count patched; "
         "follow-up: cache Karpenter's InsufficientCapacityError Events on NodeClaims where Karpenter is "
         "installed (list/watch; evidence of a stall)"),
    Rule("ray.io", "rayclusters", ("get", "list", "watch", "patch"),
         "resilienced.kube, resilienced.requeue",
         "locate: cache RayClusters (GCS address, authOptions, checkpoint annotation); requeue: "
         "read it, set the worker groups' node selector and tolerations (merge patch)"),
    Rule("ray.io", "rayjobs", ("get", "list", "watch", "patch"), "resilienced.kube, resilienced.requeue",
         "locate: cache RayJobs (owner, resilienced.io/checkpoint-uri); requeue: the same patch as "
         "on its RayCluster's template"),
    Rule("kueue.x-k8s.io", "workloads", ("list", "watch", "patch"), "resilienced.kube, resilienced.requeue",
         "requeue (Kueue): find the run's Workload; evict (spec.active=false) and requeue it "
         "(spec.active=true) as a whole; follow-up: cache Workloads where Kueue is installed (list/watch), "
         "whether the run's is admitted and on which flavors"),
    Rule("batch.volcano.sh", "jobs", ("get", "list", "watch", "patch"), "resilienced.kube, resilienced.requeue",
         "locate: cache Volcano Jobs where the cluster serves them, to find the Job that created a "
         "Ray pod and its checkpoint annotation (list/watch); requeue (Volcano): read the Job, set "
         "its tasks' node selectors and annotations (get/patch)"),
    Rule("bus.volcano.sh", "commands", ("create",), "resilienced.requeue",
         "requeue (Volcano): a RestartJob Command restarts the Job as a whole"),
    Rule("karpenter.sh", "nodepools", ("list", "watch"), "resilienced.kube",
         "capacity (where Karpenter is installed): cache NodePools, to follow a lost node's "
         "karpenter.sh/nodepool label to the NodePool's EC2NodeClass"),
    Rule("karpenter.k8s.aws", "ec2nodeclasses", ("list", "watch"), "resilienced.kube",
         "capacity (where Karpenter is installed): cache EC2NodeClasses; a Capacity Block is used "
         "only when one lists it in status.capacityReservations"),
    Rule("karpenter.sh", "nodeclaims", ("list", "watch"), "resilienced.kube, resilienced.kube.progress",
         "follow-up (where Karpenter is installed): cache NodeClaims, those that failed to launch "
         "(Launched=False) are the evidence of a stalled scheduling"),
    Rule("kueue.x-k8s.io", "localqueues", ("list", "watch"), "resilienced.kube",
         "capacity (where Kueue is installed): cache LocalQueues, a Kueue-managed run's queue -> ClusterQueue"),
    Rule("kueue.x-k8s.io", "clusterqueues", ("list", "watch"), "resilienced.kube",
         "capacity (where Kueue is installed): cache ClusterQueues; a capacity whose flavor has too little "
         "free quota for the run is not chosen"),
    Rule("kueue.x-k8s.io", "resourceflavors", ("get", "list", "watch"),
         "resilienced.kube, resilienced.kube.progress",
         "capacity (where Kueue is installed): cache ResourceFlavors, the nodeLabels that match a capacity; "
         "follow-up: the nodeLabels of the flavors the run's Workload was admitted on, compared with the "
         "decided capacity"),
)

NAMESPACED_RBAC_RULES: Mapping[str, tuple[Rule, ...]] = {
    "daemon": (
        Rule("coordination.k8s.io", "leases", ("get", "create", "update", "patch", "delete", "list"),
             "resilienced.kube.leases, resilienced.kube.followup_store",
             "claims: one Lease per (event id, run) in the daemon's namespace so that only one "
             "replica acts on it (ClaimStore acquire/get/complete/release); list: the sweep of "
             "done claims older than the dedupe window; follow-ups: one Lease per requeued run, "
             "written with a merge patch at the version read (a PUT would recreate a deleted one)"),
    ),
    "run": (
        Rule("", "secrets", ("get",), "resilienced.kube.tokens",
             "the Ray auth token (key auth_token) of a RayCluster with authOptions.mode=token, "
             "read from authOptions.secretName in the run's namespace",
             resource_names_required=True),
    ),
}

#: Granted only where the condition holds (not in deploy/kubernetes/base).
#: ``k8s-token-auth``: standalone RayClusters with ``authOptions.enableK8sTokenAuth``; the GCS
#: asks Kubernetes (SubjectAccessReview) whether the daemon's ServiceAccount may ``ray:write``
#: the RayCluster.  The daemon never sends this verb itself.
CONDITIONAL_RBAC_RULES: Mapping[str, tuple[Rule, ...]] = {
    "k8s-token-auth": (
        Rule("ray.io", "rayclusters", ("ray:write",), "resilienced.ray.gcs",
             "drain a RayCluster that delegates Ray auth to Kubernetes"),
    ),
}


def as_rbac(rules: Iterable[Rule], *, resource_names: Iterable[str] = ()) -> list[dict]:
    """The ``rules:`` of a ClusterRole/Role granting ``rules`` (one entry per resource)."""
    names = sorted(resource_names)
    out = []
    for rule in rules:
        entry: dict = {"apiGroups": [rule.api_group], "resources": [rule.resource],
                       "verbs": sorted(rule.verbs)}
        if rule.resource_names_required:
            if not names:
                raise ValueError(f"{rule.resource}: needs resourceNames")
            entry["resourceNames"] = names
        out.append(entry)
    return out


def grants(rules: Iterable[Rule]) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) triples: the form the manifests are compared in."""
    return {(r.api_group, r.resource, v) for r in rules for v in r.verbs}


# --------------------------------------------------------------------------- AWS
IAM_ACTIONS: Mapping[str, Call] = {
    "sqs:ReceiveMessage": Call("sqs", ("ReceiveMessage",), "resilienced.aws.sqs",
                               "intake: long-poll the interruption queue"),
    "sqs:DeleteMessage": Call("sqs", ("DeleteMessage",), "resilienced.aws.sqs",
                              "ack: delete a message once handled"),
    "sqs:ChangeMessageVisibility": Call("sqs", ("ChangeMessageVisibility",), "resilienced.aws.sqs",
                                        "extend visibility while a handler runs; release on shutdown"),
    "sqs:GetQueueAttributes": Call("sqs", ("GetQueueAttributes",), "resilienced.aws.sqs",
                                   "start-up and readiness: the queue answers, its RedrivePolicy "
                                   "(maxReceiveCount)"),
    "ec2:DescribeInstances": Call("ec2", ("DescribeInstances",),
                                  "resilienced.capacity.ec2, resilienced.aws.ec2nodes",
                                  "instances in a Capacity Block (expiry); ray mode: instance -> "
                                  "private IP; the EC2 node provider: its own instances (by tag), the "
                                  "lost instance's type and zone"),
    "ec2:DescribeCapacityReservations": Call("ec2", ("DescribeCapacityReservations",),
                                             "resilienced.capacity.ec2",
                                             "requeue: an active Capacity Block/ODCR with room"),
    # Only with --purchase-blocks (deploy/aws: parameter AllowCapacityBlockPurchase).
    "ec2:DescribeCapacityBlockOfferings": Call("ec2", ("DescribeCapacityBlockOfferings",),
                                               "resilienced.capacity.ec2",
                                               "requeue, buying on: find a Capacity Block offering"),
    "ec2:PurchaseCapacityBlock": Call("ec2", ("PurchaseCapacityBlock",), "resilienced.capacity.ec2",
                                      "requeue, buying on: buy it (price-capped, idempotent by tag)"),
    "ec2:CreateTags": Call("ec2", ("PurchaseCapacityBlock", "RunInstances"),
                           "resilienced.capacity.ec2, resilienced.aws.ec2nodes",
                           "the purchase's TagSpecifications (resilienced.io/purchase-key) on the "
                           "new capacity reservation; a replacement node's TagSpecifications "
                           "(resilienced.io/launched-by and the node's labels) at launch; each grant "
                           "is limited by ec2:CreateAction to its one operation"),
    # Only with ray mode's EC2 node provider (deploy/aws: parameter Ec2NodeProvider).
    "ec2:RunInstances": Call("ec2", ("RunInstances",), "resilienced.aws.ec2nodes",
                             "ray mode on EC2: launch a replacement node from the launch template, "
                             "only tagged resilienced.io/launched-by=<owner>"),
    "ec2:TerminateInstances": Call("ec2", ("TerminateInstances",), "resilienced.aws.ec2nodes",
                                   "ray mode on EC2: give back a replacement that never joined, only "
                                   "instances tagged resilienced.io/launched-by=<owner>"),
    # Authorised on RunInstances: the launch template's instance profile role (Ec2NodeRoleArn).
    "iam:PassRole": Call("ec2", ("RunInstances",), "resilienced.aws.ec2nodes",
                         "ray mode on EC2: the nodes' role, passed to ec2.amazonaws.com at launch"),
    "ec2:DescribeSpotPriceHistory": Call("ec2", ("DescribeSpotPriceHistory",), "resilienced.aws.pricing",
                                         "the ledger: the Spot price of the run's pool"),
    "pricing:GetProducts": Call("pricing", ("GetProducts",), "resilienced.aws.pricing",
                                "the ledger: the On-Demand price of the run's instance type"),
    "s3:ListBucket": Call("s3", ("ListObjectsV2",), "resilienced.aws.s3",
                          "durable: list the run's checkpoint prefix"),
    "s3:GetObject": Call("s3", ("GetObject", "HeadObject"), "resilienced.aws.s3",
                         "durable: read the checkpoint manifest, check each file"),
    "fsx:CreateDataRepositoryTask": Call("fsx", ("CreateDataRepositoryTask",), "resilienced.aws.fsx",
                                         "durable, export mode 'task': export the checkpoint path"),
    "fsx:DescribeDataRepositoryTasks": Call("fsx", ("DescribeDataRepositoryTasks",),
                                            "resilienced.aws.fsx",
                                            "durable, export mode 'task': wait for SUCCEEDED"),
    "autoscaling:RecordLifecycleActionHeartbeat": Call(
        "autoscaling", ("RecordLifecycleActionHeartbeat",), "resilienced.aws.autoscaling",
        "asg_lifecycle: keep the terminate hook waiting while the drain, the save and the durable "
        "wait go on (recovery.heartbeat)"),
    "autoscaling:CompleteLifecycleAction": Call("autoscaling", ("CompleteLifecycleAction",),
                                                "resilienced.aws.autoscaling",
                                                "asg_lifecycle: CONTINUE once the checkpoint is durable"),
}
