"""Fixtures of the local stand-ins' tests: S3 on moto and a local FSx root."""

from tests.support.checkpoints import aio_session, local_root, s3, store  # noqa: F401  (fixtures)
