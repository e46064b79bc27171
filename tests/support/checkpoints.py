"""S3 on the moto server over HTTP, FSx through botocore's Stubber, and checkpoint builders.

Shared by tests/aws (the adapters), tests/recovery/durable (``wait_durable``) and tests/local (the
FSx stand-in): their conftest.py files re-export the fixtures below.

Checkpoints are laid out the way the trainer lays them out (``step-<N>/`` files plus a
``manifest.json`` listing each with its size and SHA-256, built with the one definition of the
format, ``trainer.manifest``), either straight into S3 or into a local root that
:class:`resilienced.local.fsx.LocalExporter` exports.  The trainer's own writer against the
daemon's reader: tests/recovery/durable/test_contract.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession
from botocore.stub import Stubber

from resilienced.aws.s3 import S3Store
from resilienced.local.aws import MotoServer
from trainer.manifest import FileEntry, Manifest

REGION = "us-east-1"
BUCKET = "ckpt-bucket"
PREFIX = "runs/demo/"
URI = f"s3://{BUCKET}/{PREFIX.rstrip('/')}"


@dataclass(frozen=True)
class Ckpt:
    """A checkpoint as the trainer writes it: files and the manifest that lists them."""

    step: int
    files: dict[str, bytes]
    saved: datetime
    manifest: bytes

    def objects(self) -> dict[str, bytes]:
        """relative key -> body, the manifest included (``step-<N>/...``)."""
        out = {f"step-{self.step}/{path}": body for path, body in self.files.items()}
        out[f"step-{self.step}/manifest.json"] = self.manifest
        return out


def make_ckpt(step: int, *, saved: datetime, world_size: int = 2, size: int = 64,
              reason: str = "preemption") -> Ckpt:
    files = {f"__{r}_0.distcp": bytes([step % 251, r]) * (size // 2) for r in range(world_size)}
    files[".metadata"] = json.dumps({"step": step}).encode()
    files["rng-rank0.pt"] = b"rng" * 5
    manifest = Manifest(
        step=step, world_size=world_size, time=saved.astimezone(timezone.utc),
        saved_at_unix=saved.timestamp(), reason=reason,
        files=tuple(FileEntry(p, len(b), hashlib.sha256(b).hexdigest()) for p, b in sorted(files.items())))
    return Ckpt(step=step, files=files, saved=saved, manifest=manifest.to_json().encode())


def write_local(root: Path, ckpt: Ckpt) -> Path:
    """Write ``ckpt`` under ``root`` as the trainer does: .partial, files, manifest, rename."""
    partial = root / f"step-{ckpt.step}.partial"
    partial.mkdir(parents=True)
    for path, body in ckpt.files.items():
        (partial / path).parent.mkdir(parents=True, exist_ok=True)
        (partial / path).write_bytes(body)
    (partial / "manifest.json").write_bytes(ckpt.manifest)
    final = root / f"step-{ckpt.step}"
    partial.rename(final)
    return final


@pytest.fixture(scope="session")
def aio_session() -> AioSession:
    return AioSession()


@pytest.fixture
async def s3(aws: MotoServer, aio_session: AioSession) -> AsyncIterator[Any]:
    """An aiobotocore S3 client on the (reset) moto server, with the checkpoint bucket."""
    async with aio_session.create_client("s3", region_name=REGION,
                                         endpoint_url=aws.endpoint_url) as client:
        await client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
def store(s3: Any) -> S3Store:
    return S3Store(client=s3)


async def put_ckpt(s3: Any, ckpt: Ckpt, *, skip: tuple[str, ...] = (), sha256: bool = False,
                   override: dict[str, bytes] | None = None) -> None:
    """Upload a checkpoint's objects (optionally leaving some out or replacing some bodies)."""
    import base64

    for rel, body in ckpt.objects().items():
        if rel.split("/", 1)[1] in skip:
            continue
        body = (override or {}).get(rel.split("/", 1)[1], body)
        kwargs: dict[str, Any] = {"Bucket": BUCKET, "Key": PREFIX + rel, "Body": body}
        if sha256:
            kwargs["ChecksumAlgorithm"] = "SHA256"
            kwargs["ChecksumSHA256"] = base64.b64encode(hashlib.sha256(body).digest()).decode()
        await s3.put_object(**kwargs)


@pytest.fixture
async def fsx(aio_session: AioSession) -> AsyncIterator[tuple[Any, Stubber]]:
    """An aiobotocore ``fsx`` client under the Stubber (moto lacks data repository tasks)."""
    async with aio_session.create_client(
        "fsx", region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing",
    ) as client:
        with Stubber(client) as stubber:
            yield client, stubber
            stubber.assert_no_pending_responses()


@pytest.fixture
def local_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "fsx" / "runs" / "demo"
    root.mkdir(parents=True)
    yield root
