"""Ec2NodeProvider against moto's EC2 over HTTP (a fault proxy in front: EC2's capacity and quota
answers, and the Capacity Block calls moto lacks, from tests/support/ec2blocks.py).

What each capacity's RunInstances carries is read back from moto where moto keeps it (tags, subnet,
instance type, launch template, lifecycle) and captured from the request botocore sent where moto
does not keep it (``InstanceMarketOptions``, ``CapacityReservationSpecification``, ``ClientToken``):
a ``before-parameter-build`` hook on the client sees the exact parameters the call was made with.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiobotocore.session import AioSession

from resilienced.aws.ec2nodes import (
    GCS_ADDRESS_TAG,
    LAUNCH_TOKEN_TAG,
    LAUNCHED_BY_TAG,
    Ec2NodeProvider,
    LeftToAutoscaler,
    QuotaExceeded,
    client_token,
    labels_from_tags,
    parse_subnets,
    quota_name,
)
from datetime import datetime, timezone

from resilienced.capacity.ec2 import Ec2Capacity
from resilienced.capacity.planner import CapacityPlanner
from resilienced.capacity.policy import CapacityPolicy
from resilienced.errors import PermanentError
from resilienced.local.aws import MotoServer
from resilienced.model import Capacity, CapacityDecision, Event, Kind, RunFacts, Target
from resilienced.ports import NoCapacity, ProvidedNode
from resilienced.ray.requeue import RayModeRequeuer
from resilienced.recovery.move import Mover
from tests.support.ec2blocks import Ec2Blocks
from tests.support.faultproxy import FaultProxy, aws_action

pytestmark = pytest.mark.integration

REGION = "us-east-1"
GCS = "10.0.0.5:6379"
REPLACES = "resilienced.io/replaces"


class World:
    """moto behind a fault proxy, a VPC with a subnet per zone, a launch template, and every
    RunInstances request the provider's client sent."""

    def __init__(self, ec2: Any, proxy: FaultProxy, blocks: Ec2Blocks) -> None:
        self.ec2, self.proxy, self.blocks = ec2, proxy, blocks
        self.sent: list[dict[str, Any]] = []
        self.subnets: dict[str, str] = {}
        self.template_id = ""

    def capture(self, params: dict[str, Any], **_: Any) -> None:
        self.sent.append(copy.deepcopy(params))

    def provider(self, **kwargs: Any) -> Ec2NodeProvider:
        kwargs.setdefault("subnets", self.subnets)
        kwargs.setdefault("reservations", Ec2Capacity(self.ec2))
        return Ec2NodeProvider(self.ec2, launch_template=self.template_id, gcs_address=GCS, **kwargs)

    async def instance(self, instance_id: str) -> dict[str, Any]:
        answer = await self.ec2.describe_instances(InstanceIds=[instance_id])
        return answer["Reservations"][0]["Instances"][0]

    async def live(self) -> list[dict[str, Any]]:
        answer = await self.ec2.describe_instances(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        return [i for r in answer["Reservations"] for i in r["Instances"]]

    async def lost_instance(self, *, instance_type: str, zone: str) -> str:
        """The interrupted instance the replacement stands in for (its pool: type and zone)."""
        answer = await self.ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                              InstanceType=instance_type, SubnetId=self.subnets[zone])
        return answer["Instances"][0]["InstanceId"]


@pytest.fixture
async def world(aws: MotoServer) -> AsyncIterator[World]:
    proxy = await FaultProxy(aws.endpoint_url).start()
    blocks = Ec2Blocks()
    blocks.install(proxy)
    try:
        async with AioSession().create_client("ec2", region_name=REGION, endpoint_url=proxy.url) as ec2:
            w = World(ec2, proxy, blocks)
            vpc = (await ec2.create_vpc(CidrBlock="10.0.0.0/16"))["Vpc"]["VpcId"]
            for n, zone in enumerate(("us-east-1a", "us-east-1b")):
                subnet = await ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.0.{n}.0/24", AvailabilityZone=zone)
                w.subnets[zone] = subnet["Subnet"]["SubnetId"]
            template = await ec2.create_launch_template(LaunchTemplateName="ray-workers", LaunchTemplateData={
                "ImageId": "ami-12c6146b", "InstanceType": "m5.large"})
            w.template_id = template["LaunchTemplate"]["LaunchTemplateId"]
            ec2.meta.events.register("before-parameter-build.ec2.RunInstances", w.capture)
            yield w
    finally:
        await proxy.stop()


