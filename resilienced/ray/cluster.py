"""Ray mode: one Ray cluster without Kubernetes (e.g. launched on EC2), and the ray-mode node labels.

:class:`RayModeCluster` implements :class:`~resilienced.ports.Cluster` for one Ray cluster:

* ``locate`` maps an EC2 instance id to the Ray nodes on it.  First by a node label
  (``resilienced.io/instance-id`` by default: start each node with
  ``ray start --labels=resilienced.io/instance-id=$(ec2-metadata -i)``), else by private IP: the
  instance's private addresses from EC2 ``DescribeInstances`` compared with each node's
  ``node_manager_address``.  The whole Ray cluster is the run, so a target's ``run_key`` is the
  GCS address; ``ray_cluster``/``ray_job`` are None.
* ``cordon`` does nothing: a draining Ray node already takes no new work (the GCS stops
  scheduling on it once the drain is accepted), and there is no scheduler above Ray to tell.
* ``record`` writes a log line (there are no Kubernetes Events to attach it to).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from aiobotocore.client import AioBaseClient

from resilienced.aws.errors import translate  # the one AWS error translation
from resilienced.errors import PermanentError
from resilienced.log import get as get_logger
from resilienced.model import JsonValue, RunFacts, Target
from resilienced.ports import Location, RayControl, RayNode

log = get_logger(__name__)

#: The node labels of ray mode (``ray start --labels=...``); the local drill uses them too.
#: The EC2 instance a Ray node runs on:
INSTANCE_ID_LABEL = "resilienced.io/instance-id"
#: ``spot`` | ``capacity-block`` | ``on-demand``: the pool the node came from.
CAPACITY_TYPE_LABEL = "resilienced.io/capacity-type"
#: The Capacity Block (``cr-...``) a node runs in, when it does.
RESERVATION_LABEL = "resilienced.io/capacity-reservation-id"
#: The node's instance type and zone (else ``--instance-type``; zone unknown).
INSTANCE_TYPE_LABEL = "resilienced.io/instance-type"
ZONE_LABEL = "resilienced.io/zone"
#: ``true`` on a run's worker nodes: the run is elastic (docs/requeue.md "Elastic runs"): losing the
#: node asks for a replacement only, the other workers keep training.
ELASTIC_LABEL = "resilienced.io/elastic"


def accelerators_of(nodes: Sequence[RayNode]) -> float | None:
    """The GPUs the cluster's alive worker nodes offer (their ``resources_total``); None: none."""
    total = sum(float(n.resources.get("GPU", 0.0)) for n in nodes if n.alive and not n.is_head)
    return total or None


