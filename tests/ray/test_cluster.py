"""RayModeCluster (locate by node label, else by private IP from EC2 on moto), against the real
local Ray cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import pytest
import structlog
from aiobotocore.session import AioSession

from resilienced import log
from resilienced.errors import BackendUnavailable
from resilienced.local.aws import MotoServer, free_port
from resilienced.local.raycluster import LocalRayCluster, LocalRayNode
from resilienced.model import Target
from resilienced.ports import Cluster
from resilienced.ray.cluster import RayModeCluster
from resilienced.ray.gcs import RayGcs
from tests.support.kubeoptions import LOCAL_BOUND_S

from .conftest import WORKER_INSTANCE

LOOPBACK_IP = "127.0.0.2"  # the loopback_node fixture's address

pytestmark = pytest.mark.e2e

URI = "s3://ckpt-bucket/runs/demo"


def gcs(cluster: LocalRayCluster) -> RayGcs:
    return RayGcs(cluster.address, token=cluster.auth_token, timeout=LOCAL_BOUND_S)


@pytest.fixture
async def ec2(aws: MotoServer) -> AsyncIterator[Any]:
    async with AioSession().create_client("ec2", region_name="us-east-1",
                                          endpoint_url=aws.endpoint_url) as client:
        yield client


async def run_instance(ec2: Any, private_ip: str) -> str:
    vpc = (await ec2.create_vpc(CidrBlock="127.0.0.0/16"))["Vpc"]["VpcId"]
    subnet = (await ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.0.0/24"))["Subnet"]["SubnetId"]
    reservation = await ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                          SubnetId=subnet, PrivateIpAddress=private_ip)
    return reservation["Instances"][0]["InstanceId"]


async def test_it_is_a_cluster_port_in_ray_mode(ray_cluster: LocalRayCluster) -> None:
    cluster = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI)
    assert isinstance(cluster, Cluster)
    assert cluster.mode == "ray"


async def test_locate_by_instance_label(ray_cluster: LocalRayCluster) -> None:
    cluster = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI)

    location = await cluster.locate(instance_ids=[WORKER_INSTANCE])

    assert location.unresolved == {}
    (target,) = location.targets
    worker = ray_cluster.workers[0]
    assert target == Target(
        instance_id=WORKER_INSTANCE, node=target.node, ray_cluster=None, ray_job=None,
        ray_node_ids=(worker.node_id,), checkpoint_uri=URI, ray_address=ray_cluster.address,
        attributes=target.attributes, facts=target.facts,
    )
    assert target.node  # the Ray node's address
    assert target.attributes["matched_by"] == "label"
    assert target.run_key == ray_cluster.address


async def test_locate_by_private_ip_from_ec2(ray_cluster: LocalRayCluster, loopback_node: LocalRayNode,
                                             ec2: Any) -> None:
    instance_id = await run_instance(ec2, LOOPBACK_IP)
    cluster = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI, ec2=ec2)

    location = await cluster.locate(instance_ids=[instance_id, WORKER_INSTANCE])

    assert location.unresolved == {}
    by_instance = {t.instance_id: t for t in location.targets}
    on_ip = by_instance[instance_id]
    truth = [n for n in await gcs(ray_cluster).nodes() if n.alive and n.address == LOOPBACK_IP]
    assert on_ip.ray_node_ids == tuple(n.node_id for n in truth) and len(truth) == 1
    assert on_ip.node == LOOPBACK_IP
    assert on_ip.attributes["matched_by"] == "private-ip"
    assert by_instance[WORKER_INSTANCE].attributes["matched_by"] == "label"


async def test_unresolved_instances_say_why(ray_cluster: LocalRayCluster, ec2: Any) -> None:
    elsewhere = await run_instance(ec2, "127.0.0.77")
    with_ec2 = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI, ec2=ec2)
    without_ec2 = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI)

    location = await with_ec2.locate(instance_ids=["i-0fffffffffffffff0", elsewhere])
    assert location.targets == ()
    assert "EC2 does not know the instance" in location.unresolved["i-0fffffffffffffff0"]
    assert "127.0.0.77" in location.unresolved[elsewhere]

    location = await without_ec2.locate(instance_ids=["i-0fffffffffffffff0"])
    assert "no EC2 lookup is configured" in location.unresolved["i-0fffffffffffffff0"]


async def test_a_node_that_died_is_reported_not_drained(ray_cluster: LocalRayCluster, fresh_node) -> None:
    node = fresh_node("i-00000000000000e01")
    # An idle node leaves at once when drained (a SIGKILLed one takes the GCS health-check timeout).
    ray_cluster.drain_node(node, deadline_ms=int(datetime.now(timezone.utc).timestamp() * 1000) + 60_000)
    client = gcs(ray_cluster)

    async def dead() -> bool:
        return not {n.node_id: n for n in await client.nodes()}[node.node_id].alive

    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while not await dead():
        assert loop.time() < end, "the drained node was never marked dead"
        await asyncio.sleep(0.1)

    location = await RayModeCluster(ray=client, checkpoint_uri=URI).locate(instance_ids=["i-00000000000000e01"])
    (target,) = location.targets
    assert target.ray_node_ids == ()
    assert target.attributes["dead_node_ids"] == [node.node_id]
    assert target.node is not None  # the dead node's address, for the record


async def test_a_custom_label_key_and_the_head_is_never_drained(ray_cluster: LocalRayCluster) -> None:
    # Ray labels every node with ray.io/node-id: use it as the "instance" label here.
    cluster = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=None, instance_label="ray.io/node-id")
    worker, head = ray_cluster.workers[0], ray_cluster.head

    location = await cluster.locate(instance_ids=[worker.node_id, head.node_id])

    by_instance = {t.instance_id: t for t in location.targets}
    assert by_instance[worker.node_id].ray_node_ids == (worker.node_id,)
    assert by_instance[worker.node_id].checkpoint_uri is None
    assert by_instance[head.node_id].ray_node_ids == ()
    assert by_instance[head.node_id].attributes["head_on_instance"] is True


async def test_locate_with_the_gcs_down_is_backend_unavailable() -> None:
    cluster = RayModeCluster(ray=RayGcs(f"127.0.0.1:{free_port()}", token="x" * 32, timeout=2),
                             checkpoint_uri=URI)
    with pytest.raises(BackendUnavailable):
        await cluster.locate(instance_ids=[WORKER_INSTANCE])


async def test_cordon_does_nothing_and_record_logs(ray_cluster: LocalRayCluster) -> None:
    cluster = RayModeCluster(ray=gcs(ray_cluster), checkpoint_uri=URI)
    (target,) = (await cluster.locate(instance_ids=[WORKER_INSTANCE])).targets
    before = {n.node_id: n for n in await gcs(ray_cluster).nodes()}[target.ray_node_ids[0]]
    log.configure(level="info")  # an earlier test may have left a higher level; it filters first
    with structlog.testing.capture_logs() as lines:
        await cluster.cordon(target, reason="spot_interruption", deadline=datetime.now(timezone.utc))
        await cluster.record(target, reason="Draining", message="drained for spot", warning=True)
    after = {n.node_id: n for n in await gcs(ray_cluster).nodes()}[target.ray_node_ids[0]]
    assert (after.alive, after.draining_deadline_ms) == (before.alive, before.draining_deadline_ms)
    cordon, record = lines
    assert "no cordon" in cordon["event"]
    assert (cordon["log_level"], cordon["instance_id"], cordon["logger"]) == (
        "info", WORKER_INSTANCE, "resilienced.ray.cluster")
    assert (record["log_level"], record["event"], record["reason"]) == ("warning", "drained for spot", "Draining")
    assert record["ray_node_ids"] == list(target.ray_node_ids)
