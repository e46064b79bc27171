"""Fixtures of the AWS adapters' tests: S3 on moto, FSx under the Stubber, the SQS queues."""

from tests.intake.conftest import queues  # noqa: F401  (fixture)
from tests.support.checkpoints import aio_session, fsx, s3, store  # noqa: F401  (fixtures)