def _tags(item: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in item.get("Tags") or ()}


def _own(w: World, sent: dict[str, Any]) -> bool:
    return sent.get("LaunchTemplate", {}).get("LaunchTemplateId") == w.template_id


# --------------------------------------------------------------------------- each capacity's request
async def test_spot_is_a_one_time_spot_request_in_the_lost_instances_pool(world: World) -> None:
    lost = await world.lost_instance(instance_type="m5.xlarge", zone="us-east-1b")
    provider = world.provider(owner="cluster-a")
    [node] = await provider.launch(capacity=Capacity.SPOT, node_labels=[{REPLACES: lost}], idempotency_key="ev-1")

    [sent] = [s for s in world.sent if _own(world, s)]
    token = client_token(owner="cluster-a", key="ev-1", capacity=Capacity.SPOT, reservation_id=None, labels={REPLACES: lost})
    assert sent["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    assert "CapacityReservationSpecification" not in sent
    assert sent["ClientToken"] == token and len(token) <= 64
    assert (sent["MinCount"], sent["MaxCount"]) == (1, 1)
    assert sent["LaunchTemplate"] == {"LaunchTemplateId": world.template_id, "Version": "$Default"}

    item = await world.instance(node.instance_id)  # what moto keeps
    assert item["InstanceType"] == "m5.xlarge" and item["SubnetId"] == world.subnets["us-east-1b"]
    assert item["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert item["InstanceLifecycle"] == "spot"
    assert _tags(item) == {REPLACES: lost, "resilienced.io/capacity-type": "spot", GCS_ADDRESS_TAG: GCS,
                           LAUNCHED_BY_TAG: "cluster-a", LAUNCH_TOKEN_TAG: token,
                           # EC2's own tags of an instance launched from a template (moto sets them too)
                           "aws:ec2launchtemplate:id": world.template_id, "aws:ec2launchtemplate:version": "1"}
    assert node == ProvidedNode(node.instance_id, Capacity.SPOT, {
        REPLACES: lost, "resilienced.io/capacity-type": "spot", "resilienced.io/instance-id": node.instance_id})


async def test_a_capacity_block_targets_the_block_with_its_type_and_zone(world: World) -> None:
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=2)
    provider = world.provider()
    nodes = await provider.launch(capacity=Capacity.CAPACITY_BLOCK, reservation_id=block.reservation_id,
                                  node_labels=[{REPLACES: "i-0aaaaaaaaaaaaaaa1"}, {REPLACES: "i-0aaaaaaaaaaaaaaa2"}],
                                  idempotency_key="ev-2")

    sent = [s for s in world.sent if _own(world, s)]
    assert len(sent) == 2 and len({s["ClientToken"] for s in sent}) == 2  # one token per replacement
    for s in sent:
        assert s["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
        assert s["CapacityReservationSpecification"] == {
            "CapacityReservationTarget": {"CapacityReservationId": block.reservation_id}}
        assert s["InstanceType"] == "p5.48xlarge" and s["SubnetId"] == world.subnets["us-east-1a"]
    for node in nodes:
        item = await world.instance(node.instance_id)
        assert item["InstanceType"] == "p5.48xlarge" and item["SubnetId"] == world.subnets["us-east-1a"]
        assert _tags(item)["resilienced.io/capacity-reservation-id"] == block.reservation_id
        assert _tags(item)["resilienced.io/capacity-type"] == "capacity-block"
        assert node.labels["resilienced.io/capacity-reservation-id"] == block.reservation_id
    assert sorted(n.labels[REPLACES] for n in nodes) == ["i-0aaaaaaaaaaaaaaa1", "i-0aaaaaaaaaaaaaaa2"]


async def test_on_demand_has_no_market_and_the_reservation_preference_set(world: World) -> None:
    lost = await world.lost_instance(instance_type="m5.2xlarge", zone="us-east-1a")
    [plain] = await world.provider(owner="plain").launch(capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: lost}])
    [pref] = await world.provider(on_demand_reservation_preference="none").launch(
        capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: lost}])

    first, second = [s for s in world.sent if _own(world, s)]
    assert "InstanceMarketOptions" not in first and "CapacityReservationSpecification" not in first
    assert "InstanceMarketOptions" not in second
    assert second["CapacityReservationSpecification"] == {"CapacityReservationPreference": "none"}
    for node in (plain, pref):
        item = await world.instance(node.instance_id)
        assert "InstanceLifecycle" not in item and item["InstanceType"] == "m5.2xlarge"
        assert _tags(item)["resilienced.io/capacity-type"] == "on-demand"


