"""Ray mode on EC2: the replacement nodes launched on real EC2 capacity (``ports.NodeProvider``).

:class:`Ec2NodeProvider` launches one instance per lost node with ``RunInstances`` from the user's
launch template (``--ec2-launch-template``), on the decided capacity:

=================  ========================================================================
capacity           what RunInstances is given besides the template
=================  ========================================================================
``spot``           ``InstanceMarketOptions`` ``{MarketType: spot, SpotOptions: {SpotInstanceType:
                   one-time, InstanceInterruptionBehavior: terminate}}``; the lost instance's type
                   and the subnet of its zone (its pool), when EC2 still lists it
``capacity-block`` ``InstanceMarketOptions.MarketType: capacity-block`` and
                   ``CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId``
                   (the decided block), the block's instance type and the subnet of its zone
``on-demand``      no market options; ``CapacityReservationSpecification.CapacityReservationPreference``
                   as ``--ec2-on-demand-reservation-preference`` says (unset: the template's)
=================  ========================================================================

The subnet is ``--ec2-subnets``' entry for the zone (``us-east-1a=subnet-...``); without one for
the zone, the template's network settings (with no ``--ec2-subnets`` at all and a known zone:
``Placement.AvailabilityZone``).

What the new instance joins and which labels its Ray node carries travel as tags on the instance
(``TagSpecifications``, so they exist from the first second): every label the requeue asks for
(``resilienced.io/replaces``, ``resilienced.io/elastic``), ``resilienced.io/capacity-type``, the
block's ``resilienced.io/capacity-reservation-id``, the run's GCS address
(``resilienced.io/gcs-address``), and the provider's own ``resilienced.io/launched-by`` and
``resilienced.io/launch-token``.  ``deploy/aws/ray-node-user-data.sh`` reads them at boot and runs
``ray start --address=<gcs> --labels=<the label tags>,resilienced.io/instance-id=<its id>``
(:func:`labels_from_tags` is that contract; docs/ray.md "Ray on EC2: the replacement nodes").

Idempotent: each instance's ``ClientToken`` is derived from the launch's idempotency key (the
event id), the capacity, the reservation and the lost instance it replaces
(:func:`client_token`), so a retried launch (a crash, a redelivery) gets the instance the first
one made; and the token is a tag too, looked up first, so a launch whose instance is already there
makes no call at all (moto ignores ``ClientToken``; EC2 keeps the promise on its side as well).

Errors: ``InsufficientInstanceCapacity`` and its kin (:data:`NO_CAPACITY_CODES`) are
:class:`~resilienced.ports.NoCapacity`, so the decision falls back (the planner's ICE cache takes
it); a quota (:data:`QUOTA_CODES`) is :class:`QuotaExceeded`, a ``NoCapacity`` whose message names
the quota to raise, logged as an error; everything else follows :mod:`resilienced.aws.errors`.
``release`` terminates only instances tagged ``resilienced.io/launched-by=<owner>`` (the IAM policy
allows no other); ``nodes`` lists them by that tag.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.log import get as get_logger
from resilienced.model import Capacity
from resilienced.ports import CapacitySource, NoCapacity, ProvidedNode
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL, RESERVATION_LABEL

log = get_logger(__name__)

BACKEND = "ec2"

#: The tags only the provider reads (never Ray labels).
LAUNCHED_BY_TAG = "resilienced.io/launched-by"
LAUNCH_TOKEN_TAG = "resilienced.io/launch-token"
GCS_ADDRESS_TAG = "resilienced.io/gcs-address"
#: The prefix of the tags the user-data script turns into Ray labels (all but the three above).
LABEL_TAG_PREFIX = "resilienced.io/"
NOT_LABELS = frozenset({LAUNCHED_BY_TAG, LAUNCH_TOKEN_TAG, GCS_ADDRESS_TAG})

#: Every EC2 / IAM action this module calls; the deploy/ IAM policy grants exactly these
#: (tests/deploy/test_permissions.py).  ``iam:PassRole``: the template's instance profile role.
IAM_ACTIONS: tuple[str, ...] = (
    "ec2:RunInstances",
    "ec2:CreateTags",  # TagSpecifications of RunInstances (ec2:CreateAction RunInstances only)
    "ec2:TerminateInstances",
    "ec2:DescribeInstances",
    "iam:PassRole",
)

#: Answers that mean "no capacity there right now": the decision moves on (Karpenter's
#: unfulfillable-capacity codes, pkg/errors, plus EC2's other Insufficient* codes).
NO_CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
    "InsufficientCapacityOnOutpost", "InsufficientCapacity", "ReservationCapacityExceeded",
    "UnfulfillableCapacity", "SpotMaxPriceTooLow", "InsufficientFreeAddressesInSubnet",
})
#: Answers that mean the account's quota is used up: the decision moves on too, and the quota is
#: named (it does not come back by itself: someone must ask Service Quotas for more).
QUOTA_CODES = frozenset({"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded"})

#: Instance family prefix -> the family group EC2's vCPU quotas are named by.
_QUOTA_GROUPS = (("trn", "Trn"), ("inf", "Inf"), ("dl", "DL"), ("vt", "G and VT"), ("g", "G and VT"),
                 ("p", "P"), ("x", "X"), ("f", "F"), ("hpc", "HPC"))
_TEMPLATE_ID = re.compile(r"^lt-[0-9a-f]{8,17}$")
_LIVE_STATES = ("pending", "running")


class QuotaExceeded(NoCapacity):
    """RunInstances was refused for an account quota (``VcpuLimitExceeded``,
    ``MaxSpotInstanceCountExceeded``): no capacity of this kind until the quota is raised."""

    def __init__(self, capacity: Capacity, *, code: str, quota: str, detail: str) -> None:
        super().__init__(capacity, f"EC2 quota {quota!r} is used up ({code}: {detail}); raise it in "
                                   f"Service Quotas (service ec2) or the run keeps falling back",
                         cause=f"EC2 quota {quota!r} is used up ({code})")
        self.code = code
        self.quota = quota


class LeftToAutoscaler(NoCapacity):
    """The decided capacity is one Ray's autoscaler gives on this cluster: it replaces the node
    (docs/ray.md "Ray's own autoscaler"); the daemon launches nothing of it."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__(capacity, f"Ray's autoscaler gives {capacity.value} nodes on this cluster "
                                   f"(--ec2-autoscaler-capacities): it replaces the lost node, the daemon "
                                   f"launches none")


