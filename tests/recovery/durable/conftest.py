"""Fixtures of the durable-checkpoint tests: S3 on moto with the checkpoint bucket, FSx under the Stubber.

These ``s3``/``store`` (bucket ``ckpt-bucket``) replace tests/recovery/conftest.py's ``s3`` here.
"""

from tests.support.checkpoints import aio_session, fsx, s3, store  # noqa: F401  (fixtures)
