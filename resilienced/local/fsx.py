"""The FSx stand-in for tests and the drill: a local checkpoint root auto-exported to S3.

:class:`LocalExporter` watches a local directory (the "file system") and does what an FSx for
Lustre data repository association with auto-export (NEW, CHANGED, DELETED) does to the run's
S3 prefix, closely enough for the durable step to be exercised end to end:

* NEW / CHANGED: a file whose (size, mtime) differs from what was last exported is uploaded to
  ``s3://bucket/prefix/<path relative to root>``, with the ``x-amz-meta-file-mtime`` /
  ``user-agent`` metadata FSx sets;
* DELETED: objects of files that are gone (a pruned checkpoint) are deleted;
* only committed checkpoints and the trainer's resume records are exported: files under
  ``step-<N>/`` and ``resume/`` (``trainer.resume``; FSx exports every file).  A save in progress
  (``step-<N>.partial/``) and the trainer's ``.trash-*`` directories are never exported (the
  trainer renames ``.partial`` to ``step-<N>`` once ``manifest.json`` is written; FSx would
  export the ``.partial`` files and delete them again on the rename, which changes nothing the
  durable step looks at);
* in arbitrary order: the files found by one scan are uploaded in order, or shuffled
  (``shuffle=True``), each after a delay drawn from ``delay`` -- knobs for tests and the drill
  (FSx documents no ordering and no latency).

It runs as an asyncio task (:meth:`start` / :meth:`stop`, or ``async with``) and records each
export in :attr:`timeline` (wall-clock time, action, key, size) for the drill's report.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session

from resilienced import supervisor
from resilienced.log import get as get_logger
from trainer import resume

log = get_logger(__name__)

_COMMITTED = re.compile(r"^step-(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class ExportRecord:
    """One export as it happened: ``action`` is NEW, CHANGED or DELETED."""

    at_unix: float
    action: str
    path: str  # relative to the root, posix
    key: str
    size: int


class LocalExporter:
    """Auto-export of a local checkpoint root to S3 (moto server in tests and the drill).

    Args:
        root: the local checkpoint root (may not exist yet).
        bucket, prefix: where checkpoints go (``s3://bucket/prefix``); the bucket must exist.
        endpoint_url, region: the S3 endpoint (the moto server).
        poll_interval: seconds between scans of the root.
        shuffle: upload the files found by one scan in random order.
        delay: seconds to wait before each upload: a number, or a (low, high) range to draw from.
        seed: seed of the random order and delays (reproducible runs).
        sha256_checksums: upload with ``ChecksumAlgorithm=SHA256`` so S3 holds each file's
            SHA-256 (FSx does not; off by default to be like it).
    """

    def __init__(
        self,
        *,
        root: Path,
        bucket: str,
        prefix: str,
        endpoint_url: str,
        region: str,
        poll_interval: float = 0.2,
        shuffle: bool = False,
        delay: float | tuple[float, float] = 0.0,
        seed: int | None = None,
        sha256_checksums: bool = False,
    ) -> None:
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
        low, high = (delay, delay) if isinstance(delay, (int, float)) else delay
        if low < 0 or high < low:
            raise ValueError(f"delay must be >= 0 or a (low, high) range with low <= high, got {delay}")
        self.root = Path(root)
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._endpoint_url = endpoint_url
        self._region = region
        self._poll = poll_interval
        self._shuffle = shuffle
        self._delay = (float(low), float(high))
        self._random = random.Random(seed)
        self._sha256 = sha256_checksums
        self._exported: dict[str, tuple[int, int]] = {}  # rel path -> (size, mtime_ns) in S3
        self.timeline: list[ExportRecord] = []
        self.errors: list[str] = []
        self._task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._idle = asyncio.Event()
        self._scans_started = 0
        self._last_idle_scan = 0  # number of the latest scan that found nothing to do
        self._client_cm: Any = None
        self._client: Any = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "LocalExporter":
        if self._task is not None:
            return self
        self._client_cm = get_session().create_client("s3", region_name=self._region,
                                                      endpoint_url=self._endpoint_url)
        self._client = await self._client_cm.__aenter__()
        self._stopping = False
        self._task = supervisor.spawn(self._run(), name=f"fsxlocal {self.root}")
        return self

    async def stop(self) -> None:
        """Stop scanning (an upload in flight is cancelled) and close the client; idempotent."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # logged by the task guard
                pass
        cm, self._client_cm, self._client = self._client_cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def __aenter__(self) -> "LocalExporter":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_idle(self, *, timeout: float) -> None:
        """Wait until a scan that began after this call found nothing left to export.

        Everything on disk when this was called is then in S3 (or deleted from it).
        """
        called_at = self._scans_started

        async def idle_after_call() -> None:
            while self._last_idle_scan <= called_at:
                self._idle.clear()
                await self._idle.wait()

        async with asyncio.timeout(timeout):
            await idle_after_call()

    def exported_at(self, path: str) -> float | None:
        """When ``path`` (relative to the root) was last exported (unix seconds), or None."""
        for record in reversed(self.timeline):
            if record.path == path and record.action != "DELETED":
                return record.at_unix
        return None

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._stopping:
            self._scans_started += 1
            scan = self._scans_started
            try:
                did = await self._scan_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep exporting: S3 may come back
                self.errors.append(f"{type(e).__name__}: {e}")
                log.warning("local exporter failed", error_type=type(e).__name__, error=str(e))
                did = True
            if not did:
                self._last_idle_scan = scan
                self._idle.set()
            await asyncio.sleep(self._poll)

    async def _scan_once(self) -> bool:
        """One pass: upload what is new or changed, delete what is gone; True if it did any."""
        on_disk = await asyncio.to_thread(self._committed_files)
        work: list[tuple[str, str, int, int]] = []
        for rel, (size, mtime_ns) in on_disk.items():
            before = self._exported.get(rel)
            if before != (size, mtime_ns):
                work.append(("NEW" if before is None else "CHANGED", rel, size, mtime_ns))
        for rel in self._exported:
            if rel not in on_disk:
                work.append(("DELETED", rel, 0, 0))
        if self._shuffle:
            self._random.shuffle(work)
        for action, rel, size, mtime_ns in work:
            low, high = self._delay
            if high > 0:
                await asyncio.sleep(self._random.uniform(low, high))
            if action == "DELETED":
                await self._client.delete_object(Bucket=self.bucket, Key=self.prefix + rel)
                self._exported.pop(rel, None)
                self._record(action, rel, 0)
            else:
                await self._upload(action, rel, size, mtime_ns)
        return bool(work)

    def _committed_files(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        try:
            children = list(os.scandir(self.root))
        except FileNotFoundError:
            return out
        for child in children:
            if not (child.is_dir(follow_symlinks=False)
                    and (_COMMITTED.match(child.name) or child.name == resume.FOLDER)):
                continue
            for dirpath, _, filenames in os.walk(child.path):
                for name in filenames:
                    if child.name == resume.FOLDER and not resume.is_record_name(name):
                        continue  # a record being written (temporary name)
                    full = os.path.join(dirpath, name)
                    try:
                        st = os.stat(full, follow_symlinks=False)
                    except FileNotFoundError:  # removed while we looked (a prune)
                        continue
                    rel = Path(full).relative_to(self.root).as_posix()
                    out[rel] = (st.st_size, st.st_mtime_ns)
        return out

    async def _upload(self, action: str, rel: str, size: int, mtime_ns: int) -> None:
        path = self.root / rel
        try:
            body = await asyncio.to_thread(path.read_bytes)
            st = path.stat()
        except FileNotFoundError:
            return  # gone since the scan: the next scan deletes its object if it was exported
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns) or len(body) != st.st_size:
            return  # still being modified: FSx exports once the file is closed; look again later
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket, "Key": self.prefix + rel, "Body": body,
            "Metadata": {"file-mtime": f"{mtime_ns}ns", "user-agent": "aws-fsx-lustre"},
        }
        if self._sha256:
            kwargs["ChecksumAlgorithm"] = "SHA256"
            kwargs["ChecksumSHA256"] = base64.b64encode(hashlib.sha256(body).digest()).decode()
        await self._client.put_object(**kwargs)
        self._exported[rel] = (size, mtime_ns)
        self._record(action, rel, size)

    def _record(self, action: str, rel: str, size: int) -> None:
        self.timeline.append(ExportRecord(at_unix=time.time(), action=action, path=rel,
                                          key=self.prefix + rel, size=size))