def quota_name(code: str, *, capacity: Capacity, instance_type: str | None) -> str:
    """The Service Quotas name of the quota an answer ``code`` hit (EC2's vCPU-based quotas are
    per family group: ``Running On-Demand P instances``, ``All P Spot Instance Requests``)."""
    if code == "InstanceLimitExceeded":
        return "the account's instance count limit"
    family = (instance_type or "").split(".", 1)[0].lower()
    group = next((g for prefix, g in _QUOTA_GROUPS if family.startswith(prefix)), None)
    if group is None:
        group = "Standard (A, C, D, H, I, M, R, T, Z)" if family else "<the instance type's family>"
    if code == "MaxSpotInstanceCountExceeded" or capacity is Capacity.SPOT:
        return f"All {group} Spot Instance Requests"
    return f"Running On-Demand {group} instances"


def client_token(*, owner: str, key: str | None, capacity: Capacity, reservation_id: str | None,
                 labels: Mapping[str, str]) -> str:
    """The RunInstances ``ClientToken`` of one replacement (EC2: at most 64 ASCII characters):
    the same provider, event, capacity, reservation and lost instance always give the same token."""
    basis = "\n".join([owner, key or "", capacity.value, reservation_id or "",
                       *(f"{k}={v}" for k, v in sorted(labels.items()))])
    return "rsd-" + hashlib.sha256(basis.encode()).hexdigest()[:56]


