"""S3Store on the moto server over HTTP, and parse_s3_uri."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from aiobotocore.session import AioSession

from resilienced.aws.s3 import ObjectNotFound, S3Store, parse_s3_uri, sha256_hex
from resilienced.errors import BackendUnavailable, PermanentError
from resilienced.local.aws import free_port

from tests.support.checkpoints import BUCKET, REGION

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket-1/runs/demo", ("bucket-1", "runs/demo/")),
        ("s3://bucket-1/runs/demo/", ("bucket-1", "runs/demo/")),
        ("s3://bucket-1", ("bucket-1", "")),
        ("s3://bucket-1/", ("bucket-1", "")),
        ("  s3://my.bucket/a  ", ("my.bucket", "a/")),
    ],
    ids=["prefix", "trailing-slash", "bucket-only", "bucket-slash", "dots-and-spaces"],
)
def test_parse_s3_uri_accepts(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "empty"),
        ("bucket/prefix", "does not start with s3://"),
        ("https://bucket/prefix", "does not start with s3://"),
        ("s3:///prefix", "names no bucket"),
        ("s3://Bucket_Upper/x", "not a valid bucket name"),
        ("s3://ab/x", "not a valid bucket name"),
        ("s3://bucket-1/a//b", "empty path segment"),
        ("s3://bucket-1/a/../b", "'..'"),
    ],
    ids=["empty", "no-scheme", "https", "no-bucket", "bad-bucket", "short-bucket", "double-slash", "dotdot"],
)
def test_parse_s3_uri_rejects_with_a_clear_message(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_s3_uri(uri)


def test_sha256_hex_converts_whole_object_checksums_only() -> None:
    digest = hashlib.sha256(b"hello").digest()
    b64 = base64.b64encode(digest).decode()
    assert sha256_hex(b64) == digest.hex()
    assert sha256_hex(b64, checksum_type="FULL_OBJECT") == digest.hex()
    assert sha256_hex(b64, checksum_type="COMPOSITE") is None
    assert sha256_hex(b64 + "-3") is None
    assert sha256_hex("not base64!") is None
    assert sha256_hex(base64.b64encode(b"short").decode()) is None
    assert sha256_hex(None) is None


async def test_list_pages_through_every_object(s3: Any) -> None:
    keys = [f"p/obj-{i:03d}" for i in range(23)]
    for key in keys:
        await s3.put_object(Bucket=BUCKET, Key=key, Body=key.encode())
    await s3.put_object(Bucket=BUCKET, Key="other/x", Body=b"x")

    listed = await S3Store(client=s3, page_size=5).list(bucket=BUCKET, prefix="p/")

    assert sorted(o.key for o in listed) == keys
    assert all(o.size == len(o.key) for o in listed)


async def test_list_reports_sha256_as_hex_when_s3_has_one(s3: Any) -> None:
    body = b"checkpoint bytes"
    await s3.put_object(Bucket=BUCKET, Key="p/with", Body=body, ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=base64.b64encode(hashlib.sha256(body).digest()).decode())
    await s3.put_object(Bucket=BUCKET, Key="p/without", Body=body)

    listed = {o.key: o for o in await S3Store(client=s3).list(bucket=BUCKET, prefix="p/")}

    assert listed["p/with"].checksum_sha256 == hashlib.sha256(body).hexdigest()
    assert listed["p/without"].checksum_sha256 is None
    assert listed["p/with"].size == len(body)
    assert listed["p/with"].last_modified is not None


async def test_get_returns_the_body_and_a_missing_key_is_object_not_found(s3: Any) -> None:
    store = S3Store(client=s3)
    await s3.put_object(Bucket=BUCKET, Key="p/a", Body=b"abc")

    assert await store.get(bucket=BUCKET, key="p/a") == b"abc"
    with pytest.raises(ObjectNotFound, match="s3://ckpt-bucket/p/nope"):
        await store.get(bucket=BUCKET, key="p/nope")


async def test_a_missing_bucket_is_permanent(s3: Any) -> None:
    store = S3Store(client=s3)
    with pytest.raises(PermanentError, match="NoSuchBucket"):
        await store.list(bucket="no-such-bucket", prefix="")


async def test_an_unreachable_endpoint_is_backend_unavailable(aio_session: AioSession,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from aiobotocore.config import AioConfig

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    config = AioConfig(connect_timeout=1, read_timeout=1, retries={"max_attempts": 1})
    async with aio_session.create_client("s3", region_name=REGION, config=config,
                                         endpoint_url=f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(BackendUnavailable) as info:
            await S3Store(client=client).list(bucket=BUCKET, prefix="")
    assert info.value.backend == "s3"
