"""The S3 adapter: :class:`S3Store` implements :class:`~resilienced.ports.ObjectStore` on aiobotocore.

``list`` pages through ``ListObjectsV2``; for objects whose ``ChecksumAlgorithm`` includes
``SHA256`` it also asks ``HeadObject(ChecksumMode=ENABLED)`` for the checksum (a listing carries
only the algorithm's name, not the value) and hands it on as hex.  Only a whole-object (not a
multipart ``COMPOSITE``) SHA-256 is the file's SHA-256; a composite one is ignored.  ``get``
reads a whole object.

Errors are translated here, at the boundary, by the one rule of :mod:`resilienced.aws.errors`
(connection failures, timeouts, throttling such as ``SlowDown``, 429 and 5xx ->
:class:`~resilienced.errors.BackendUnavailable` ``"s3"``; ``NoSuchBucket``, ``AccessDenied`` and
every other refusal -> :class:`~resilienced.errors.PermanentError` naming the bucket), with one
named exception: ``NoSuchKey`` (``NotFound``/``404`` from ``HeadObject``) on a call about one key
-> :class:`ObjectNotFound` (a ``PermanentError``), so the caller decides whether a missing object
is an answer ("not exported yet") or a failure.

:func:`parse_s3_uri` turns ``s3://bucket/prefix`` into ``(bucket, prefix)`` with clear errors.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.aws.clients import MAX_CONNECTIONS, open_client
from resilienced.errors import PermanentError, ResilienceError
from resilienced.model import JsonValue
from resilienced.ports import StoredObject

BACKEND = "s3"
#: The codes of "this key does not exist" (GetObject: NoSuchKey; HeadObject: 404, no body).
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class ObjectNotFound(PermanentError):
    """The object does not exist (S3 ``NoSuchKey``)."""

    def __init__(self, bucket: str, key: str) -> None:
        super().__init__(f"s3://{bucket}/{key} does not exist")
        self.bucket = bucket
        self.key = key


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")``.

    The prefix comes back with exactly one trailing ``/`` (empty for the bucket root), so that
    ``prefix + "step-3/manifest.json"`` is a key.  ValueError names what is wrong.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError("S3 URI is empty: expected s3://bucket/prefix")
    text = uri.strip()
    if not text.startswith("s3://"):
        raise ValueError(f"S3 URI {uri!r} does not start with s3://")
    rest = text[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URI {uri!r} names no bucket")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ValueError(
            f"S3 URI {uri!r}: {bucket!r} is not a valid bucket name (3-63 characters: lower-case "
            "letters, digits, '.', '-'; starting and ending with a letter or digit)"
        )
    if "//" in prefix:
        raise ValueError(f"S3 URI {uri!r} has an empty path segment ('//')")
    if any(part in (".", "..") for part in prefix.split("/")):
        raise ValueError(f"S3 URI {uri!r} has a '.' or '..' path segment")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


def translate(error: BaseException, *, operation: str, bucket: str, key: str | None = None) -> ResilienceError:
    """The resilienced error for a library error raised by an S3 call."""
    if key is not None and errors.error_code(error) in _NOT_FOUND_CODES:
        return ObjectNotFound(bucket, key)  # the named exception: the caller reads it
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
    return errors.translate(error, backend=BACKEND, operation=f"{operation} {where}")


def sha256_hex(checksum_b64: str | None, *, checksum_type: str | None = None) -> str | None:
    """S3's base64 ``ChecksumSHA256`` as hex; None for a composite (multipart) or bad value."""
    if not checksum_b64 or (checksum_type and checksum_type != "FULL_OBJECT"):
        return None
    if "-" in checksum_b64:  # "<base64>-<parts>": a checksum of part checksums
        return None
    try:
        raw = base64.b64decode(checksum_b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


class S3Store:
    """``ports.ObjectStore`` on an aiobotocore S3 client owned by the caller (see :meth:`open`).

    Args:
        client: an aiobotocore ``s3`` client.
        checksums: ask ``HeadObject`` for the SHA-256 of listed objects that have one.
        head_concurrency: at most this many ``HeadObject`` calls at once per ``list``.
        page_size: keys per ``ListObjectsV2`` page (S3's own maximum is 1000).
    """

    def __init__(self, *, client: AioBaseClient, checksums: bool = True, head_concurrency: int = 8,
                 page_size: int = 1000) -> None:
        if head_concurrency < 1:
            raise ValueError(f"head_concurrency must be >= 1, got {head_concurrency}")
        if not 1 <= page_size <= 1000:
            raise ValueError(f"page_size must be in 1..1000, got {page_size}")
        self._page_size = page_size
        self._client = client
        self._checksums = checksums
        self._head_concurrency = head_concurrency

    @classmethod
    @asynccontextmanager
    async def open(cls, *, region: str | None, endpoint_url: str | None = None,
                   max_connections: int = MAX_CONNECTIONS, checksums: bool = True) -> AsyncIterator[S3Store]:
        """A store with its own client (and connection pool), closed on exit."""
        async with open_client("s3", region=region, endpoint_url=endpoint_url,
                               max_connections=max_connections) as client:
            yield cls(client=client, checksums=checksums)

    async def list(self, *, bucket: str, prefix: str) -> list[StoredObject]:
        """Every object under ``prefix`` (all pages), with its SHA-256 where S3 has one."""
        objects: list[StoredObject] = []
        want_checksum: list[int] = []
        token: str | None = None
        while True:
            kwargs: dict[str, JsonValue] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": self._page_size}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                page = await self._client.list_objects_v2(**kwargs)
            except Exception as e:
                raise translate(e, operation="ListObjectsV2", bucket=bucket) from e
            for raw in page.get("Contents", []) or []:
                if "SHA256" in (raw.get("ChecksumAlgorithm") or []):
                    want_checksum.append(len(objects))
                objects.append(StoredObject(key=raw["Key"], size=int(raw.get("Size", 0)),
                                            last_modified=raw.get("LastModified")))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token:
                break
        if self._checksums and want_checksum:
            gate = asyncio.Semaphore(self._head_concurrency)

            async def with_checksum(i: int) -> None:
                async with gate:
                    obj = objects[i]
                    try:
                        head = await self._client.head_object(Bucket=bucket, Key=obj.key,
                                                              ChecksumMode="ENABLED")
                    except Exception as e:
                        err = translate(e, operation="HeadObject", bucket=bucket, key=obj.key)
                        if isinstance(err, ObjectNotFound):  # deleted since the listing
                            objects[i] = None  # type: ignore[call-overload]
                            return
                        raise err from e
                    objects[i] = StoredObject(
                        key=obj.key, size=int(head.get("ContentLength", obj.size)),
                        checksum_sha256=sha256_hex(head.get("ChecksumSHA256"),
                                                   checksum_type=head.get("ChecksumType")),
                        last_modified=obj.last_modified,
                    )

            await asyncio.gather(*(with_checksum(i) for i in want_checksum))
            objects = [o for o in objects if o is not None]
        return objects

    async def get(self, *, bucket: str, key: str) -> bytes:
        """The whole object; :class:`ObjectNotFound` when there is none."""
        try:
            response = await self._client.get_object(Bucket=bucket, Key=key)
            async with response["Body"] as body:
                return await body.read()
        except Exception as e:
            raise translate(e, operation="GetObject", bucket=bucket, key=key) from e