def labels_from_tags(tags: Mapping[str, str], *, instance_id: str) -> dict[str, str]:
    """The Ray labels an instance's node starts with, from its tags: what
    deploy/aws/ray-node-user-data.sh does (every ``resilienced.io/`` tag but the provider's own,
    and ``resilienced.io/instance-id``)."""
    labels = {k: v for k, v in tags.items() if k.startswith(LABEL_TAG_PREFIX) and k not in NOT_LABELS}
    labels[INSTANCE_ID_LABEL] = instance_id
    return labels


def parse_subnets(entries: Sequence[str]) -> dict[str, str]:
    """``zone=subnet-id`` entries (``--ec2-subnets``) -> {zone: subnet id}; ValueError naming a bad one."""
    out: dict[str, str] = {}
    for entry in entries:
        zone, sep, subnet = (part.strip() for part in entry.partition("="))
        if not sep or not zone or not re.fullmatch(r"subnet-[0-9a-f]{8,17}", subnet):
            raise ValueError(f"{entry!r}: expected <zone>=subnet-<hex>, e.g. us-east-1a=subnet-0abc12345")
        if zone in out:
            raise ValueError(f"zone {zone} is given twice")
        out[zone] = subnet
    return out


def _tags(item: Mapping[str, Any]) -> dict[str, str]:
    return {t["Key"]: t.get("Value", "") for t in item.get("Tags") or ()}


