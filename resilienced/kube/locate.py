"""Pure rules for finding runs in Kubernetes objects: instance ids, Ray pods, owners, addresses.

Everything here reads plain JSON objects (as the caches hold them) and does no I/O, so each rule
is tested as a table.  :mod:`resilienced.kube.cluster` strings them together:

    instance id  --spec.providerID aws:///<az>/<id>-->  Node
    Node         --pods with spec.nodeName, label ray.io/node-type-->  Ray pods
    Ray pod      --label ray.io/cluster (same namespace)-->  RayCluster
    RayCluster   --ownerReferences kind RayJob, else a RayJob naming it-->  RayJob (optional)
    Ray pod IP   --RayNode.address in the cluster's GCS-->  Ray node id

Ray inside a Volcano Job (no RayCluster object): the task templates carry the Ray labels
(``ray.io/cluster``, ``ray.io/node-type``), and Volcano marks each pod it creates as the Job's:

    Ray pod      --controller ownerReference kind Job (batch.volcano.sh), else the label
                   volcano.sh/job-name (same namespace)-->  Volcano Job
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from resilienced.model import JsonValue, NodeShape, RunFacts
from resilienced.ports import RayNode

JsonObj = dict[str, JsonValue]

# KubeRay's labels (ray-operator/controllers/ray/utils/constant.go)
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
GROUP_LABEL = "ray.io/group"
RAY_POD_SELECTOR = NODE_TYPE_LABEL  # "the label exists": head, worker (and redis-cleanup, skipped)

# Karpenter's label on nodes launched into a capacity reservation / Capacity Block
RESERVATION_LABEL = "karpenter.k8s.aws/capacity-reservation-id"

CHECKPOINT_ANNOTATION = "resilienced.io/checkpoint-uri"
#: ``"true"``: the run continues at a smaller size when it loses workers (docs/requeue.md "Elastic runs")
ELASTIC_ANNOTATION = "resilienced.io/elastic"
# Kueue (kubernetes-sigs/kueue v0.19.2): the queue label, and the annotation that makes a job elastic to
# Kueue (``pkg/workloadslicing/workloadslicing.go`` ``EnabledAnnotationKey`` = ``constants.ElasticJobAnnotation``).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"

# Volcano's pod labels (volcano-sh/apis pkg/apis/batch/v1alpha1/labels.go at 0d90235, ``JobNameKey``,
# ``JobNamespaceKey``): the job controller sets both, and the ownerReference
# ``metav1.NewControllerRef(job, helpers.JobKind)``, on every pod it creates
# (volcano-sh/volcano pkg/controllers/job/job_controller_util.go ``createJobPod``, v1.10 to v1.13).
VOLCANO_JOB_NAME_LABEL = "volcano.sh/job-name"
VOLCANO_JOB_NAMESPACE_LABEL = "volcano.sh/job-namespace"
VOLCANO_JOB_API_VERSION = "batch.volcano.sh/v1alpha1"

GCS_PORT_NAME = "gcs-server"  # KubeRay's name for the head container's GCS port
DEFAULT_GCS_PORT = 6379  # KubeRay's DefaultGcsServerPort

_PROVIDER_ID = re.compile(r"^aws:///(?P<az>[^/]*)/(?P<instance>i-[0-9a-f]{8,17})$")
_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<prefix>[^\s]+)$")
_ACTIVE_JOB_STATES = {"", "New", "Initializing", "Running", "Waiting", "Retrying", "Suspending"}


def instance_id_of(node: Mapping[str, JsonValue]) -> str | None:
    """The EC2 instance id in a Node's ``spec.providerID`` (``aws:///us-east-1a/i-0abc...``)."""
    provider_id = (node.get("spec") or {}).get("providerID") or ""
    match = _PROVIDER_ID.match(provider_id)
    return match.group("instance") if match else None


