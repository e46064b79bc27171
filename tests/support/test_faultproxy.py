"""The fault proxy's error answers through the daemon's own clients.

The campaign's throttling faults must look to botocore as the real services' throttling does:
the code parsed from the answer (SQS's JSON protocol, S3's REST ``Error``), retried by botocore's
standard mode as throttling (every attempt reaching the proxy), and translated by the
daemon's one rule into a retry later with the throttled delay. An answer botocore could not read
would still be a 5xx or 400 failure, but not the fault the campaign says it injects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import botocore.exceptions
import pytest

from resilienced.aws.clients import MAX_ATTEMPTS, open_client
from resilienced.aws.errors import THROTTLED_DELAY_S, translate
from resilienced.errors import BackendUnavailable
from resilienced.local.aws import FAKE_CREDENTIALS
from tests.support.faultproxy import FaultProxy, aws_action, path_contains

pytestmark = pytest.mark.integration


@pytest.fixture
async def proxy(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FaultProxy]:
    for key, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    proxy = await FaultProxy("http://127.0.0.1:9").start()  # nothing behind it: every call is faulted
    try:
        yield proxy
    finally:
        await proxy.stop()


async def test_an_sqs_throttling_answer_is_read_and_retried_as_throttling(proxy: FaultProxy) -> None:
    rule = proxy.fail(400, code="RequestThrottled", style="json", match=aws_action("ReceiveMessage"))
    async with open_client("sqs", region="us-east-1", endpoint_url=proxy.url) as sqs:
        with pytest.raises(botocore.exceptions.ClientError) as caught:
            await sqs.receive_message(QueueUrl=f"{proxy.url}/123456789012/q", WaitTimeSeconds=0)
    assert caught.value.response["Error"]["Code"] == "RequestThrottled"
    # botocore's standard mode retried it as throttling: ``retries.max_attempts`` counts the retries
    # after the first request (botocore/config.py)
    assert rule.hits == MAX_ATTEMPTS + 1
    error = translate(caught.value, backend="sqs", operation="receive_message")
    assert isinstance(error, BackendUnavailable) and error.delay == THROTTLED_DELAY_S


async def test_an_s3_slowdown_answer_is_read_and_retried_as_throttling(proxy: FaultProxy) -> None:
    rule = proxy.fail(503, code="SlowDown", style="s3", match=path_contains("/ckpt"))
    async with open_client("s3", region="us-east-1", endpoint_url=proxy.url) as s3:
        with pytest.raises(botocore.exceptions.ClientError) as caught:
            await s3.get_object(Bucket="ckpt", Key="run/manifest.json")
    assert caught.value.response["Error"]["Code"] == "SlowDown"
    assert rule.hits == MAX_ATTEMPTS + 1
    error = translate(caught.value, backend="s3", operation="get_object")
    assert isinstance(error, BackendUnavailable) and error.delay == THROTTLED_DELAY_S