async def test_an_unknown_lost_instance_takes_the_templates_type_and_network(world: World) -> None:
    [node] = await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: "i-0123456789abcdef0"}])
    [sent] = [s for s in world.sent if _own(world, s)]
    assert "InstanceType" not in sent and "SubnetId" not in sent and "Placement" not in sent
    assert (await world.instance(node.instance_id))["InstanceType"] == "m5.large"  # the template's


async def test_a_zone_without_a_subnet_is_no_capacity_naming_it(world: World) -> None:
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1c", total=1)
    with pytest.raises(NoCapacity, match="no --ec2-subnets entry for zone us-east-1c"):
        await world.provider().launch(capacity=Capacity.CAPACITY_BLOCK, reservation_id=block.reservation_id,
                                      node_labels=[{REPLACES: "i-0aaaaaaaaaaaaaaa1"}])
    assert not [s for s in world.sent if _own(world, s)]


# --------------------------------------------------------------------------- idempotency
async def test_the_same_launch_twice_makes_one_instance(world: World) -> None:
    labels = [{REPLACES: "i-0bbbbbbbbbbbbbbb1", "resilienced.io/elastic": "true"}]
    first = await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=labels, idempotency_key="ev-3")
    again = await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=labels, idempotency_key="ev-3")

    assert [n.instance_id for n in again] == [n.instance_id for n in first]
    assert len([s for s in world.sent if _own(world, s)]) == 1  # the second found it by its token
    assert [i["InstanceId"] for i in await world.live()] == [first[0].instance_id]
    assert first[0].labels["resilienced.io/elastic"] == "true"

    other = await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=labels, idempotency_key="ev-4")
    assert other[0].instance_id != first[0].instance_id  # another event is another launch


async def test_the_token_is_asked_of_ec2_even_when_the_lookup_misses(world: World) -> None:
    """A retry EC2 sees (the lookup came too early for EC2's eventual consistency) carries the same
    ClientToken: EC2 answers with the first instance."""
    labels = [{REPLACES: "i-0bbbbbbbbbbbbbbb2"}]
    world.proxy.answer(_EMPTY_DESCRIBE, match=lambda r, b: b"Action=DescribeInstances" in b, times=4)
    await world.provider().launch(capacity=Capacity.SPOT, node_labels=labels, idempotency_key="ev-5")
    await world.provider().launch(capacity=Capacity.SPOT, node_labels=labels, idempotency_key="ev-5")
    first, second = [s for s in world.sent if _own(world, s)]
    assert first["ClientToken"] == second["ClientToken"]


_EMPTY_DESCRIBE = ('<?xml version="1.0" encoding="UTF-8"?><DescribeInstancesResponse '
                   'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>0</requestId>'
                   '<reservationSet/></DescribeInstancesResponse>')


# --------------------------------------------------------------------------- no capacity, quotas
async def test_insufficient_capacity_is_no_capacity_and_the_next_capacity_launches(world: World) -> None:
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=1)
    spot = world.proxy.fail(500, code="InsufficientInstanceCapacity", style="ec2",
                            match=lambda r, b: b"Action=RunInstances" in b and b"MarketType=spot" in b)
    provider = world.provider()
    with pytest.raises(NoCapacity) as caught:
        await provider.launch(capacity=Capacity.SPOT, node_labels=[{REPLACES: "i-0ccccccccccccccc1"}])
    assert caught.value.capacity is Capacity.SPOT and "InsufficientInstanceCapacity" in str(caught.value)
    assert not isinstance(caught.value, QuotaExceeded) and spot.hits >= 1
    assert await world.live() == [] and await provider.nodes() == []

    # the fallback's launch (what the decision does next) goes through
    [node] = await provider.launch(capacity=Capacity.CAPACITY_BLOCK, reservation_id=block.reservation_id,
                                   node_labels=[{REPLACES: "i-0ccccccccccccccc1"}])
    assert [n.instance_id for n in await provider.nodes()] == [node.instance_id]