def labels(obj: Mapping[str, JsonValue]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def annotations(obj: Mapping[str, JsonValue]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def name_of(obj: Mapping[str, JsonValue]) -> str:
    return (obj.get("metadata") or {}).get("name") or ""


def namespace_of(obj: Mapping[str, JsonValue]) -> str:
    return (obj.get("metadata") or {}).get("namespace") or ""


def uid_of(obj: Mapping[str, JsonValue]) -> str:
    return (obj.get("metadata") or {}).get("uid") or ""


def is_ray_pod(pod: Mapping[str, JsonValue]) -> bool:
    """A head or worker pod that is not finished (a pod being deleted still runs: it counts)."""
    node_type = labels(pod).get(NODE_TYPE_LABEL)
    phase = (pod.get("status") or {}).get("phase")
    return (node_type in ("head", "worker") and bool(labels(pod).get(CLUSTER_LABEL))
            and phase not in ("Succeeded", "Failed"))


#: Extended resources that are accelerators (what a worker pod requests of them counts in the ledger).
ACCELERATORS = ("nvidia.com/gpu", "amd.com/gpu", "aws.amazon.com/neuron", "aws.amazon.com/neuroncore",
                "google.com/tpu", "habana.ai/gaudi")


def accelerators_requested(pods: Sequence[Mapping[str, JsonValue]]) -> float | None:
    """The accelerators the pods' containers request (else their limits: a limit alone sets the request
    of an extended resource), all together; None: none requested."""
    total = 0.0
    for pod in pods:
        for container in (pod.get("spec") or {}).get("containers") or ():  # type: ignore[union-attr]
            resources = container.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for name in ACCELERATORS:
                try:
                    total += float(asked.get(name) or 0)
                except (TypeError, ValueError):  # a quantity not a plain number ("1k"): not counted
                    continue
    return total or None


def is_head(pod: Mapping[str, JsonValue]) -> bool:
    return labels(pod).get(NODE_TYPE_LABEL) == "head"


def pod_ip(pod: Mapping[str, JsonValue]) -> str | None:
    return (pod.get("status") or {}).get("podIP") or None


def cluster_key_of(pod: Mapping[str, JsonValue]) -> str | None:
    """``namespace/name`` of the RayCluster a Ray pod belongs to."""
    cluster = labels(pod).get(CLUSTER_LABEL)
    return f"{namespace_of(pod)}/{cluster}" if cluster else None


def job_cluster_keys(job: Mapping[str, JsonValue]) -> list[str]:
    """The RayClusters a RayJob runs on: ``status.rayClusterName``, or its ``clusterSelector``."""
    ns = namespace_of(job)
    names = {(job.get("status") or {}).get("rayClusterName"),
             ((job.get("spec") or {}).get("clusterSelector") or {}).get(CLUSTER_LABEL)}
    return [f"{ns}/{n}" for n in sorted(n for n in names if n)]


def kueue_manages(obj: Mapping[str, JsonValue]) -> bool:
    """Whether Kueue manages a RayJob / RayCluster: it carries ``kueue.x-k8s.io/queue-name``, and is
    not a RayJob with ``spec.clusterSelector``.

    Kueue skips a RayJob that runs on an existing cluster (kubernetes-sigs/kueue v0.19.2, from
    v0.15.0, ``pkg/controller/jobs/rayjob/rayjob_controller.go`` ``Skip()``:
    ``len(j.Spec.ClusterSelector) > 0``; v0.14 refuses the queue label on such a RayJob in
    ``rayjob_webhook.go``): no Workload ever exists for it.  The RayCluster it runs on may be
    Kueue's on its own label.
    """
    if not labels(obj).get(KUEUE_QUEUE_LABEL):
        return False
    return not (obj.get("kind") == "RayJob" and (obj.get("spec") or {}).get("clusterSelector"))


def owning_job_ref(raycluster: Mapping[str, JsonValue]) -> Mapping[str, Any] | None:
    """The ownerReference of kind RayJob (KubeRay creates the cluster of a RayJob with one)."""
    for ref in (raycluster.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "RayJob" and str(ref.get("apiVersion", "")).startswith("ray.io/"):
            return ref
    return None


def volcano_job_of(pod: Mapping[str, JsonValue]) -> tuple[str, str] | None:
    """(``namespace/name``, uid or "") of the Volcano Job that created ``pod``, or None.

    The controller ownerReference of kind Job in ``batch.volcano.sh`` first (it carries the uid);
    else Volcano's label ``volcano.sh/job-name`` (with ``volcano.sh/job-namespace``, which Volcano
    sets to the pod's own namespace).
    """
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (ref.get("kind") == "Job" and str(ref.get("apiVersion", "")).startswith("batch.volcano.sh/")
                and ref.get("controller") and ref.get("name")):
            return f"{namespace_of(pod)}/{ref['name']}", str(ref.get("uid") or "")
    name = labels(pod).get(VOLCANO_JOB_NAME_LABEL)
    if name:
        return f"{labels(pod).get(VOLCANO_JOB_NAMESPACE_LABEL) or namespace_of(pod)}/{name}", ""
    return None


_Job = TypeVar("_Job", bound=Mapping[str, Any])


def pick_job(candidates: Sequence[_Job]) -> _Job | None:
    """Of the RayJobs that name a cluster (clusterSelector mode may have several), the one running."""
    active = [j for j in candidates if ((j.get("status") or {}).get("jobDeploymentStatus") or "") in _ACTIVE_JOB_STATES]
    return active[0] if len(active) == 1 else None


def checkpoint_uri(job: Mapping[str, JsonValue] | None, raycluster: Mapping[str, JsonValue]) -> tuple[str | None, str | None]:
    """(uri, error): the RayJob's annotation wins over the RayCluster's; a malformed one is an error."""
    for owner, obj in (("RayJob", job), ("RayCluster", raycluster)):
        if obj is None:
            continue
        value = annotations(obj).get(CHECKPOINT_ANNOTATION)
        if value is None:
            continue
        if not _S3_URI.match(value.strip()):
            return None, (
                f"annotation {CHECKPOINT_ANNOTATION}={value!r} on {owner} {namespace_of(obj)}/{name_of(obj)} "
                "is not s3://bucket/prefix"
            )
        return value.strip(), None
    return None, None


def _container_port(pod: Mapping[str, JsonValue], port_name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == port_name and port.get("containerPort"):
                return int(port["containerPort"])
    return None


def gcs_address(raycluster: Mapping[str, JsonValue], head_pod: Mapping[str, JsonValue] | None) -> str:
    """Where the cluster's GCS answers, from what KubeRay publishes.  Tried in this order:

    host  1. ``status.head.serviceIP``: the head Service's ClusterIP (stable across head restarts;
             skipped when empty or ``None``, i.e. a headless Service)
          2. ``status.head.podIP``
          3. the head pod's ``status.podIP`` from the pod cache (status not written yet)
          4. the head Service's DNS name, ``status.head.serviceName`` or ``<cluster>-head-svc``,
             as ``<svc>.<namespace>.svc`` (only resolvable inside the cluster)
    port  1. the head container's port named ``gcs-server`` (what the GCS listens on; KubeRay's
             head Service exposes the same number)
          2. ``status.endpoints["gcs-server"]`` (KubeRay copies the Service's target port there,
             but the NodePort for a NodePort Service, hence second)
          3. 6379, KubeRay's default
    """
    status = raycluster.get("status") or {}
    head = status.get("head") or {}
    host = next(
        (h for h in (head.get("serviceIP"), head.get("podIP"), pod_ip(head_pod) if head_pod else None)
         if h and h != "None"),
        None,
    )
    if host is None:
        service = head.get("serviceName") or f"{name_of(raycluster)}-head-svc"
        host = f"{service}.{namespace_of(raycluster)}.svc"
    port = _container_port(head_pod, GCS_PORT_NAME) if head_pod else None
    if port is None:
        endpoint = str((status.get("endpoints") or {}).get(GCS_PORT_NAME) or "")
        port = int(endpoint) if endpoint.isdigit() else DEFAULT_GCS_PORT
    return f"{host}:{port}"


def ray_nodes_by_address(nodes: Iterable[RayNode]) -> dict[str, RayNode]:
    """Alive Ray nodes by address (a restarted pod may leave a dead node with the same IP)."""
    result: dict[str, RayNode] = {}
    for node in nodes:
        if node.alive:
            result[node.address] = node
    return result


def taint_value(reason: str) -> str:
    """A label-value-safe form of ``reason`` for the taint's value (63 characters at most)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:63].strip("-_.")
    return value or "interruption"


def secret_name_for(cluster_name: str) -> str:
    """KubeRay's name for a RayCluster's generated auth Secret (``utils.CheckName(cluster name)``)."""
    name = cluster_name
    if len(name) > 50:
        name = name[len(name) - 50:]
    if name and (name[0].isdigit() or not name[0].isalnum()):
        name = "r" + name[1:]
    return name


#: Node labels that carry what the capacity decision needs (well-known Kubernetes and Karpenter keys).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ZONE_LABEL = "topology.kubernetes.io/zone"
KARPENTER_CAPACITY_LABEL = "karpenter.sh/capacity-type"
#: aws/karpenter-provider-aws v1.6+ ``pkg/apis/v1/labels.go``: ``default`` (an On-Demand Capacity
#: Reservation) or ``capacity-block``, on every node with ``karpenter.sh/capacity-type: reserved``.
RESERVATION_TYPE_LABEL = "karpenter.k8s.aws/capacity-reservation-type"
#: A Node's NodePool (kubernetes-sigs/karpenter ``pkg/apis/v1/labels.go``): Karpenter manages it.
NODEPOOL_LABEL = "karpenter.sh/nodepool"
#: EKS managed node groups label their nodes with the group and its capacity type
#: (``ON_DEMAND`` | ``SPOT`` | ``CAPACITY_BLOCK``); no Karpenter label is on them.
EKS_NODEGROUP_LABEL = "eks.amazonaws.com/nodegroup"
EKS_CAPACITY_LABEL = "eks.amazonaws.com/capacityType"
EKS_CAPACITY = {"SPOT": "spot", "ON_DEMAND": "on-demand", "CAPACITY_BLOCK": "capacity-block"}


#: Karpenter's ``karpenter.sh/capacity-type`` for each capacity that places a run.
KARPENTER_CAPACITY_VALUES = {"spot": "spot", "capacity-block": "reserved", "on-demand": "on-demand"}


def capacity_selector(capacity: str, *, reservation_id: str | None = None,
                      shape: str | None = None) -> dict[str, str]:
    """The node selector that puts pods on ``capacity`` (``spot`` | ``capacity-block`` |
    ``on-demand``) for nodes of ``shape`` (a :class:`NodeShape` value; None: Karpenter's labels).

    Karpenter (aws/karpenter-provider-aws ``website/content/en/docs/concepts/scheduling.md``):
    ``karpenter.sh/capacity-type``, and for a block its reservation id (when given) and type.
    An EKS managed node group: ``eks.amazonaws.com/capacityType`` (no reservation id label).
    """
    if shape == NodeShape.EKS_NODEGROUP.value:
        return {EKS_CAPACITY_LABEL: next(k for k, v in EKS_CAPACITY.items() if v == capacity)}
    selector = {KARPENTER_CAPACITY_LABEL: KARPENTER_CAPACITY_VALUES[capacity]}
    if capacity == "capacity-block":
        if reservation_id:
            selector[RESERVATION_LABEL] = reservation_id
        selector[RESERVATION_TYPE_LABEL] = "capacity-block"
    return selector


def node_shape(node_labels: Mapping[str, str]) -> NodeShape | None:
    """Who manages a Node: Karpenter (its NodePool label), an EKS managed node group, or neither."""
    if node_labels.get(NODEPOOL_LABEL):
        return NodeShape.KARPENTER
    if node_labels.get(EKS_NODEGROUP_LABEL):
        return NodeShape.EKS_NODEGROUP
    return None


def node_capacity_facts(node_labels: Mapping[str, str]) -> dict[str, JsonValue]:
    """``capacity_type``, ``reservation_id``, ``reservation_type``, ``node_shape`` from a Node's labels.

    Karpenter's labels where the Node has them (a reserved node keeps Karpenter's ``reserved`` and
    its reservation type: ``default`` is an On-Demand Capacity Reservation, not a block); else an
    EKS managed node group's ``eks.amazonaws.com/capacityType``, as ``spot`` / ``on-demand`` /
    ``capacity-block`` (no reservation id: node groups do not label it).
    """
    facts: dict[str, JsonValue] = {}
    shape = node_shape(node_labels)
    if shape is not None:
        facts["node_shape"] = shape.value
    if node_labels.get(KARPENTER_CAPACITY_LABEL):
        facts["capacity_type"] = node_labels[KARPENTER_CAPACITY_LABEL]
        for key, label in (("reservation_id", RESERVATION_LABEL), ("reservation_type", RESERVATION_TYPE_LABEL)):
            if node_labels.get(label):
                facts[key] = node_labels[label]
    elif node_labels.get(EKS_CAPACITY_LABEL) in EKS_CAPACITY:
        facts["capacity_type"] = EKS_CAPACITY[node_labels[EKS_CAPACITY_LABEL]]
    return facts


def requeued_facts(run_objects: Sequence[Mapping[str, JsonValue]]) -> dict[str, JsonValue]:
    """The last requeue resilienced applied, from the first run object that records one.

    The Kubernetes requeuers write ``resilienced.io/requeued-for`` (the event id), ``-capacity-type``
    and ``-capacity-reservation-id`` with the move (``requeue/kuberay.py`` ``bookkeeping``); a
    delivery that takes the same event over keeps that decision instead of deciding again.
    """
    for obj in run_objects:
        notes = annotations(obj)
        if notes.get("resilienced.io/requeued-for"):
            return {"requeued_for": notes["resilienced.io/requeued-for"],
                    "requeued_capacity": notes.get("resilienced.io/capacity-type"),
                    "requeued_reservation_id": notes.get("resilienced.io/capacity-reservation-id")}
    return {}


def capacity_facts(*, node: Mapping[str, JsonValue], run_objects: Sequence[Mapping[str, JsonValue]],
                   worker_nodes: Sequence[str]) -> RunFacts:
    """``Target.facts`` for the capacity decision (see ``resilienced.capacity.request``).

    From the Node's labels: instance type, zone, who manages it and its capacity
    (:func:`node_capacity_facts`); from the run's objects (RayJob first, then RayCluster): when
    resilienced last moved it; ``instance_count``: the distinct Nodes the run's worker pods are on
    (the gang).
    """
    node_labels = labels(node)
    facts: dict[str, JsonValue] = {}
    for key, label in (("instance_type", INSTANCE_TYPE_LABEL), ("availability_zone", ZONE_LABEL)):
        if node_labels.get(label):
            facts[key] = node_labels[label]
    facts.update(node_capacity_facts(node_labels))
    for obj in run_objects:
        moved = annotations(obj).get("resilienced.io/capacity-moved-at")
        if moved:
            facts["moved_at"] = moved
            break
    facts.update(requeued_facts(run_objects))
    count = len({n for n in worker_nodes if n})
    if count:
        facts["instance_count"] = count
    facts.update(elastic_facts(run_objects))
    return RunFacts(**facts)


def elastic_facts(run_objects: Sequence[Mapping[str, JsonValue]]) -> dict[str, JsonValue]:
    """``elastic`` (and ``elastic_fallback`` / ``elastic_error``) from the run's objects, RayJob first.

    ``resilienced.io/elastic: "true"`` makes the run elastic, ``"false"`` (or no annotation) not; any
    other value is an error named in ``elastic_error`` (the run is then requeued as a gang).  A
    Kueue-managed run is requeued as a gang anyway, with the reason in ``elastic_fallback``, when
    Kueue cannot scale it (see docs/requeue.md "Elastic runs"): a RayJob (Kueue v0.14 - v0.19 builds
    its PodSets from the RayJob's spec and follows the RayCluster's replicas only with the Ray
    autoscaler, ``pkg/controller/jobs/raycluster/common.go`` ``UpdatePodSets``), or a RayCluster
    without ``kueue.x-k8s.io/elastic-job: "true"``.
    """
    owner = next((o for o in run_objects if ELASTIC_ANNOTATION in annotations(o)), None)
    if owner is None:
        return {"elastic": False}
    value = annotations(owner)[ELASTIC_ANNOTATION].strip().lower()
    where = f"{owner.get('kind') or 'object'} {namespace_of(owner)}/{name_of(owner)}"
    if value not in ("true", "false"):
        return {"elastic": False, "elastic_error": (
            f"annotation {ELASTIC_ANNOTATION}={annotations(owner)[ELASTIC_ANNOTATION]!r} on {where} must be "
            "\"true\" or \"false\"; the run is requeued as a gang")}
    if value == "false":
        return {"elastic": False}
    queued = next((o for o in run_objects if kueue_manages(o)), None)
    if queued is None:
        return {"elastic": True}
    queued_at = f"{queued.get('kind') or 'object'} {namespace_of(queued)}/{name_of(queued)}"
    if queued.get("kind") == "RayJob":
        reason = (f"Kueue manages {queued_at}: Kueue (v0.14 - v0.19) scales a RayJob's Workload only through "
                  "the Ray autoscaler, never for a replica change resilienced makes; requeued as a gang")
    elif annotations(queued).get(KUEUE_ELASTIC_ANNOTATION) != "true":
        reason = (f"Kueue manages {queued_at} without {KUEUE_ELASTIC_ANNOTATION}: \"true\": Kueue admits its "
                  "Workload as a whole; requeued as a gang")
    else:
        return {"elastic": True}
    return {"elastic": False, "elastic_fallback": reason}

