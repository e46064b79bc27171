"""The drill's EC2 (``resilienced drill --provider ec2``): replacements launched through EC2's API on moto.

The daemon's node provider is then the production one, :class:`resilienced.aws.ec2nodes.Ec2NodeProvider`,
on an aiobotocore ``ec2`` client to the drill's moto server (over HTTP), launching from a launch
template the drill creates, into a subnet of the Capacity Block's zone.  moto runs out of capacity
as the drill's local provider would (``RESILIENCED_MOTO_EC2_CAPACITY``,
:mod:`resilienced.local.motoserver`): no Spot by default, the block's instances, On-Demand in the
stalled story.

:class:`UserDataHook` plays the part of ``deploy/aws/ray-node-user-data.sh`` on each instance: when
moto reports an instance of the provider ``running``, it starts a local Ray node with the labels
read from the instance's tags (:func:`resilienced.aws.ec2nodes.labels_from_tags`, the script's
contract), ``--node-boot-seconds`` later; when the instance is terminated, it stops that node.  In
the stalled story a Capacity Block's instance runs and never joins (its user-data "fails").

Every RunInstances and TerminateInstances the daemon made is recorded from the client's own events
(``ec2_launches``: ``{instance_id, market, reservation_id, client_token}``, and ``error`` for a
refused one; ``ec2_terminations``), for the drill's report.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from resilienced import log

TEMPLATE = "resilienced-drill-workers"
OWNER = "resilienced-drill"
#: The launch template's image (moto's default AMI ids are accepted without validation).
IMAGE_ID = "ami-12c6146b"


class Ec2Recorder:
    """The RunInstances and TerminateInstances calls made on one client, from its events."""

    def __init__(self) -> None:
        self.launches: list[dict[str, Any]] = []
        self.terminations: list[str] = []

    def install(self, client: Any) -> None:
        events = client.meta.events
        events.register("before-parameter-build.ec2.RunInstances", self._asked)
        events.register("after-call.ec2.RunInstances", self._launched)
        events.register("after-call.ec2.TerminateInstances", self._terminated)

    @staticmethod
    def _asked(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["resilienced_run_instances"] = copy.deepcopy(params)

    def _launched(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        params = context.get("resilienced_run_instances") or {}
        target = (params.get("CapacityReservationSpecification") or {}).get("CapacityReservationTarget") or {}
        entry: dict[str, Any] = {
            "instance_id": next((i["InstanceId"] for i in parsed.get("Instances") or ()), None),
            "market": (params.get("InstanceMarketOptions") or {}).get("MarketType") or "on-demand",
            "reservation_id": target.get("CapacityReservationId"),
            "client_token": params.get("ClientToken"),
        }
        if parsed.get("Error"):
            entry["error"] = parsed["Error"].get("Code")
        self.launches.append(entry)

    def _terminated(self, parsed: dict[str, Any], **_: Any) -> None:
        self.terminations += [i["InstanceId"] for i in parsed.get("TerminatingInstances") or ()]


async def provision(client: Any, *, zone: str) -> tuple[str, str]:
    """A VPC with one subnet in ``zone`` and the workers' launch template: (subnet id, template id)."""
    vpc = (await client.create_vpc(CidrBlock="10.42.0.0/16"))["Vpc"]["VpcId"]
    subnet = (await client.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone=zone))["Subnet"]
    template = await client.create_launch_template(LaunchTemplateName=TEMPLATE, LaunchTemplateData={
        "ImageId": IMAGE_ID})
    return subnet["SubnetId"], template["LaunchTemplate"]["LaunchTemplateId"]


class UserDataHook:
    """Plays ``ray-node-user-data.sh``: a running instance of ``owner`` becomes a local Ray node
    with its tags' labels (``boot_seconds`` after it is first seen running); a terminated one's
    node is stopped.  ``never_join``: capacity types whose instances never join (stalled)."""

    def __init__(self, client: Any, cluster: Any, *, owner: str = OWNER, boot_seconds: float = 0.0,
                 never_join: Sequence[str] = (), note: Callable[[str], None] = lambda text: None,
                 poll_s: float = 0.5, stop_timeout_s: float = 30.0) -> None:
        self._client, self._cluster, self._owner = client, cluster, owner
        self._boot_seconds, self._never_join, self._note = boot_seconds, set(never_join), note
        self._poll_s, self._stop_timeout_s = poll_s, stop_timeout_s
        self._seen: set[str] = set()
        self._nodes: dict[str, Any] = {}
        self._boots: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        from resilienced.aws.ec2nodes import LAUNCHED_BY_TAG

        try:
            while True:
                pages = self._client.get_paginator("describe_instances").paginate(
                    Filters=[{"Name": f"tag:{LAUNCHED_BY_TAG}", "Values": [self._owner]}])
                async for page in pages:
                    for reservation in page.get("Reservations") or ():
                        for item in reservation.get("Instances") or ():
                            await self._look(item)
                await asyncio.sleep(self._poll_s)
        finally:
            for task in self._boots.values():
                task.cancel()
            for node in list(self._nodes.values()):
                await asyncio.to_thread(self._stop, node)

    async def _look(self, item: dict[str, Any]) -> None:
        from resilienced.aws.ec2nodes import labels_from_tags
        from resilienced.ray.cluster import CAPACITY_TYPE_LABEL

        instance_id, state = item["InstanceId"], item["State"]["Name"]
        tags = {t["Key"]: t["Value"] for t in item.get("Tags") or ()}
        if state == "running" and instance_id not in self._seen:
            self._seen.add(instance_id)
            if tags.get(CAPACITY_TYPE_LABEL) in self._never_join:
                self._note(f"instance {instance_id} ({tags.get(CAPACITY_TYPE_LABEL)}) runs; its node never joins")
                return
            labels = labels_from_tags(tags, instance_id=instance_id)
            self._boots[instance_id] = asyncio.create_task(self._boot(instance_id, labels), name="drill.user-data")
        elif state in ("shutting-down", "terminated"):
            if (boot := self._boots.pop(instance_id, None)) is not None:
                boot.cancel()
            if (node := self._nodes.pop(instance_id, None)) is not None:
                await asyncio.to_thread(self._stop, node)
                self._note(f"instance {instance_id} terminated: its Ray node stopped")

    async def _boot(self, instance_id: str, labels: dict[str, str]) -> None:
        try:
            await asyncio.sleep(self._boot_seconds)
            self._nodes[instance_id] = await asyncio.to_thread(self._cluster.add_node, labels=labels, num_cpus=1)
            self._note(f"user-data on {instance_id}: ray start --labels={','.join(f'{k}={v}' for k, v in labels.items())}")
        except Exception as e:  # nobody awaits this task: say why the node never joined
            log.get("resilienced.drill").error("user-data failed", instance_id=instance_id,
                                               error=f"{type(e).__name__}: {e}")
            raise

    def _stop(self, node: Any) -> None:
        self._cluster.sigterm_node(node)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=self._stop_timeout_s)
        self._cluster.kill_node(node)