async def test_a_pool_that_runs_out_midway_gives_what_it_got(world: World) -> None:
    world.proxy.fail(500, code="InsufficientInstanceCapacity", style="ec2",
                     match=lambda r, b: b"Action=RunInstances" in b and b"i-0ddddddddddddddd2" in b)
    got = await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=[
        {REPLACES: "i-0ddddddddddddddd1"}, {REPLACES: "i-0ddddddddddddddd2"}])
    assert [n.labels[REPLACES] for n in got] == ["i-0ddddddddddddddd1"]


@pytest.mark.parametrize(("code", "capacity", "instance_type", "quota"), [
    ("VcpuLimitExceeded", Capacity.ON_DEMAND, "p5.48xlarge", "Running On-Demand P instances"),
    ("MaxSpotInstanceCountExceeded", Capacity.SPOT, "m5.xlarge",
     "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
], ids=["vcpu", "spot-count"])
async def test_a_quota_error_names_the_quota_and_is_no_capacity(
        world: World, code: str, capacity: Capacity, instance_type: str, quota: str) -> None:
    lost = await world.lost_instance(instance_type=instance_type, zone="us-east-1a")
    world.proxy.fail(400, code=code, style="ec2", match=aws_action("RunInstances"))
    with pytest.raises(QuotaExceeded) as caught:
        await world.provider().launch(capacity=capacity, node_labels=[{REPLACES: lost}])
    assert isinstance(caught.value, NoCapacity)  # the decision falls back
    text = str(caught.value)
    assert f"EC2 quota {quota!r} is used up ({code}:" in text and "Service Quotas" in text
    assert caught.value.code == code and caught.value.quota == quota


async def test_any_other_refusal_is_permanent(world: World) -> None:
    world.proxy.fail(403, code="UnauthorizedOperation", style="ec2", match=aws_action("RunInstances"))
    with pytest.raises(PermanentError, match="RunInstances: UnauthorizedOperation"):
        await world.provider().launch(capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: "i-0eeeeeeeeeeeeeee1"}])


# --------------------------------------------------------------------------- through the requeue
def _target(lost: str) -> Target:
    return Target(instance_id=lost, node="10.0.0.9", ray_cluster=None, ray_job=None, ray_node_ids=(),
                  checkpoint_uri=None, ray_address=GCS,
                  facts=RunFacts(instance_type="p5.48xlarge", availability_zone="us-east-1a",
                                 capacity_type="spot", lost_instance_ids=(lost,)))


def _event(event_id: str, lost: str) -> Event:
    return Event(kind=Kind.SPOT_INTERRUPTION, event_id=event_id, time=datetime.now(timezone.utc), instance_ids=(lost,))


async def test_ice_on_spot_falls_back_to_the_block_through_the_decision(world: World) -> None:
    """The Mover decides Spot, EC2 answers InsufficientInstanceCapacity, the pool is marked out and
    the run goes to the Capacity Block, launched on moto with a token of the event's id."""
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=1)
    world.proxy.fail(500, code="InsufficientInstanceCapacity", style="ec2",
                     match=lambda r, b: b"Action=RunInstances" in b and b"MarketType=spot" in b)
    capacity = Ec2Capacity(world.ec2)
    planner = CapacityPlanner(source=capacity, policy=CapacityPolicy())
    provider = world.provider(reservations=capacity)
    lost, event = "i-0abcabcabcabcabc1", _event("ev-ice-1", "i-0abcabcabcabcabc1")
    _, decision = await planner.plan_for(_target(lost), event=event)
    assert decision.capacity is Capacity.SPOT  # one interruption: Spot still looks healthy

    result = await Mover(planner=planner, requeue=RayModeRequeuer(provider)).apply(_target(lost), decision=decision,
                                                                                   event=event)

    assert result.capacity is Capacity.CAPACITY_BLOCK and result.reservation_id == block.reservation_id, result.reason
    assert "spot gave 0 of 1" in result.reason
    [node] = await provider.nodes()
    assert node.labels[REPLACES] == lost and node.capacity is Capacity.CAPACITY_BLOCK
    sent = [s for s in world.sent if _own(world, s)]
    assert [s.get("InstanceMarketOptions", {}).get("MarketType") for s in sent][-1] == "capacity-block"
    assert sent[-1]["ClientToken"] == client_token(owner="resilienced", key="ev-ice-1", capacity=Capacity.CAPACITY_BLOCK,
                                                   reservation_id=block.reservation_id, labels={REPLACES: lost})


