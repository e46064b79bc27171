"""The durable step: wait until a checkpoint saved after the notice is in S3 (decision 2).

S3 is the source of truth.  The trainer writes, per checkpoint, ``<root>/step-<N>/`` with
``manifest.json`` last.  The format has one definition, ``trainer/manifest.py`` (standard
library only), which the trainer writes with and this module reads with.

FSx exports the checkpoint root to the run's S3 prefix (``checkpoint_uri``), so the same layout
appears under ``s3://bucket/prefix/step-<N>/``.  A checkpoint is **durable** when

1. ``step-<N>/manifest.json`` is in S3 and parses (``Manifest.parse``), with ``step == N``;
2. every file it lists is in S3 under ``step-<N>/`` with the listed size, and with the listed
   SHA-256 where S3 holds a (whole-object) SHA-256 checksum for it.

The step wants a durable checkpoint *saved after the notice* (manifest ``time`` >= the notice
time): an older one does not hold the step the run was on.  Nothing is trusted before it is
verified: a malformed manifest is never used (the reason is logged and reported), a file with
the wrong size or checksum makes its checkpoint not durable (yet: a later export may fix it).

Two export modes (``--export-mode``):

* ``auto`` (default): the data repository association auto-exports (NEW, CHANGED, DELETED);
  files arrive asynchronously and in any order, so this just polls S3 until a post-notice
  checkpoint is durable.
* ``task``: the association does not auto-export (AWS: "Automatic export and export data
  repository tasks cannot run at the same time").  Export tasks for the checkpoint paths are
  started and followed until SUCCEEDED, then S3 is verified as above.  The save may still be
  running when a task starts (an export takes only what is on the file system then), so when a
  SUCCEEDED task leaves no durable post-notice checkpoint another task is started, until the
  deadline.  A FAILED task's report (``failures.csv`` in S3) names the files that failed; a
  FAILED or CANCELED task is not retried (S3 is still checked once).

When nothing durable arrives by ``deadline + grace_seconds``, the result names the *fallback*:
the newest checkpoint from before the notice that is durable, and how many steps resuming from
it costs at least (the newest step number seen in S3 minus the fallback's step).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from resilienced.aws.fsx import parse_failures_csv
from resilienced.aws.s3 import ObjectNotFound, parse_s3_uri
from resilienced.clock import utcnow
from resilienced.errors import BackendUnavailable, PermanentError
from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.ports import ExportTask, ExportTasks, ObjectStore, StoredObject
from trainer.manifest import MANIFEST, Manifest, ManifestError

log = get_logger(__name__)

_STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)/(.+)$")
_MAX_POLL_S = 60.0


@dataclass(frozen=True)
class DurableResult:
    """What :func:`wait_durable` found.

    ``durable``: a checkpoint saved after the notice is in S3 (``step``, ``manifest``).
    Otherwise ``fallback_step`` is the newest durable checkpoint from before the notice (None:
    there is none) and ``steps_lost`` a lower bound of the steps resuming from it repeats
    (the newest step number seen in S3 minus ``fallback_step``; None when no step was seen).
    ``reason`` says why nothing durable arrived; ``rejected`` lists the checkpoints looked at
    and not trusted, with why; ``export_tasks`` the FSx task ids started (task mode);
    ``details``: ``export_mode`` and ``newest_seen_step``.
    """

    durable: bool
    step: int | None
    manifest: Manifest | None
    waited_s: float
    fallback_step: int | None = None
    fallback_manifest: Manifest | None = None
    steps_lost: int | None = None
    reason: str | None = None
    rejected: tuple[str, ...] = ()
    export_tasks: tuple[str, ...] = ()
    details: Mapping[str, JsonValue] = field(default_factory=dict)


# --------------------------------------------------------------------------- one look at S3
@dataclass
class _Checkpoint:
    step: int
    objects: dict[str, StoredObject]  # path relative to the step dir -> object


@dataclass(frozen=True)
class _Verdict:
    step: int
    durable: bool
    manifest: Manifest | None
    why: str | None  # when not durable


class _Looker:
    """Lists the prefix and verifies checkpoints; caches manifests by (key, size, time)."""

    def __init__(self, *, store: ObjectStore, bucket: str, prefix: str) -> None:
        self.store = store
        self.bucket = bucket
        self.prefix = prefix
        self._manifests: dict[tuple[str, int, datetime | None], Manifest | ManifestError] = {}
        self.newest_seen: int | None = None
        self.rejected: dict[int, str] = {}

    async def look(self) -> dict[int, _Checkpoint]:
        objects = await self.store.list(bucket=self.bucket, prefix=self.prefix)
        steps: dict[int, _Checkpoint] = {}
        for obj in objects:
            m = _STEP_DIR.match(obj.key[len(self.prefix):]) if obj.key.startswith(self.prefix) else None
            if not m:
                continue  # step-N.partial/, .trash-*, reports/ ...: not a committed checkpoint
            step = int(m.group(1))
            steps.setdefault(step, _Checkpoint(step, {})).objects[m.group(2)] = obj
        if steps:
            newest = max(steps)
            self.newest_seen = newest if self.newest_seen is None else max(self.newest_seen, newest)
        return steps

    async def verify(self, ckpt: _Checkpoint) -> _Verdict:
        manifest_obj = ckpt.objects.get(MANIFEST)
        if manifest_obj is None:
            return _Verdict(ckpt.step, False, None, "no manifest.json yet")
        cache_key = (manifest_obj.key, manifest_obj.size, manifest_obj.last_modified)
        parsed = self._manifests.get(cache_key)
        if parsed is None:
            try:
                raw = await self.store.get(bucket=self.bucket, key=manifest_obj.key)
            except ObjectNotFound:
                return _Verdict(ckpt.step, False, None, "manifest.json vanished after the listing")
            try:
                where = f"s3://{self.bucket}/{manifest_obj.key}"
                parsed = Manifest.parse(raw, where=where)
                if parsed.step != ckpt.step:
                    raise ManifestError(where, f"says step {parsed.step}, its directory says step {ckpt.step}")
            except ManifestError as e:
                parsed = e
                log.warning("checkpoint not trusted", step=ckpt.step, error=str(e))
            self._manifests[cache_key] = parsed
        if isinstance(parsed, ManifestError):
            return _Verdict(ckpt.step, False, None, f"malformed manifest: {parsed}")
        missing, wrong = [], []
        for f in parsed.files:
            obj = ckpt.objects.get(f.path)
            if obj is None:
                missing.append(f.path)
            elif obj.size != f.size:
                wrong.append(f"{f.path} has {obj.size} bytes, manifest says {f.size}")
            elif obj.checksum_sha256 is not None and obj.checksum_sha256.lower() != f.sha256:
                wrong.append(f"{f.path} sha256 {obj.checksum_sha256} != manifest {f.sha256}")
        if wrong:
            return _Verdict(ckpt.step, False, parsed, "; ".join(wrong))
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            return _Verdict(ckpt.step, False, parsed,
                            f"{len(missing)} of {len(parsed.files)} files not in S3 yet: {shown}")
        return _Verdict(ckpt.step, True, parsed, None)

    async def newest(self, *, after: datetime | None, before: datetime | None,
                     steps: dict[int, _Checkpoint]) -> _Verdict | None:
        """The newest durable checkpoint saved at/after ``after`` or before ``before``."""
        for step in sorted(steps, reverse=True):
            verdict = await self.verify(steps[step])
            if not verdict.durable:
                self.rejected[step] = verdict.why or "not durable"
                continue
            assert verdict.manifest is not None, "a durable verdict carries its manifest"
            when = verdict.manifest.time
            if after is not None and when < after:
                continue
            if before is not None and when >= before:
                continue
            self.rejected.pop(step, None)
            return verdict
        return None


# --------------------------------------------------------------------------- one look, public
async def newest_durable(*, store: ObjectStore, uri: str, before: datetime | None = None) -> Manifest | None:
    """The manifest of the newest checkpoint under ``uri`` that is durable now (manifest and every
    file in S3 with its size), saved before ``before`` when given; None when there is none.

    Used when an instance is already gone (a state change with no notice): the run resumes from
    this checkpoint, and the daemon records which one.
    """
    from resilienced.aws.s3 import parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    looker = _Looker(store=store, bucket=bucket, prefix=prefix)
    verdict = await looker.newest(after=None, before=before, steps=await looker.look())
    return verdict.manifest if verdict is not None else None


# --------------------------------------------------------------------------- the wait
async def wait_durable(
    *,
    store: ObjectStore,
    uri: str,
    notice_time: datetime,
    deadline: datetime,
    grace_seconds: float = 0.0,
    poll_interval: float = 2.0,
    export: ExportTasks | None = None,
    file_system_id: str | None = None,
    export_paths: Sequence[str] = (),
    export_token: str = "resilienced",
    clock: Callable[[], datetime] | None = None,
) -> DurableResult:
    """Wait until a checkpoint saved after ``notice_time`` is durable in S3 under ``uri``.

    S3 answering with a temporary error (``BackendUnavailable``) while waiting is retried at the
    next poll; if the last look at the deadline fails too, that error is raised (the message is
    retried later, when S3 may show the checkpoint).  ``PermanentError`` (no such bucket, access
    denied, an FSx request AWS refuses) and ``ValueError`` (bad arguments) are raised at once.

    Args:
        store: the object store (``S3Store``).
        uri: the run's checkpoint prefix, ``s3://bucket/prefix``.
        notice_time: when the interruption notice was issued (tz-aware).
        deadline: when the capacity goes away (tz-aware); the wait ends at
            ``deadline + grace_seconds`` (S3 may still receive an export that FSx queued).
        poll_interval: seconds between looks at S3 (and at an export task), at most 60.
        export: FSx export tasks (``--export-mode task``); None: auto-export (``auto``).
        file_system_id: the FSx file system (task mode).
        export_paths: what to export, relative to the mount point or absolute under it: the
            run's checkpoint root (task mode).
        export_token: the base of each task's ClientRequestToken (the claim key, say): a
            redelivered message does not start a second task for the same attempt.
        clock: wall-clock "now" as a tz-aware datetime (default: the system clock).
    """
    for name, value in (("notice_time", notice_time), ("deadline", deadline)):
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise ValueError(f"{name} must be a tz-aware datetime, got {value!r}")
    if not 0 < poll_interval <= _MAX_POLL_S:
        raise ValueError(f"poll_interval must be in (0, {_MAX_POLL_S:.0f}] seconds, got {poll_interval}")
    if grace_seconds < 0:
        raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds}")
    if export is not None and (not file_system_id or not export_paths):
        raise ValueError("export mode 'task' needs file_system_id and export_paths")
    wait = _Wait(store=store, uri=uri, notice_time=notice_time, give_up=deadline.timestamp() + grace_seconds,
                 poll_interval=poll_interval, clock=clock, mode="auto" if export is None else "task")
    if export is None:
        found = await wait.auto_export()
    else:
        assert file_system_id is not None  # checked above: task mode needs it
        found = await wait.export_tasks(export, file_system_id=file_system_id,
                                        paths=list(export_paths), token=export_token)
    if found is not None:
        return wait.done(found)
    return await wait.nothing_durable(deadline=deadline, grace_seconds=grace_seconds)


class _Wait:
    """One :func:`wait_durable`: its clock, its looks at S3 and what they noted on the way."""

    def __init__(self, *, store: ObjectStore, uri: str, notice_time: datetime, give_up: float,
                 poll_interval: float, clock: Callable[[], datetime] | None, mode: str) -> None:
        bucket, prefix = parse_s3_uri(uri)
        self.uri, self.notice_time, self.give_up, self.mode = uri, notice_time, give_up, mode
        self.poll_interval = poll_interval
        self.store = store
        self.now = clock or utcnow
        self.started = time.monotonic()
        self.looker = _Looker(store=store, bucket=bucket, prefix=prefix)
        self.tasks: list[str] = []
        self.notes: list[str] = []
        self.notes_s3: list[str] = []

    def left(self) -> float:
        return self.give_up - self.now().timestamp()

    async def pause(self) -> None:
        await asyncio.sleep(min(self.poll_interval, max(self.left(), 0.0)))

    def done(self, verdict: _Verdict) -> DurableResult:
        assert verdict.manifest is not None, "a durable verdict carries its manifest"
        log.info("checkpoint durable", step=verdict.step, uri=self.uri,
                 saved=verdict.manifest.time.isoformat(), files=len(verdict.manifest.files))
        return DurableResult(durable=True, step=verdict.step, manifest=verdict.manifest,
                             waited_s=time.monotonic() - self.started, export_tasks=tuple(self.tasks),
                             details={"export_mode": self.mode, "newest_seen_step": self.looker.newest_seen})

    async def look_once(self) -> _Verdict | None:
        """The newest durable post-notice checkpoint; None also when S3 did not answer."""
        try:
            steps = await self.looker.look()
            return await self.looker.newest(after=self.notice_time, before=None, steps=steps)
        except BackendUnavailable as e:
            log.warning("durable: S3 did not answer; looking again", error=str(e), delay_s=self.poll_interval)
            self.notes_s3.append(str(e))
            return None

    async def auto_export(self) -> _Verdict | None:
        """Auto-export: look at S3 every poll until the give-up time."""
        while True:
            verdict = await self.look_once()
            if verdict is not None or self.left() <= 0:
                return verdict
            await self.pause()

    async def export_tasks(self, export: ExportTasks, *, file_system_id: str, paths: list[str],
                           token: str) -> _Verdict | None:
        """Export tasks: one at a time, followed to its end, then a look at S3; again while time is left."""
        attempt = 0
        while self.left() > 0:
            attempt += 1
            task = await export.start_export(file_system_id=file_system_id, paths=paths,
                                             token=_token(token, attempt))
            self.tasks.append(task.task_id)
            task = await _follow(export, task, poll_interval=self.poll_interval, left=self.left)
            if task.lifecycle in ("FAILED", "CANCELED"):
                self.notes.append(await _task_failure(self.store, task))
                log.warning("durable: export task", note=self.notes[-1])
            elif task.lifecycle != "SUCCEEDED":
                self.notes.append(f"export task {task.task_id} still {task.lifecycle} at the deadline")
                return None
            verdict = await self.look_once()
            if verdict is not None:
                return verdict
            if task.lifecycle != "SUCCEEDED":
                return None  # a failed export fails again; a cancelled one was stopped on purpose
            log.info("export task SUCCEEDED but no post-notice checkpoint is durable yet; exporting again",
                     task_id=task.task_id)
            if self.left() > 0:
                await self.pause()
        return None

    async def nothing_durable(self, *, deadline: datetime, grace_seconds: float) -> DurableResult:
        """Nothing durable after the notice: the newest durable one from before it.

        This last look raises when S3 does not answer: without it there is no fallback to name.
        """
        looker = self.looker
        steps = await looker.look()
        last = await looker.newest(after=self.notice_time, before=None, steps=steps)
        if last is not None:  # arrived during the very last interval
            return self.done(last)
        fallback = await looker.newest(after=None, before=self.notice_time, steps=steps)
        newer = sorted((s for s in looker.rejected if fallback is None or s > fallback.step), reverse=True)
        reason = (
            f"no checkpoint saved after the notice ({self.notice_time.isoformat()}) was durable in {self.uri} "
            f"by {deadline.isoformat()} + {grace_seconds:g}s"
        )
        if self.notes:
            reason += "; " + "; ".join(self.notes)
        if self.notes_s3:
            reason += f"; S3 did not answer {len(self.notes_s3)} time(s), last: {self.notes_s3[-1]}"
        if newer:
            reason += "; " + "; ".join(f"step {s}: {looker.rejected[s]}" for s in newer[:5])
        fallback_step = fallback.step if fallback else None
        newest_seen = looker.newest_seen
        steps_lost = None if newest_seen is None else max(0, newest_seen - (fallback_step or 0))
        log.warning("durable: none by the deadline", reason=reason, fallback_step=fallback_step,
                    steps_lost=steps_lost)
        return DurableResult(
            durable=False, step=None, manifest=None, waited_s=time.monotonic() - self.started,
            fallback_step=fallback_step, fallback_manifest=fallback.manifest if fallback else None,
            steps_lost=steps_lost, reason=reason,
            rejected=tuple(f"step {s}: {w}" for s, w in sorted(looker.rejected.items(), reverse=True)),
            export_tasks=tuple(self.tasks),
            details={"export_mode": self.mode, "newest_seen_step": newest_seen},
        )


def _token(base: str, attempt: int) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", base) or "resilienced"
    suffix = f"-{attempt}"
    return clean[: 63 - len(suffix)] + suffix


async def _follow(export: ExportTasks, task: ExportTask, *, poll_interval: float,
                  left: Callable[[], float]) -> ExportTask:
    """Poll the task until it ends or time runs out."""
    while task.lifecycle not in ("SUCCEEDED", "FAILED", "CANCELED") and left() > 0:
        await asyncio.sleep(min(poll_interval, max(left(), 0.0)))
        task = await export.describe(task_id=task.task_id)
    return task


async def _task_failure(store: ObjectStore, task: ExportTask) -> str:
    """Why an export task failed, with the files its report names."""
    text = f"export task {task.task_id} {task.lifecycle}"
    if task.failure:
        text += f": {task.failure}"
    if not task.report_path:
        return text
    try:
        bucket, key = parse_s3_uri(task.report_path)
        raw = await store.get(bucket=bucket, key=key.rstrip("/"))
    except ObjectNotFound:
        return text + f" (no report at {task.report_path})"
    except (ValueError, PermanentError) as e:
        return text + f" (report unreadable: {e})"
    rows = parse_failures_csv(raw.decode("utf-8", errors="replace"))
    failed = [f"{path} ({code or status})" for path, status, code in rows]
    if failed:
        shown = ", ".join(failed[:10]) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
        text += f"; failed files: {shown}"
    return text
