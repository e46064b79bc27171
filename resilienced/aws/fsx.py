"""The FSx adapter: :class:`FsxExportTasks` implements :class:`~resilienced.ports.ExportTasks`.

Used by ``--export-mode task``: export one checkpoint directory to the file system's S3 data
repository with ``CreateDataRepositoryTask`` (type ``EXPORT_TO_REPOSITORY``) and follow it with
``DescribeDataRepositoryTasks``.  AWS facts this relies on (FSx API reference and Lustre guide):

* ``Paths`` are relative to the file system's mount point (``/fsx/ckpt/step-3`` ->
  ``ckpt/step-3``); at most 100.  An invalid path fails the task.
* ``Report`` is required.  With ``Enabled``, ``Format=REPORT_CSV_20191124`` and
  ``Scope=FAILED_FILES_ONLY`` FSx writes ``{Report.Path}/{TaskId}/failures.csv`` into the linked
  bucket (lines ``FilePath,FileStatus,ErrorCode``); ``Report.Path`` must lie within the
  repository's export path.  :attr:`ExportTask.report_path` is that CSV's ``s3://`` URI.
* ``ClientRequestToken`` makes the create idempotent: a retried create with the same token
  returns the same task.
* One data repository task runs at a time per file system: a create while another runs fails
  with ``DataRepositoryTaskExecuting``.  :meth:`FsxExportTasks.start_export` then finds the running
  task (``DescribeDataRepositoryTasks`` filtered on the file system and the PENDING/EXECUTING
  lifecycles), waits until it ends, and creates again, within ``busy_timeout``.
* Auto-export and export tasks cannot run at the same time on one association (AWS: "Automatic
  export and export data repository tasks cannot run at the same time"): ``task`` mode is for file
  systems whose association does not auto-export.

moto does not implement these calls; the tests drive this adapter through botocore's
``Stubber``, which checks every request and response against AWS's FSx service model.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence

from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.errors import BackendUnavailable, PermanentError, ResilienceError
from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.ports import ExportTask

log = get_logger(__name__)

BACKEND = "fsx"
RUNNING = ("PENDING", "EXECUTING")
FINISHED = ("SUCCEEDED", "FAILED", "CANCELED")
_FS_ID_RE = re.compile(r"^fs-[0-9a-f]{8,}$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")
_TASK_ID_RE = re.compile(r"^task-[0-9a-f]{17,}$")
#: The one answer read as something else: another data repository task runs on the file system.
BUSY = "DataRepositoryTaskExecuting"
_MAX_PATHS = 100


def translate(error: BaseException, *, operation: str) -> ResilienceError:
    """The resilienced error for a library error raised by an FSx call (the one rule)."""
    return errors.translate(error, backend=BACKEND, operation=operation)


class FsxExportTasks:
    """``ports.ExportTasks`` on an aiobotocore ``fsx`` client owned by the caller.

    Args:
        client: an aiobotocore ``fsx`` client.
        report_path: where FSx writes task reports, ``s3://bucket/prefix`` inside the data
            repository's export path.
        mount_point: the file system's mount point on the training nodes; absolute paths under
            it are made relative (paths already relative are taken as they are).
        busy_timeout: seconds :meth:`start_export` waits for another running task to end.
        poll_interval: seconds between looks at that running task.
    """

    def __init__(self, *, client: AioBaseClient, report_path: str, mount_point: str = "/fsx",
                 busy_timeout: float = 600.0, poll_interval: float = 5.0) -> None:
        if not isinstance(report_path, str) or not report_path.startswith("s3://") or len(report_path) < 8:
            raise ValueError(f"report_path {report_path!r} must be an s3:// URI inside the export path")
        if not mount_point.startswith("/"):
            raise ValueError(f"mount_point {mount_point!r} must be an absolute path")
        if poll_interval <= 0 or busy_timeout < 0:
            raise ValueError("poll_interval must be > 0 and busy_timeout >= 0")
        self._client = client
        self.report_path = report_path.rstrip("/")
        self.mount_point = "/" + mount_point.strip("/")
        self._busy_timeout = busy_timeout
        self._poll = poll_interval

    def relative(self, path: str) -> str:
        """A path as FSx wants it: relative to the mount point, no leading or trailing '/'."""
        if not isinstance(path, str) or not path.strip():
            raise ValueError("export path is empty")
        p = path.strip()
        if p.startswith("/"):
            root = self.mount_point.rstrip("/") + "/"
            if p.rstrip("/") == self.mount_point.rstrip("/"):
                raise ValueError(f"export path {path!r} is the whole mount point; name a directory")
            if not p.startswith(root):
                raise ValueError(f"export path {path!r} is not under the mount point {self.mount_point}")
            p = p[len(root):]
        p = p.strip("/")
        parts = p.split("/")
        if not p or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"export path {path!r} has an empty, '.' or '..' segment")
        if len(p) > 4096:
            raise ValueError(f"export path {path[:40]!r}... is longer than 4096 characters")
        return p

    async def start_export(self, *, file_system_id: str, paths: Sequence[str], token: str) -> ExportTask:
        """Create an EXPORT_TO_REPOSITORY task (idempotent per ``token``), waiting out a running one."""
        if not isinstance(file_system_id, str) or not _FS_ID_RE.match(file_system_id):
            raise ValueError(f"FSx file system id {file_system_id!r} is not fs-<8+ hex>")
        if not isinstance(token, str) or not _TOKEN_RE.match(token):
            raise ValueError(f"ClientRequestToken {token!r}: 1-63 characters of A-Z a-z 0-9 _ . -")
        if isinstance(paths, str):
            raise ValueError("paths must be a list of paths, not one string")
        rel = [self.relative(p) for p in paths]
        if not rel:
            raise ValueError("no paths to export (an empty list would export the whole file system)")
        if len(rel) > _MAX_PATHS:
            raise ValueError(f"{len(rel)} paths: CreateDataRepositoryTask takes at most {_MAX_PATHS}")
        request = {
            "Type": "EXPORT_TO_REPOSITORY",
            "FileSystemId": file_system_id,
            "Paths": rel,
            "Report": {"Enabled": True, "Path": self.report_path, "Format": "REPORT_CSV_20191124",
                       "Scope": "FAILED_FILES_ONLY"},
            "ClientRequestToken": token,
        }
        give_up = time.monotonic() + self._busy_timeout
        while True:
            try:
                response = await self._client.create_data_repository_task(**request)
            except Exception as e:
                if errors.error_code(e) != BUSY:  # the named exception: wait for that task
                    raise translate(e, operation="CreateDataRepositoryTask") from e
                running = await self._running(file_system_id)
                left = give_up - time.monotonic()
                if left <= 0:
                    raise BackendUnavailable(
                        BACKEND,
                        f"{file_system_id}: another data repository task "
                        f"({', '.join(t.task_id for t in running) or 'unknown'}) still runs after "
                        f"{self._busy_timeout:.0f}s",
                        delay=self._poll,
                    ) from e
                log.info("fsx busy; waiting before exporting", file_system_id=file_system_id,
                         running=[t.task_id for t in running] or "a task", path=rel)
                await self._wait_out(running, until=give_up)
                continue
            task = self._task(response["DataRepositoryTask"])
            log.info("fsx export task", task_id=task.task_id, path=rel, lifecycle=task.lifecycle)
            return task

    async def describe(self, *, task_id: str) -> ExportTask:
        if not isinstance(task_id, str) or not _TASK_ID_RE.match(task_id):
            raise ValueError(f"FSx task id {task_id!r} is not task-<17+ hex>")
        try:
            response = await self._client.describe_data_repository_tasks(TaskIds=[task_id])
        except Exception as e:
            raise translate(e, operation="DescribeDataRepositoryTasks") from e
        tasks = response.get("DataRepositoryTasks") or []
        for raw in tasks:
            if raw.get("TaskId") == task_id:
                return self._task(raw)
        raise PermanentError(f"fsx: DescribeDataRepositoryTasks does not know task {task_id}")

    async def _running(self, file_system_id: str) -> list[ExportTask]:
        """The file system's PENDING/EXECUTING tasks (any type), all pages."""
        out: list[ExportTask] = []
        token: str | None = None
        while True:
            kwargs: dict[str, JsonValue] = {
                "Filters": [{"Name": "file-system-id", "Values": [file_system_id]},
                            {"Name": "task-lifecycle", "Values": list(RUNNING)}],
            }
            if token:
                kwargs["NextToken"] = token
            try:
                page = await self._client.describe_data_repository_tasks(**kwargs)
            except Exception as e:
                raise translate(e, operation="DescribeDataRepositoryTasks") from e
            out += [self._task(raw) for raw in page.get("DataRepositoryTasks") or []]
            token = page.get("NextToken")
            if not token:
                return out

    async def _wait_out(self, running: list[ExportTask], *, until: float) -> None:
        """Sleep until every task in ``running`` has ended (or ``until``); one poll if none known."""
        pending = [t.task_id for t in running if t.lifecycle in RUNNING]
        while True:
            await asyncio.sleep(min(self._poll, max(0.0, until - time.monotonic())))
            if not pending or time.monotonic() >= until:
                return
            still = []
            for task_id in pending:
                task = await self.describe(task_id=task_id)
                if task.lifecycle in RUNNING or task.lifecycle == "CANCELING":
                    still.append(task_id)
            if not still:
                return
            pending = still

    def _task(self, raw: dict[str, JsonValue]) -> ExportTask:
        failure = (raw.get("FailureDetails") or {}).get("Message")
        report = raw.get("Report") or {}
        report_path = None
        if report.get("Enabled") and report.get("Path"):
            report_path = f"{report['Path'].rstrip('/')}/{raw['TaskId']}/failures.csv"
        return ExportTask(task_id=raw["TaskId"], lifecycle=raw["Lifecycle"], failure=failure,
                          report_path=report_path)


def parse_failures_csv(text: str) -> list[tuple[str, str, str]]:
    """``failures.csv`` -> [(file path, status, error code)]; a header line is skipped."""
    import csv
    import io

    rows = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not any(cell.strip() for cell in row):
            continue
        if row[0].strip().lower() == "filepath":
            continue
        cells = [c.strip() for c in row] + ["", ""]
        rows.append((cells[0], cells[1], cells[2]))
    return rows