class Ec2NodeProvider:
    """:class:`~resilienced.ports.NodeProvider` launching EC2 instances from a launch template.

    Args:
        client: an aiobotocore ``ec2`` client (owned by the caller).
        launch_template: the template's id (``lt-...``) or name.
        launch_template_version: its version (``$Default``, ``$Latest`` or a number).
        gcs_address: the Ray cluster's GCS address the new nodes join (``host:port``).
        owner: the value of ``resilienced.io/launched-by``: which provider's instances these are
            (one per Ray cluster; ``release`` and ``nodes`` see only these).
        subnets: zone -> subnet id.
        on_demand_reservation_preference: ``open`` | ``none`` | ``capacity-reservations-only`` for
            On-Demand launches (None: the template's).
        reservations: where a Capacity Block's instance type and zone are read (the daemon's
            ``CapacitySource``); None: the template's type, and no subnet choice for a block.
        autoscaler_capacities: the capacities Ray's own autoscaler gives on this cluster (its node
            types: ``--ec2-autoscaler-capacities``); a launch of one of them is left to it
            (:class:`LeftToAutoscaler`, a ``NoCapacity``: the decision moves on to what only the
            daemon launches, a Capacity Block, else waits while the autoscaler replaces the node).
    """

    def __init__(self, client: AioBaseClient, *, launch_template: str, gcs_address: str,
                 launch_template_version: str = "$Default", owner: str = "resilienced",
                 subnets: Mapping[str, str] | None = None,
                 on_demand_reservation_preference: str | None = None,
                 reservations: CapacitySource | None = None,
                 autoscaler_capacities: Sequence[Capacity | str] = ()) -> None:
        self._client = client
        key = "LaunchTemplateId" if _TEMPLATE_ID.match(launch_template) else "LaunchTemplateName"
        self._template = {key: launch_template, "Version": launch_template_version}
        self._gcs_address = gcs_address
        self.owner = owner
        self._subnets = dict(subnets or {})
        self._on_demand_preference = on_demand_reservation_preference
        self._reservations = reservations
        self._autoscaler = frozenset(Capacity(c) for c in autoscaler_capacities)

    # ------------------------------------------------------------------ NodeProvider
    async def available(self, capacity: Capacity) -> int | None:
        return None  # EC2 says so only by launching

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None, idempotency_key: str | None = None,
                     ) -> list[ProvidedNode]:
        """One RunInstances per entry of ``node_labels`` (each its own tags and token).

        Returns the instances launched (or found already launched for the same token); stops at
        the first insufficient-capacity or quota answer and returns what it got, or raises that
        :class:`NoCapacity` when it got nothing.
        """
        capacity = Capacity(capacity)
        if capacity is Capacity.WAIT:
            raise ValueError("capacity 'wait' is not a pool")
        if capacity in self._autoscaler:
            raise LeftToAutoscaler(capacity)
        placement = await self._placement(capacity, reservation_id, node_labels)
        got: list[ProvidedNode] = []
        for labels in node_labels:
            token = client_token(owner=self.owner, key=idempotency_key, capacity=capacity, reservation_id=reservation_id,
                                 labels=labels)
            try:
                got.append(await self._launch_one(capacity, reservation_id, labels, token, placement))
            except NoCapacity:
                if not got:
                    raise
                break
        return got

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        """TerminateInstances of ``nodes`` that carry this provider's ``launched-by`` tag (others,
        and instances already gone, are left alone)."""
        ids = sorted({n.instance_id for n in nodes})
        if not ids:
            return
        own = {i["InstanceId"] for i in await self._describe([
            {"Name": "instance-id", "Values": ids}, {"Name": f"tag:{LAUNCHED_BY_TAG}", "Values": [self.owner]},
            {"Name": "instance-state-name", "Values": [*_LIVE_STATES, "stopping", "stopped"]}])}
        if skipped := [i for i in ids if i not in own]:
            log.warning("not terminating instances this provider did not launch (or already gone)",
                        instance_ids=skipped, owner=self.owner)
        if not own:
            return
        try:
            await self._client.terminate_instances(InstanceIds=sorted(own))
        except Exception as e:
            raise errors.translate(e, backend=BACKEND, operation="TerminateInstances") from e
        log.info("terminated replacement instances", instance_ids=sorted(own), owner=self.owner)

    async def nodes(self) -> list[ProvidedNode]:
        """The pending and running instances tagged ``launched-by=<owner>``."""
        items = await self._describe([{"Name": f"tag:{LAUNCHED_BY_TAG}", "Values": [self.owner]},
                                      {"Name": "instance-state-name", "Values": list(_LIVE_STATES)}])
        return [node for item in items if (node := self._node(item)) is not None]

    # ------------------------------------------------------------------ parts
    async def _launch_one(self, capacity: Capacity, reservation_id: str | None, labels: Mapping[str, str],
                          token: str, placement: Mapping[str, Any]) -> ProvidedNode:
        found = await self._describe([{"Name": f"tag:{LAUNCH_TOKEN_TAG}", "Values": [token]},
                                      {"Name": f"tag:{LAUNCHED_BY_TAG}", "Values": [self.owner]},
                                      {"Name": "instance-state-name", "Values": list(_LIVE_STATES)}])
        if found and (node := self._node(found[0])) is not None:
            log.info("replacement already launched", instance_id=node.instance_id, client_token=token)
            return node
        params = self.run_instances_params(capacity, reservation_id, labels, token, placement)
        try:
            answer = await self._client.run_instances(**params)
        except Exception as e:
            raise self._launch_error(e, capacity, params.get("InstanceType")) from e
        item = answer["Instances"][0]
        item.setdefault("Tags", params["TagSpecifications"][0]["Tags"])
        node = self._node(item)
        if node is None:  # EC2 answered without the tags it was asked to put on
            raise errors.translate(ValueError(f"RunInstances answered {item.get('InstanceId')} without its "
                                              f"tags"), backend=BACKEND, operation="RunInstances")
        log.info("launched replacement instance", instance_id=node.instance_id, capacity=capacity.value,
                 reservation_id=reservation_id, client_token=token, replaces=dict(labels))
        return node

    def run_instances_params(self, capacity: Capacity, reservation_id: str | None, labels: Mapping[str, str],
                             token: str, placement: Mapping[str, Any]) -> dict[str, Any]:
        """The RunInstances request of one replacement (docs/ray.md lists them per capacity)."""
        tags = {**dict(labels), CAPACITY_TYPE_LABEL: capacity.value, GCS_ADDRESS_TAG: self._gcs_address,
                LAUNCHED_BY_TAG: self.owner, LAUNCH_TOKEN_TAG: token}
        if reservation_id:
            tags[RESERVATION_LABEL] = reservation_id
        tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
        params: dict[str, Any] = {
            "LaunchTemplate": dict(self._template), "MinCount": 1, "MaxCount": 1, "ClientToken": token,
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                                  {"ResourceType": "volume", "Tags": [{"Key": LAUNCHED_BY_TAG, "Value": self.owner}]}],
            **placement,
        }
        if capacity is Capacity.SPOT:
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        elif capacity is Capacity.CAPACITY_BLOCK:
            if not reservation_id:
                raise ValueError("a capacity-block launch needs the block's reservation id")
            params["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
            params["CapacityReservationSpecification"] = {
                "CapacityReservationTarget": {"CapacityReservationId": reservation_id}}
        elif self._on_demand_preference:
            params["CapacityReservationSpecification"] = {
                "CapacityReservationPreference": self._on_demand_preference}
        return params

    async def _placement(self, capacity: Capacity, reservation_id: str | None,
                         node_labels: Sequence[Mapping[str, str]]) -> dict[str, Any]:
        """InstanceType and SubnetId (or Placement): the block's, else the lost instance's pool."""
        instance_type = zone = None
        if capacity is Capacity.CAPACITY_BLOCK and reservation_id and self._reservations is not None:
            block = next((r for r in await self._reservations.reservations()
                          if r.reservation_id == reservation_id), None)
            if block is not None:
                instance_type, zone = block.instance_type, block.availability_zone
        elif capacity is not Capacity.CAPACITY_BLOCK:
            lost = sorted({v for labels in node_labels if (v := labels.get("resilienced.io/replaces"))})
            items = await self._describe([{"Name": "instance-id", "Values": lost}]) if lost else []
            if items:
                instance_type = items[0].get("InstanceType")
                zone = (items[0].get("Placement") or {}).get("AvailabilityZone")
        out: dict[str, Any] = {"InstanceType": instance_type} if instance_type else {}
        if zone and zone in self._subnets:
            out["SubnetId"] = self._subnets[zone]
        elif zone and self._subnets:
            raise NoCapacity(capacity, f"no --ec2-subnets entry for zone {zone} "
                                       f"(configured: {', '.join(sorted(self._subnets))})")
        elif zone and capacity is Capacity.CAPACITY_BLOCK:
            out["Placement"] = {"AvailabilityZone": zone}
        return out

    def _launch_error(self, error: Exception, capacity: Capacity, instance_type: str | None) -> Exception:
        code = errors.error_code(error)
        detail = (getattr(error, "response", None) or {}).get("Error", {}).get("Message") or str(error)
        if code in QUOTA_CODES:
            quota = quota_name(code, capacity=capacity, instance_type=instance_type)
            failure = QuotaExceeded(capacity, code=code, quota=quota, detail=detail)
            log.error("RunInstances refused: quota", capacity=capacity.value, code=code, quota=quota,
                      message=str(failure))
            return failure
        if code in NO_CAPACITY_CODES:
            log.warning("RunInstances: no capacity", capacity=capacity.value, code=code, message=detail)
            return NoCapacity(capacity, f"{code}: {detail}")
        return errors.translate(error, backend=BACKEND, operation="RunInstances")

    async def _describe(self, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            async for page in self._client.get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page.get("Reservations") or ():
                    out.extend(reservation.get("Instances") or ())
        except Exception as e:
            raise errors.translate(e, backend=BACKEND, operation="DescribeInstances") from e
        return out

    def _node(self, item: Mapping[str, Any]) -> ProvidedNode | None:
        tags = _tags(item)
        try:
            capacity = Capacity(tags.get(CAPACITY_TYPE_LABEL, ""))
        except ValueError:
            return None
        return ProvidedNode(item["InstanceId"], capacity, labels_from_tags(tags, instance_id=item["InstanceId"]))
