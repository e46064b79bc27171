"""LocalExporter (the FSx auto-export stand-in) end to end: local root -> moto S3 -> wait_durable."""

from __future__ import annotations

import asyncio
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from resilienced.aws.s3 import S3Store
from resilienced.local.aws import MotoServer
from resilienced.local.fsx import LocalExporter
from resilienced.recovery.durable import wait_durable

from tests.support.checkpoints import BUCKET, PREFIX, REGION, URI, make_ckpt, write_local

pytestmark = pytest.mark.integration

NOTICE = (datetime.now(timezone.utc) - timedelta(minutes=1)).replace(microsecond=0)


def soon(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


async def keys(s3: Any) -> set[str]:
    response = await s3.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX)
    return {o["Key"][len(PREFIX):] for o in response.get("Contents", [])}


def make_exporter(aws: MotoServer, root: Path, **kwargs: Any) -> LocalExporter:
    return LocalExporter(root=root, bucket=BUCKET, prefix=PREFIX, endpoint_url=aws.endpoint_url,
                         region=REGION, poll_interval=0.02, **kwargs)


async def test_a_committed_checkpoint_is_exported_shuffled_and_becomes_durable(
    aws: MotoServer, s3: Any, store: S3Store, local_root: Path
) -> None:
    write_local(local_root, make_ckpt(10, saved=NOTICE - timedelta(minutes=10), reason="periodic"))
    async with make_exporter(aws, local_root, shuffle=True, delay=(0.0, 0.05), seed=7,
                             sha256_checksums=True) as exporter:
        waiter = asyncio.create_task(wait_durable(store=store, uri=URI, notice_time=NOTICE,
                                                  deadline=soon(60), poll_interval=0.05))
        ckpt = make_ckpt(11, saved=NOTICE + timedelta(seconds=2))
        write_local(local_root, ckpt)
        result = await asyncio.wait_for(waiter, 60)

    assert result.durable, result.reason
    assert result.step == 11
    exported = {r.path for r in exporter.timeline if r.action == "NEW"}
    assert {f"step-11/{p}" for p in ckpt.files} | {"step-11/manifest.json"} <= exported
    assert exporter.exported_at("step-11/manifest.json") is not None
    assert not any(".partial" in r.path for r in exporter.timeline)
    assert exporter.errors == []


async def test_partial_and_trash_directories_are_never_exported(
    aws: MotoServer, s3: Any, local_root: Path
) -> None:
    (local_root / "step-5.partial").mkdir()
    (local_root / "step-5.partial" / "__0_0.distcp").write_bytes(b"half")
    (local_root / ".trash-step-4-1-2").mkdir()
    (local_root / ".trash-step-4-1-2" / "x").write_bytes(b"old")
    (local_root / "notes.txt").write_text("not a checkpoint")
    async with make_exporter(aws, local_root) as exporter:
        await exporter.wait_idle(timeout=30)

    assert await keys(s3) == set()
    assert exporter.timeline == []


async def test_changed_files_are_exported_again_and_deleted_checkpoints_are_removed(
    aws: MotoServer, s3: Any, local_root: Path
) -> None:
    step = write_local(local_root, make_ckpt(3, saved=NOTICE))
    async with make_exporter(aws, local_root) as exporter:
        await exporter.wait_idle(timeout=30)
        assert "step-3/manifest.json" in await keys(s3)

        target = step / "rng-rank0.pt"
        target.write_bytes(b"changed content")
        os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 10**9))
        await exporter.wait_idle(timeout=30)
        body = await (await s3.get_object(Bucket=BUCKET, Key=PREFIX + "step-3/rng-rank0.pt"))["Body"].read()
        assert body == b"changed content"
        assert any(r.action == "CHANGED" and r.path == "step-3/rng-rank0.pt" for r in exporter.timeline)

        # The trainer prunes: rename out of the step-* namespace, then remove.
        trash = local_root / ".trash-step-3-1-1"
        step.rename(trash)
        shutil.rmtree(trash)
        await exporter.wait_idle(timeout=30)

    assert await keys(s3) == set()
    assert {r.path for r in exporter.timeline if r.action == "DELETED"} == {
        f"step-3/{name}" for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank0.pt",
                                      "manifest.json")
    }


async def test_a_root_that_does_not_exist_yet_is_waited_for(aws: MotoServer, s3: Any, tmp_path: Path) -> None:
    root = tmp_path / "later"
    async with make_exporter(aws, root) as exporter:
        await exporter.wait_idle(timeout=30)
        root.mkdir()
        write_local(root, make_ckpt(1, saved=NOTICE))
        await exporter.wait_idle(timeout=30)
    assert "step-1/manifest.json" in await keys(s3)


async def test_exporter_survives_s3_errors_and_reports_them(aws: MotoServer, local_root: Path) -> None:
    write_local(local_root, make_ckpt(2, saved=NOTICE))
    exporter = LocalExporter(root=local_root, bucket="no-such-bucket", prefix=PREFIX,
                             endpoint_url=aws.endpoint_url, region=REGION, poll_interval=0.02)
    async with exporter:
        async def some_errors() -> None:
            while len(exporter.errors) < 2:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(some_errors(), 30)
    assert "NoSuchBucket" in exporter.errors[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"poll_interval": 0}, "poll_interval"), ({"delay": -1.0}, "delay"), ({"delay": (2.0, 1.0)}, "delay")],
    ids=["poll", "negative-delay", "inverted-range"],
)
def test_bad_knobs_are_rejected(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"root": tmp_path, "bucket": BUCKET, "prefix": PREFIX,
                            "endpoint_url": "http://127.0.0.1:1", "region": REGION}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LocalExporter(**args)
