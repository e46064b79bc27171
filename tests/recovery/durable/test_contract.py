"""The contract between the trainer and the daemon, with the real writer and the real reader.

The trainer's ``Checkpointer`` (and its public ``write_manifest``, for checkpoints written some
other way) writes a checkpoint into a local root; the FSx stand-in exports it to S3 on the moto
server; the daemon's durable check (``wait_durable``) reads it back.  What the trainer wrote
whole counts as durable; each damage a crash or a bad export can do is refused by both sides:
the daemon's check in S3 and the trainer's own ``verify`` before a resume.  Both parse the
manifest with its one definition, ``trainer/manifest.py``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

from resilienced.aws.s3 import S3Store
from resilienced.local.fsx import LocalExporter
from resilienced.recovery.durable import DurableResult, wait_durable
from tests.support.checkpoints import BUCKET, PREFIX, REGION, URI
from trainer.errors import CorruptCheckpoint
from trainer.manifest import MANIFEST, Manifest
from trainer.resilience import Checkpointer, verify, write_manifest

pytestmark = pytest.mark.integration


def train_and_save(root: Path) -> Path:
    """Three optimizer steps with a periodic save at 2 and the final save at 3: ``step-3``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optim": optim}
    ckpt = Checkpointer(root, every=2, keep=3)
    assert ckpt.restore(state) == 0
    for step in (1, 2, 3):
        model(torch.ones(4, 3)).sum().backward()
        optim.step()
        optim.zero_grad()
        ckpt.after_step(step, state)
    ckpt.finish(state)
    return root / "step-3"


async def export_and_check(aws: Any, store: S3Store, root: Path, *, notice: datetime,
                           sha256: bool = False) -> DurableResult:
    """FSx's auto-export of ``root`` (every committed file now on disk), then one durable check."""
    async with LocalExporter(root=root, bucket=BUCKET, prefix=PREFIX, endpoint_url=aws.endpoint_url,
                             region=REGION, poll_interval=0.05, sha256_checksums=sha256) as exporter:
        await exporter.wait_idle(timeout=60)
        assert not exporter.errors
    return await wait_durable(store=store, uri=URI, notice_time=notice,
                              deadline=datetime.now(timezone.utc), poll_interval=0.05)


async def test_what_the_checkpointer_saved_is_durable_as_the_trainer_wrote_it(
        aws: Any, store: S3Store, tmp_path: Path, own_sigterm: None) -> None:
    notice = datetime.now(timezone.utc) - timedelta(seconds=1)
    step_dir = train_and_save(tmp_path)

    result = await export_and_check(aws, store, tmp_path, notice=notice)

    assert result.durable and result.step == 3, result.reason
    assert result.manifest == verify(step_dir)  # the daemon reads what the trainer verifies
    assert result.manifest.reason == "final" and result.manifest.world_size == 1
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file()}
    assert {f.path for f in result.manifest.files} == on_disk - {MANIFEST}


async def test_a_checkpoint_written_another_way_is_durable_once_write_manifest_ran(
        aws: Any, store: S3Store, tmp_path: Path) -> None:
    notice = datetime.now(timezone.utc) - timedelta(seconds=1)
    step_dir = tmp_path / "step-7"
    (step_dir / "shards").mkdir(parents=True)
    (step_dir / "shards" / "model.bin").write_bytes(b"weights" * 100)
    before = await export_and_check(aws, store, tmp_path, notice=notice)
    assert not before.durable  # data without a manifest is not a checkpoint

    written = write_manifest(step_dir, 7, world_size=4, reason="preemption")
    after = await export_and_check(aws, store, tmp_path, notice=notice)

    assert after.durable and after.step == 7 and after.manifest == written


def drop_a_listed_file(step_dir: Path) -> None:
    (step_dir / Manifest.parse((step_dir / MANIFEST).read_text()).files[0].path).unlink()


def truncate_a_listed_file(step_dir: Path) -> None:
    path = step_dir / Manifest.parse((step_dir / MANIFEST).read_text()).files[0].path
    path.write_bytes(path.read_bytes()[:-1])


def flip_a_byte(step_dir: Path) -> None:
    path = step_dir / Manifest.parse((step_dir / MANIFEST).read_text()).files[0].path
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def tear_the_manifest(step_dir: Path) -> None:
    text = (step_dir / MANIFEST).read_text()
    (step_dir / MANIFEST).write_text(text[: len(text) // 2])


def move_to_another_step(step_dir: Path) -> None:
    step_dir.rename(step_dir.with_name("step-4"))



@pytest.mark.parametrize(
    ("damage", "daemon_says", "trainer_says", "sha256"),
    [
        (drop_a_listed_file, "files not in S3", "is listed but missing", False),
        (truncate_a_listed_file, "bytes, manifest says", "bytes, manifest says", False),
        (flip_a_byte, "sha256", "sha256", True),
        (tear_the_manifest, "malformed manifest", "not valid JSON", False),
        (move_to_another_step, "says step 3, its directory says step 4", "manifest says step 3", False),
    ],
    ids=["file-missing", "file-truncated", "file-changed", "manifest-torn", "wrong-directory"],
)
async def test_each_damage_is_refused_by_the_daemon_and_by_the_trainer(
        aws: Any, store: S3Store, tmp_path: Path, own_sigterm: None, damage: Callable[[Path], None],
        daemon_says: str, trainer_says: str, sha256: bool) -> None:
    notice = datetime.now(timezone.utc) - timedelta(seconds=1)
    step_dir = train_and_save(tmp_path)
    shutil.rmtree(tmp_path / "step-2")  # only the damaged checkpoint is left to find
    damage(step_dir)
    damaged = step_dir if step_dir.exists() else step_dir.with_name("step-4")

    result = await export_and_check(aws, store, tmp_path, notice=notice, sha256=sha256)

    assert not result.durable, result
    assert any(daemon_says in why for why in (result.reason or "", *result.rejected)), result
    with pytest.raises(CorruptCheckpoint, match=trainer_says):
        verify(damaged)


async def test_a_whole_checkpoint_saved_before_the_notice_is_not_the_notices_checkpoint(
        aws: Any, store: S3Store, tmp_path: Path, own_sigterm: None) -> None:
    train_and_save(tmp_path)
    notice = datetime.now(timezone.utc) + timedelta(seconds=1)

    result = await export_and_check(aws, store, tmp_path, notice=notice)

    assert not result.durable and result.fallback_step == 3 and result.steps_lost == 0
