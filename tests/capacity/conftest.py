"""An aiobotocore ``ec2`` client under botocore's Stubber (moto lacks the capacity calls).

The Stubber checks every expected request's parameters and every canned response against
AWS's own service model (botocore's ``ec2`` model), so a request or response shape that AWS
would not accept fails the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiobotocore.session import AioSession
from botocore.stub import Stubber


@pytest.fixture(scope="session")
def aio_session() -> AioSession:
    """One session for all tests: it caches the (large) ec2 service model once."""
    return AioSession()


@pytest.fixture
async def ec2(aio_session: AioSession) -> AsyncIterator[tuple[object, Stubber]]:
    async with aio_session.create_client(
        "ec2", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing",
    ) as client:
        with Stubber(client) as stubber:
            yield client, stubber
            stubber.assert_no_pending_responses()