async def test_the_requeuers_no_capacity_carries_the_quota_named(world: World) -> None:
    lost = await world.lost_instance(instance_type="p5.48xlarge", zone="us-east-1a")
    world.proxy.fail(400, code="VcpuLimitExceeded", style="ec2", match=aws_action("RunInstances"))
    decision = CapacityDecision(Capacity.ON_DEMAND, "test")
    with pytest.raises(NoCapacity, match="gave 0 of 1: no on-demand capacity: EC2 quota 'Running On-Demand"):
        await RayModeRequeuer(world.provider()).requeue(_target(lost), decision=decision, event=_event("ev-q", lost))


async def test_a_quota_on_spot_is_named_in_the_fallbacks_reason(world: World) -> None:
    """Spot refused for the account's quota: the Mover decides again (the block) and the reason it
    gives for passing Spot over names the quota to raise, not only "gave 0 of 1"."""
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=1)
    world.proxy.fail(400, code="MaxSpotInstanceCountExceeded", style="ec2",
                     match=lambda r, b: b"Action=RunInstances" in b and b"MarketType=spot" in b)
    capacity = Ec2Capacity(world.ec2)
    planner = CapacityPlanner(source=capacity, policy=CapacityPolicy())
    lost, event = "i-0abcabcabcabcabc2", _event("ev-quota-1", "i-0abcabcabcabcabc2")
    _, decision = await planner.plan_for(_target(lost), event=event)
    assert decision.capacity is Capacity.SPOT

    result = await Mover(planner=planner, requeue=RayModeRequeuer(world.provider(reservations=capacity))).apply(
        _target(lost), decision=decision, event=event)

    assert result.capacity is Capacity.CAPACITY_BLOCK and result.reservation_id == block.reservation_id, result.reason
    [tried] = result.details["tried"]
    assert tried.startswith("spot gave 0 of 1 (EC2 quota ") and tried.endswith(
        " Spot Instance Requests\" is used up (MaxSpotInstanceCountExceeded))"), tried
    assert "Spot Instance Requests" in result.reason and "MaxSpotInstanceCountExceeded" in result.reason


async def test_ray_modes_runtime_launches_with_the_settings(world: World, aws: MotoServer) -> None:
    """``resilienced run --mode ray --ec2-launch-template ...``: the runtime's requeuer launches
    through an Ec2NodeProvider with the settings (owner, subnets, the GCS address to join)."""
    from resilienced.app.runtime import open_runtime
    from resilienced.ops.metrics import Metrics
    from resilienced.settings import Settings

    settings = Settings.from_args([
        "--queue-url", "https://sqs.us-east-1.amazonaws.com/123456789012/q",
        "--mode", "ray", "--ray-address", "10.0.0.5:6379", "--region", REGION, "--endpoint-url", world.proxy.url,
        "--ec2-launch-template", world.template_id, "--ec2-owner", "train-a", "--follow-up", "false",
        "--ec2-subnets", ",".join(f"{z}={s}" for z, s in world.subnets.items())], {}).validate()
    async with open_runtime(settings, metrics=Metrics(), replica="r1") as runtime:
        provider = runtime.responder.mover.requeue.requeuer.provider
        assert isinstance(provider, Ec2NodeProvider) and provider.owner == "train-a"
        block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1b", total=1)
        [node] = await provider.launch(capacity=Capacity.CAPACITY_BLOCK, reservation_id=block.reservation_id,
                                       node_labels=[{REPLACES: "i-0abcabcabcabcabc3"}], idempotency_key="ev-rt")
    item = await world.instance(node.instance_id)
    assert item["SubnetId"] == world.subnets["us-east-1b"]  # the block's zone, read through the runtime's EC2
    assert _tags(item)[GCS_ADDRESS_TAG] == "10.0.0.5:6379" and _tags(item)[LAUNCHED_BY_TAG] == "train-a"