class RayModeCluster:
    """``ports.Cluster`` for one Ray cluster without Kubernetes.

    Args:
        ray: the cluster's GCS adapter (:class:`resilienced.ray.gcs.RayGcs`).
        checkpoint_uri: the run's S3 prefix (``s3://bucket/prefix``) from configuration, put on
            every target; None when nobody said where checkpoints go.
        ray_address: the GCS address put on targets (default: ``ray.address``).
        ec2: an aiobotocore EC2 client (owned by the caller) for the private-IP fallback; None
            turns the fallback off (only labelled nodes are found).
        instance_label: the node label key holding the EC2 instance id.
    """

    mode = "ray"

    def __init__(
        self,
        *,
        ray: RayControl,
        checkpoint_uri: str | None,
        ray_address: str | None = None,
        ec2: AioBaseClient | None = None,
        instance_label: str = INSTANCE_ID_LABEL,
        instance_type: str | None = None,
    ) -> None:
        if not instance_label or not isinstance(instance_label, str):
            raise ValueError("instance_label must be a non-empty node label key")
        self._ray = ray
        self._ec2 = ec2
        self.checkpoint_uri = checkpoint_uri
        self.ray_address = ray_address if ray_address is not None else getattr(ray, "address", None)
        self.instance_label = instance_label
        self.instance_type = instance_type

    async def locate(
        self, *, instance_ids: Sequence[str], capacity_reservation_id: str | None = None
    ) -> Location:
        """The Ray nodes on each instance (label first, then private IP).

        ``capacity_reservation_id`` is not used: the instances of a reservation are resolved
        before this call.  A target's ``ray_node_ids`` are its *alive* worker nodes (those to
        drain; a head node on the instance is flagged ``attributes["head_on_instance"]`` and never
        drained); nodes found dead are listed in ``attributes["dead_node_ids"]`` (the instance
        is gone, the run still needs requeueing from its newest checkpoint).
        """
        wanted = list(dict.fromkeys(instance_ids))
        if not wanted:
            return Location(targets=(), unresolved={})
        nodes = await self._ray.nodes()
        targets: list[Target] = []
        unresolved: dict[str, str] = {}
        by_label: dict[str, list[RayNode]] = {}
        for node in nodes:
            iid = node.labels.get(self.instance_label)
            if iid:
                by_label.setdefault(iid, []).append(node)
        rest = [iid for iid in wanted if iid not in by_label]
        refused: str | None = None
        try:
            addresses = await self._private_addresses(rest) if rest and self._ec2 is not None else {}
        except PermanentError as e:  # the instances found by label are still drained
            addresses, refused = {}, str(e)
        for iid in wanted:
            if iid in by_label:
                targets.append(self._target(iid, by_label[iid], matched_by="label"))
                continue
            if refused is not None:
                unresolved[iid] = (f"no Ray node labelled {self.instance_label}={iid}, and EC2 "
                                   f"refused the private-IP lookup: {refused}")
                continue
            if self._ec2 is None:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid}, and no EC2 lookup "
                    "is configured for the private-IP fallback"
                )
                continue
            ips = addresses.get(iid)
            if ips is None:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid}, and EC2 does not know "
                    "the instance"
                )
                continue
            on_ip = [n for n in nodes if n.address in ips]
            if not on_ip:
                unresolved[iid] = (
                    f"no Ray node labelled {self.instance_label}={iid} or at its private "
                    f"address{'es' if len(ips) > 1 else ''} {', '.join(sorted(ips)) or '(none)'}"
                )
                continue
            targets.append(self._target(iid, on_ip, matched_by="private-ip"))
        gpus = accelerators_of(nodes)  # the run (ray mode: the cluster) all together, for the ledger
        targets = [replace(t, facts=replace(t.facts, accelerators=gpus)) for t in targets]
        return Location(targets=tuple(targets), unresolved=unresolved)

    def _target(self, instance_id: str, nodes: list[RayNode], *, matched_by: str) -> Target:
        alive = [n for n in nodes if n.alive]
        dead = [n for n in nodes if not n.alive]
        shown = alive or dead
        return Target(
            instance_id=instance_id,
            node=shown[0].address if shown else None,
            ray_cluster=None,
            ray_job=None,
            # Never the head: a drained idle head raylet leaves at once (seen here), taking the
            # driver with it; the head's instance going away ends the cluster in any case.
            ray_node_ids=tuple(n.node_id for n in alive if not n.is_head),
            checkpoint_uri=self.checkpoint_uri,
            ray_address=self.ray_address,
            attributes={
                "matched_by": matched_by,
                "dead_node_ids": [n.node_id for n in dead],
                "head_on_instance": any(n.is_head for n in alive),
            },
            facts=self._capacity_facts(shown),
        )

    def _capacity_facts(self, nodes: list[RayNode]) -> RunFacts:
        """What the capacity decision needs, from the node labels (else the configured type)."""
        node_labels = nodes[0].labels if nodes else {}
        return RunFacts(
            instance_type=node_labels.get(INSTANCE_TYPE_LABEL) or self.instance_type or None,
            availability_zone=node_labels.get(ZONE_LABEL) or None,
            capacity_type=node_labels.get(CAPACITY_TYPE_LABEL) or None,
            reservation_id=node_labels.get(RESERVATION_LABEL) or None,
            elastic=str(node_labels.get(ELASTIC_LABEL, "")).strip().lower() == "true",
        )

    async def _private_addresses(self, instance_ids: list[str]) -> dict[str, set[str]]:
        """instance id -> its private IPv4 addresses, for the instances EC2 knows.

        A filter on ``instance-id`` (not ``InstanceIds``): an unknown id is then just absent
        instead of failing the whole call with ``InvalidInstanceID.NotFound``.
        """
        out: dict[str, set[str]] = {}
        for start in range(0, len(instance_ids), 200):  # at most 200 values per filter
            chunk = instance_ids[start:start + 200]
            token: str | None = None
            while True:
                kwargs: dict[str, JsonValue] = {"Filters": [{"Name": "instance-id", "Values": chunk}]}
                if token:
                    kwargs["NextToken"] = token
                try:
                    page = await self._ec2.describe_instances(**kwargs)
                except Exception as e:
                    raise translate(e, backend="ec2", operation="DescribeInstances") from e
                for reservation in page.get("Reservations", []):
                    for inst in reservation.get("Instances", []):
                        ips = out.setdefault(inst["InstanceId"], set())
                        if inst.get("PrivateIpAddress"):
                            ips.add(inst["PrivateIpAddress"])
                        for eni in inst.get("NetworkInterfaces", []):
                            for addr in eni.get("PrivateIpAddresses", []):
                                if addr.get("PrivateIpAddress"):
                                    ips.add(addr["PrivateIpAddress"])
                token = page.get("NextToken")
                if not token:
                    break
        return out

    async def cordon(self, target: Target, *, reason: str, deadline: datetime | None) -> bool:
        """Nothing to do in ray mode: a draining Ray node takes no new work already (False)."""
        log.info("ray mode: no cordon; the drain keeps new work off its Ray nodes",
                 instance_id=target.instance_id, reason=reason)
        return False

    async def record(
        self, target: Target, *, reason: str, message: str, warning: bool = False,
        once: str | None = None,
    ) -> None:
        (log.warning if warning else log.info)(
            message, reason=reason, instance_id=target.instance_id, ray_address=target.ray_address,
            ray_node_ids=list(target.ray_node_ids),
        )
