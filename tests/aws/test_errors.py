"""The one AWS error rule (resilienced/aws/errors.py), and the verdicts it changed on each path.

The rule's table is checked on botocore's own ClientError shape; the paths whose verdicts
changed are driven through their real adapter calls with botocore's Stubber (which builds the
ClientError from the service model as botocore does for a real answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp
import botocore.exceptions
import pytest
from aiobotocore.session import AioSession
from botocore.stub import Stubber

from resilienced.aws import errors, fsx, s3, sqs
from handlers.asg_lifecycle import LifecycleAction
from resilienced.aws.autoscaling import Lifecycle
from resilienced.capacity import ec2
from resilienced.capacity.ec2 import Ec2Capacity
from resilienced.aws.clients import open_client
from resilienced.errors import BackendUnavailable, ConfigError, PermanentError
from resilienced.ports import RayNode
from resilienced.ray.cluster import INSTANCE_ID_LABEL, RayModeCluster

from tests.support.checkpoints import BUCKET, REGION

pytestmark = pytest.mark.integration

RETRY, GIVE_UP = BackendUnavailable, PermanentError


def client_error(code: str, status: int | None, operation: str = "Op") -> botocore.exceptions.ClientError:
    metadata = {"HTTPStatusCode": status} if status is not None else {}
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": metadata}, operation)


RULE = [
    ("Throttling", 400, RETRY), ("ThrottlingException", 400, RETRY), ("SlowDown", 503, RETRY),
    ("RequestLimitExceeded", 503, RETRY), ("TooManyRequestsException", 429, RETRY),
    ("RequestTimeout", 400, RETRY), ("RequestTimeTooSkewed", 403, RETRY),
    ("InternalError", 500, RETRY), ("ServiceUnavailable", 503, RETRY),
    ("SomethingNew", 502, RETRY), ("SomethingNew", 429, RETRY),
    ("AccessDenied", 403, GIVE_UP), ("AccessDeniedException", 400, GIVE_UP),
    ("UnauthorizedOperation", 403, GIVE_UP), ("ValidationError", 400, GIVE_UP),
    ("InvalidParameterValue", 400, GIVE_UP), ("NoSuchBucket", 404, GIVE_UP),
    ("ServiceLimitExceeded", 400, GIVE_UP), ("PermanentRedirect", 301, GIVE_UP),
    ("SomethingNew", None, GIVE_UP),
]


@pytest.mark.parametrize(("code", "status", "expected"), RULE,
                         ids=[f"{c}-{s}" for c, s, _ in RULE])
def test_the_rule_on_answers(code: str, status: int | None, expected: type) -> None:
    translated = errors.translate(client_error(code, status), backend="ec2", operation="DescribeX")
    assert type(translated) is expected
    assert code in str(translated) and "DescribeX" in str(translated) and "ec2" in str(translated)


@pytest.mark.parametrize("code", sorted(errors.RETRY_LATER_CODES))
def test_every_listed_code_is_retried_whatever_the_status(code: str) -> None:
    assert isinstance(errors.translate(client_error(code, 400), backend="s3", operation="op"), RETRY)


@pytest.mark.parametrize(("error", "expected"), [
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), RETRY),
    (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), RETRY),
    (botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), RETRY),
    (botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"), RETRY),
    (aiohttp.ClientConnectionError("reset"), RETRY),
    (asyncio.TimeoutError(), RETRY),
    (ConnectionRefusedError(111, "refused"), RETRY),
    (botocore.exceptions.ParamValidationError(report="Invalid type for parameter X"), GIVE_UP),
    (RuntimeError("a library bug"), RETRY),
], ids=["endpoint", "connect-timeout", "read-timeout", "closed", "aiohttp", "asyncio-timeout",
        "refused", "param-validation", "unexpected"])
def test_the_rule_without_an_answer(error: BaseException, expected: type) -> None:
    assert type(errors.translate(error, backend="fsx", operation="op")) is expected


def test_throttling_waits_a_second_unless_the_caller_says_otherwise() -> None:
    throttled, failed = client_error("Throttling", 400), client_error("InternalError", 500)
    assert errors.translate(throttled, backend="x", operation="op").delay == errors.THROTTLED_DELAY_S
    assert errors.translate(failed, backend="x", operation="op").delay is None
    assert ec2.translate(failed, action="op").delay == ec2.RETRY_DELAY_S


@pytest.mark.parametrize(("code", "status", "expected"), RULE, ids=[f"{c}-{s}" for c, s, _ in RULE])
def test_every_adapter_gives_the_same_verdict(code: str, status: int | None, expected: type) -> None:
    error = client_error(code, status)
    verdicts = {
        "ec2": ec2.translate(error, action="op"),
        "s3": s3.translate(error, operation="op", bucket=BUCKET),
        "fsx": fsx.translate(error, operation="op"),
        "shared": errors.translate(error, backend="autoscaling", operation="op"),
    }
    assert {name: type(v) for name, v in verdicts.items()} == {name: expected for name in verdicts}
    # the daemon's own queue: the same verdict, but never given up on (retried, marked refused)
    queue = sqs.translate(error, operation="op")
    assert isinstance(queue, RETRY) and (expected is RETRY or "(refused)" in str(queue))


# --------------------------------------------------------------------------- the changed paths
@asynccontextmanager
async def stubbed(service: str) -> AsyncIterator[tuple[Any, Stubber]]:
    async with AioSession().create_client(service, region_name=REGION, aws_access_key_id="testing",
                                          aws_secret_access_key="testing") as client:
        with Stubber(client) as stubber:
            yield client, stubber
            stubber.assert_no_pending_responses()


async def test_an_ec2_refusal_is_permanent_on_every_ec2_path() -> None:
    """Before: DescribeInstances of ray-mode locate retried it forever; Capacity gave up."""
    async with stubbed("ec2") as (client, stub):
        for _ in range(2):
            stub.add_client_error("describe_instances", service_error_code="UnauthorizedOperation",
                                  service_message="You are not authorized", http_status_code=403)
        cluster = RayModeCluster(ray=None, checkpoint_uri="s3://ckpt-bucket/runs/", ec2=client)  # type: ignore[arg-type]
        with pytest.raises(PermanentError, match="UnauthorizedOperation"):
            await cluster._private_addresses(["i-0123456789abcdef0"])
        with pytest.raises(PermanentError, match="UnauthorizedOperation"):
            await Ec2Capacity(client).reservation_instances(reservation_id="cr-0123456789abcdef0")


class TwoNodes:
    """The GCS's node table (the only call ray-mode locate makes on it): one node labelled with
    its instance, one that is not."""

    async def nodes(self) -> list[RayNode]:
        return [RayNode(node_id="aa" * 14, address="10.0.0.5", alive=True,
                        labels={INSTANCE_ID_LABEL: "i-0aaaaaaaaaaaaaaaa"}),
                RayNode(node_id="bb" * 14, address="10.0.0.6", alive=True, labels={})]


async def test_an_ec2_refusal_of_the_ip_fallback_still_locates_the_labelled_instances() -> None:
    """A refusal is permanent, but it costs only the instances that needed the fallback: the
    labelled one is still located (and drained), the other is unresolved with the reason."""
    async with stubbed("ec2") as (client, stub):
        stub.add_client_error("describe_instances", service_error_code="UnauthorizedOperation",
                              service_message="You are not authorized", http_status_code=403)
        cluster = RayModeCluster(ray=TwoNodes(), checkpoint_uri="s3://ckpt-bucket/runs/", ec2=client)  # type: ignore[arg-type]
        location = await cluster.locate(instance_ids=["i-0aaaaaaaaaaaaaaaa", "i-0bbbbbbbbbbbbbbbb"])
    assert [t.instance_id for t in location.targets] == ["i-0aaaaaaaaaaaaaaaa"]
    assert location.targets[0].ray_node_ids == ("aa" * 14,)
    assert list(location.unresolved) == ["i-0bbbbbbbbbbbbbbbb"]
    assert "UnauthorizedOperation" in location.unresolved["i-0bbbbbbbbbbbbbbbb"]


async def test_ec2_throttling_is_retried_on_the_locate_path() -> None:
    async with stubbed("ec2") as (client, stub):
        stub.add_client_error("describe_instances", service_error_code="RequestLimitExceeded",
                              http_status_code=503)
        cluster = RayModeCluster(ray=None, checkpoint_uri="s3://ckpt-bucket/runs/", ec2=client)  # type: ignore[arg-type]
        with pytest.raises(BackendUnavailable, match="RequestLimitExceeded"):
            await cluster._private_addresses(["i-0123456789abcdef0"])


HOOK = LifecycleAction(lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                       lifecycle_hook_name="drain-first", auto_scaling_group_name="gpu-asg",
                       lifecycle_action_token="b4dd0f5b-0ef2-4479-9dad-6c55f027000e")


@pytest.mark.parametrize(("code", "status"), [("RequestLimitExceeded", 400), ("TooManyRequests", 429)],
                         ids=["request-limit", "http-429"])
async def test_auto_scaling_throttling_and_429_are_retried(code: str, status: int) -> None:
    """Before: only Throttling/ThrottlingException and 5xx were retried; these gave up."""
    async with stubbed("autoscaling") as (client, stub):
        stub.add_client_error("complete_lifecycle_action", service_error_code=code,
                              http_status_code=status)
        with pytest.raises(BackendUnavailable, match=code):
            await Lifecycle(client).complete(HOOK, instance_id="i-0123456789abcdef0")


async def test_an_auto_scaling_request_botocore_refuses_is_permanent() -> None:
    """Before: a ParamValidationError was retried; the same request can never be sent."""
    # no Stubber (it answers before validation): botocore validates before it connects anywhere
    async with AioSession().create_client("autoscaling", region_name=REGION, aws_access_key_id="testing",
                                          aws_secret_access_key="testing",
                                          endpoint_url="http://127.0.0.1:9") as client:
        with pytest.raises(PermanentError, match="invalid request"):
            await Lifecycle(client).complete(replace(HOOK, lifecycle_hook_name=7),  # type: ignore[arg-type]
                                             instance_id="i-0123456789abcdef0")


@pytest.mark.parametrize(("code", "status", "expected"), [
    ("TooManyRequests", 429, BackendUnavailable),  # before: a 4xx, given up
    ("PermanentRedirect", 301, PermanentError),  # before: not a 4xx, retried
    ("AccessDenied", 403, PermanentError),  # unchanged
], ids=["429-retried", "redirect-permanent", "denied-permanent"])
async def test_s3_verdicts(code: str, status: int, expected: type) -> None:
    async with stubbed("s3") as (client, stub):
        stub.add_client_error("list_objects_v2", service_error_code=code, http_status_code=status)
        with pytest.raises(expected, match=code):
            await s3.S3Store(client=client).list(bucket=BUCKET, prefix="runs/")


async def test_the_queue_is_retried_when_it_refuses() -> None:
    """The named exception of the daemon's own queue: a denied receive is retried (readiness)."""
    async with stubbed("sqs") as (client, stub):
        stub.add_client_error("receive_message", service_error_code="AccessDenied", http_status_code=403)
        queue = sqs.SqsQueue(client=client, queue_url="https://sqs.us-east-1.amazonaws.com/1/q")
        with pytest.raises(BackendUnavailable, match=r"AccessDenied .*\(refused\)"):
            await queue.receive(max_messages=1, wait_seconds=0, visibility_timeout=30)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"region": None}, "--region"),
    ({"region": REGION, "endpoint_url": "not a url"}, "--endpoint-url"),
], ids=["no-region", "bad-endpoint"])
async def test_a_client_that_cannot_be_made_is_a_config_error_naming_the_flag(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, kwargs: dict[str, Any], flag: str) -> None:
    """Not "retry later": no retry makes a missing region or a malformed URL work."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=f"^{flag}: ec2: "):
        async with open_client("ec2", **kwargs):
            pass