# --------------------------------------------------------------------------- Ray's autoscaler
async def test_a_capacity_the_autoscaler_gives_is_left_to_it_and_a_block_is_launched(world: World) -> None:
    block = world.blocks.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=1)
    provider = world.provider(autoscaler_capacities=("spot", "on-demand"))
    for capacity in (Capacity.SPOT, Capacity.ON_DEMAND):
        with pytest.raises(LeftToAutoscaler, match=f"Ray's autoscaler gives {capacity.value} nodes"):
            await provider.launch(capacity=capacity, node_labels=[{REPLACES: "i-0aaaaaaaaaaaaaaa9"}])
    assert not [s for s in world.sent if _own(world, s)] and await world.live() == []
    [node] = await provider.launch(capacity=Capacity.CAPACITY_BLOCK, reservation_id=block.reservation_id,
                                   node_labels=[{REPLACES: "i-0aaaaaaaaaaaaaaa9"}])
    assert node.capacity is Capacity.CAPACITY_BLOCK  # what the autoscaler's node types cannot give


# --------------------------------------------------------------------------- release, nodes
async def test_release_terminates_only_its_own_instances(world: World) -> None:
    mine, theirs = world.provider(owner="cluster-a"), world.provider(owner="cluster-b")
    [a] = await mine.launch(capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: "i-0fffffffffffffff1"}])
    [b] = await theirs.launch(capacity=Capacity.ON_DEMAND, node_labels=[{REPLACES: "i-0fffffffffffffff2"}])
    stranger = await world.lost_instance(instance_type="m5.large", zone="us-east-1a")

    assert [n.instance_id for n in await mine.nodes()] == [a.instance_id]
    await mine.release([a, b, ProvidedNode(stranger, Capacity.ON_DEMAND)])

    states = {i: (await world.instance(i))["State"]["Name"] for i in (a.instance_id, b.instance_id, stranger)}
    assert states == {a.instance_id: "terminated", b.instance_id: "running", stranger: "running"}
    assert await mine.nodes() == [] and [n.instance_id for n in await theirs.nodes()] == [b.instance_id]
    await mine.release([a])  # already gone: nothing to do


# --------------------------------------------------------------------------- the pure parts
@pytest.mark.unit
def test_client_tokens_are_stable_short_and_differ_per_event_capacity_and_node() -> None:
    base = dict(owner="cluster-a", key="ev", capacity=Capacity.SPOT, reservation_id=None, labels={REPLACES: "i-1"})
    token = client_token(**base)
    assert token == client_token(**base) and len(token) <= 64 and token.isascii()
    for change in ({"owner": "cluster-b"}, {"key": "ev2"}, {"capacity": Capacity.ON_DEMAND}, {"labels": {REPLACES: "i-2"}},
                   {"capacity": Capacity.CAPACITY_BLOCK, "reservation_id": "cr-1"}):
        assert client_token(**{**base, **change}) != token


@pytest.mark.unit
def test_labels_from_tags_keep_the_label_tags_only() -> None:
    tags = {REPLACES: "i-1", "resilienced.io/capacity-type": "spot", GCS_ADDRESS_TAG: GCS,
            LAUNCHED_BY_TAG: "x", LAUNCH_TOKEN_TAG: "t", "Name": "worker"}
    assert labels_from_tags(tags, instance_id="i-9") == {
        REPLACES: "i-1", "resilienced.io/capacity-type": "spot", "resilienced.io/instance-id": "i-9"}


@pytest.mark.unit
def test_parse_subnets_names_a_bad_entry() -> None:
    assert parse_subnets(["us-east-1a=subnet-0abc12345", " us-east-1b = subnet-0def67890 "]) == {
        "us-east-1a": "subnet-0abc12345", "us-east-1b": "subnet-0def67890"}
    with pytest.raises(ValueError, match="'us-east-1a:subnet-1'"):
        parse_subnets(["us-east-1a:subnet-1"])
    with pytest.raises(ValueError, match="given twice"):
        parse_subnets(["a=subnet-0abc12345", "a=subnet-0abc12346"])


@pytest.mark.unit
def test_quota_names_follow_the_family() -> None:
    assert quota_name("VcpuLimitExceeded", capacity=Capacity.ON_DEMAND, instance_type="g6.xlarge") \
        == "Running On-Demand G and VT instances"
    assert quota_name("VcpuLimitExceeded", capacity=Capacity.ON_DEMAND, instance_type="trn1.32xlarge") \
        == "Running On-Demand Trn instances"
    assert quota_name("MaxSpotInstanceCountExceeded", capacity=Capacity.SPOT, instance_type="p4d.24xlarge") \
        == "All P Spot Instance Requests"
