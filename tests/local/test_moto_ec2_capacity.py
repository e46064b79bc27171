"""The moto server's EC2 capacity per market (``RESILIENCED_MOTO_EC2_CAPACITY``: the drill's
``--provider ec2`` runs out of Spot as EC2 does), over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from resilienced.local.motoserver import EC2_CAPACITY_ENV

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ec2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    capacity = {"spot": 0, "capacity-block": 1}
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with MotoServer(log_path=Path(log), env={EC2_CAPACITY_ENV: json.dumps(capacity)}) as server:
        yield boto3.client("ec2", region_name="us-east-1", endpoint_url=server.endpoint_url,
                           aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                           aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])


def _run(ec2: Any, market: str | None) -> str:
    extra = {"InstanceMarketOptions": {"MarketType": market}} if market else {}
    answer = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, **extra)
    return answer["Instances"][0]["InstanceId"]


def _live(ec2: Any) -> int:
    answer = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return sum(len(r["Instances"]) for r in answer["Reservations"])


def test_a_market_without_capacity_is_insufficient_capacity(ec2: Any) -> None:
    before = _live(ec2)
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        _run(ec2, "spot")
    assert caught.value.response["Error"]["Code"] == "InsufficientInstanceCapacity"
    assert _live(ec2) == before  # nothing launched


def test_a_market_gives_its_capacity_and_gets_it_back_when_an_instance_ends(ec2: Any) -> None:
    first = _run(ec2, "capacity-block")
    with pytest.raises(botocore.exceptions.ClientError, match="InsufficientInstanceCapacity"):
        _run(ec2, "capacity-block")
    ec2.terminate_instances(InstanceIds=[first])
    assert _run(ec2, "capacity-block") != first


def test_a_market_not_listed_has_no_limit(ec2: Any) -> None:
    assert len({_run(ec2, None) for _ in range(3)}) == 3
