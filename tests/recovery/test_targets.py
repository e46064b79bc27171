"""recovery/targets.py: the one resolve -> locate -> group of the daemon (Recovery) and replay.

EC2 is botocore's Stubber behind the real Ec2Capacity; the cluster is the real RayModeCluster
(for a plan with no instance left it answers without asking its GCS).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiobotocore.session import AioSession
from botocore.stub import Stubber

from resilienced.intake import pipeline as intake
from resilienced.capacity.ec2 import Ec2Capacity
from resilienced.errors import PermanentError
from resilienced.model import Plan, Target
from resilienced.local.aws import free_port
from resilienced.ray.cluster import RayModeCluster
from resilienced.ray.gcs import RayGcs
from resilienced.recovery.targets import find_targets, group
from resilienced.settings import IntakeSettings

from tests.intake import payloads as p

pytestmark = pytest.mark.integration


@pytest.fixture
async def ec2() -> AsyncIterator[tuple[Any, Stubber]]:
    async with AioSession().create_client("ec2", region_name="us-east-1", aws_access_key_id="testing",
                                          aws_secret_access_key="testing") as client:
        with Stubber(client) as stubber:
            yield client, stubber
            stubber.assert_no_pending_responses()


def block_expiry() -> Plan:
    plan = intake.read(p.body(p.block_expiry()), IntakeSettings()).plan
    assert plan.actionable and plan.capacity_reservation_id == p.RESERVATION and not plan.instance_ids
    return plan


def cluster() -> RayModeCluster:
    return RayModeCluster(ray=None, checkpoint_uri="s3://ckpt-bucket/runs/")  # type: ignore[arg-type]


async def test_the_daemon_raises_what_replay_records(ec2: tuple[Any, Stubber]) -> None:
    client, stub = ec2
    for _ in range(2):
        stub.add_client_error("describe_instances", service_error_code="UnauthorizedOperation",
                              http_status_code=403)
    capacity = Ec2Capacity(client)
    with pytest.raises(PermanentError, match="UnauthorizedOperation"):
        await find_targets(block_expiry(), cluster=cluster(), capacity=capacity)

    found = await find_targets(block_expiry(), cluster=cluster(), capacity=capacity, record_failures=True)
    assert (found.instance_ids, found.located, found.runs) == ([], [], [])
    assert list(found.unresolved) == [p.RESERVATION]
    assert found.unresolved[p.RESERVATION].startswith("cannot list the reservation's instances: ")
    assert "UnauthorizedOperation" in found.unresolved[p.RESERVATION]


async def test_a_capacity_block_without_ec2_access_says_so() -> None:
    with pytest.raises(PermanentError, match="no EC2 access"):
        await find_targets(block_expiry(), cluster=cluster(), capacity=None)


async def test_the_reservation_instances_are_listed_and_each_unlocated_one_says_why(ec2: tuple[Any, Stubber]) -> None:
    client, stub = ec2
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        {"InstanceId": p.INSTANCE}, {"InstanceId": p.OTHER_INSTANCE}]}]})
    silent = RayModeCluster(ray=RayGcs(f"127.0.0.1:{free_port()}", timeout=2.0), checkpoint_uri=None)
    found = await find_targets(block_expiry(), cluster=silent, capacity=Ec2Capacity(client),
                               record_failures=True)
    # no GCS answers: locating fails, and replay's mode says so for each instance
    assert found.instance_ids == [p.INSTANCE, p.OTHER_INSTANCE]
    assert found.runs == [] and set(found.unresolved) == {p.INSTANCE, p.OTHER_INSTANCE}
    assert all(why.startswith("cannot locate: ") for why in found.unresolved.values())


def target(instance: str, node: str, *, job: str = "train") -> Target:
    return Target(instance_id=instance, node=instance, ray_cluster="rc", ray_job=job,
                  ray_node_ids=(node,), checkpoint_uri="s3://b/p/", ray_address="10.0.0.1:6379")


def test_instances_of_one_run_are_one_gang() -> None:
    runs = group([target("i-1", "n1"), target("i-2", "n2"), target("i-3", "n3", job="other")])
    assert [r.run_key for r in runs] == [target("i-1", "n1").run_key, target("i-3", "n3", job="other").run_key]
    gang = runs[0]
    assert gang.ray_node_ids == ("n1", "n2")
    assert gang.facts.instance_ids == ("i-1", "i-2")
    assert gang.facts.lost_instance_ids == ("i-1", "i-2")
