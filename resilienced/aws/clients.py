"""The one place aiobotocore clients are made: the daemon (``app.runtime``, the SQS and S3 adapters),
``replay`` and ``inject`` all open theirs here, with one :class:`AioConfig`.

The config: botocore's ``standard`` retry mode with :data:`MAX_ATTEMPTS` retries after the first
request (``retries.max_attempts`` counts retries, botocore/config.py: 4 requests in all; its own
short retries of throttling and 5xx inside one call; what still fails is translated by
:mod:`resilienced.aws.errors`), a :data:`CONNECT_TIMEOUT_S` connect timeout and a
:data:`READ_TIMEOUT_S` read timeout -- except SQS, whose read timeout lies above its 20 s long
poll (:data:`SQS_READ_TIMEOUT_S`) -- and a pool of ``max_connections`` per client.  The region
and ``endpoint_url`` (moto, LocalStack: one endpoint for every service) come from the queue
settings (``--region``, ``--endpoint-url``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import botocore.exceptions
from aiobotocore.client import AioBaseClient
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from resilienced.aws.errors import translate
from resilienced.errors import ConfigError

CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
SQS_READ_TIMEOUT_S = 40  # above the 20 s long poll of ReceiveMessage
MAX_ATTEMPTS = 3
MAX_CONNECTIONS = 20


def aws_config(service: str, *, max_connections: int = MAX_CONNECTIONS) -> AioConfig:
    """The one client config (retries, timeouts, pool) for ``service``."""
    return AioConfig(
        max_pool_connections=max_connections, connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=SQS_READ_TIMEOUT_S if service == "sqs" else READ_TIMEOUT_S,
        retries={"mode": "standard", "max_attempts": MAX_ATTEMPTS},
    )


@asynccontextmanager
async def open_client(service: str, *, region: str | None, endpoint_url: str | None = None,
                      max_connections: int = MAX_CONNECTIONS) -> AsyncIterator[AioBaseClient]:
    """An aiobotocore client of ``service``, closed on exit.

    No region or a malformed endpoint URL is a :class:`~resilienced.errors.ConfigError` naming
    the flag; anything else that keeps the client from being made is translated
    (:func:`resilienced.aws.errors.translate`, backend ``service``).
    """
    try:
        client_cm = get_session().create_client(
            service, region_name=region, endpoint_url=endpoint_url,
            config=aws_config(service, max_connections=max_connections))
        client = await client_cm.__aenter__()
    except botocore.exceptions.NoRegionError as e:
        raise ConfigError("--region", f"{service}: no region (set --region or AWS_REGION)") from e
    except ValueError as e:  # botocore refuses a malformed endpoint URL with a ValueError
        raise ConfigError("--endpoint-url", f"{service}: {e}") from e
    except Exception as e:
        raise translate(e, backend=service, operation="create client") from e
    try:
        yield client
    finally:
        await client_cm.__aexit__(None, None, None)
