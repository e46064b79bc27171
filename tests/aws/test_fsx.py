"""FsxExportTasks through botocore's Stubber: every request and response is checked against
AWS's FSx service model (moto implements no data repository task calls)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from botocore.stub import Stubber

from resilienced.aws.fsx import FsxExportTasks, parse_failures_csv
from resilienced.errors import BackendUnavailable, PermanentError

pytestmark = pytest.mark.unit

FS = "fs-0123456789abcdef0"
TASK = "task-0123456789abcdef0"
OTHER = "task-0fedcba9876543210"
REPORT = "s3://ckpt-bucket/runs/demo/reports"
CREATED = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def task(task_id: str = TASK, lifecycle: str = "PENDING", *, paths: list[str] | None = None,
         failure: str | None = None, kind: str = "EXPORT_TO_REPOSITORY") -> dict[str, Any]:
    raw: dict[str, Any] = {
        "TaskId": task_id, "Lifecycle": lifecycle, "Type": kind, "CreationTime": CREATED,
        "FileSystemId": FS, "Paths": paths or ["runs/demo"],
        "Report": {"Enabled": True, "Path": REPORT, "Format": "REPORT_CSV_20191124",
                   "Scope": "FAILED_FILES_ONLY"},
    }
    if failure:
        raw["FailureDetails"] = {"Message": failure}
    return raw


def create_request(paths: list[str], token: str = "evt-1-1") -> dict[str, Any]:
    return {
        "Type": "EXPORT_TO_REPOSITORY", "FileSystemId": FS, "Paths": paths,
        "Report": {"Enabled": True, "Path": REPORT, "Format": "REPORT_CSV_20191124",
                   "Scope": "FAILED_FILES_ONLY"},
        "ClientRequestToken": token,
    }


def running_request() -> dict[str, Any]:
    return {"Filters": [{"Name": "file-system-id", "Values": [FS]},
                        {"Name": "task-lifecycle", "Values": ["PENDING", "EXECUTING"]}]}


@pytest.fixture
def tasks(fsx: tuple[Any, Stubber]) -> FsxExportTasks:
    client, _ = fsx
    return FsxExportTasks(client=client, report_path=REPORT, mount_point="/fsx", poll_interval=0.01)


async def test_start_export_sends_paths_relative_to_the_mount_with_a_report_and_token(
    fsx: tuple[Any, Stubber], tasks: FsxExportTasks
) -> None:
    _, stub = fsx
    stub.add_response("create_data_repository_task",
                      {"DataRepositoryTask": task(paths=["runs/demo", "runs/demo/step-7"])},
                      create_request(["runs/demo", "runs/demo/step-7"]))

    started = await tasks.start_export(file_system_id=FS, paths=["/fsx/runs/demo/", "runs/demo/step-7"],
                                       token="evt-1-1")

    assert started.task_id == TASK
    assert started.lifecycle == "PENDING"
    assert started.report_path == f"{REPORT}/{TASK}/failures.csv"


async def test_describe_maps_lifecycle_failure_and_report(fsx: tuple[Any, Stubber],
                                                          tasks: FsxExportTasks) -> None:
    _, stub = fsx
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="FAILED", failure="2 files failed")]},
                      {"TaskIds": [TASK]})

    described = await tasks.describe(task_id=TASK)

    assert (described.lifecycle, described.failure) == ("FAILED", "2 files failed")
    assert described.report_path == f"{REPORT}/{TASK}/failures.csv"


async def test_a_running_task_is_waited_out_then_the_export_is_created(
    fsx: tuple[Any, Stubber], tasks: FsxExportTasks
) -> None:
    _, stub = fsx
    stub.add_client_error("create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
                          service_message="An existing data repository task is currently executing",
                          http_status_code=400, expected_params=create_request(["runs/demo"]))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "EXECUTING", kind="IMPORT_METADATA_FROM_REPOSITORY")]},
                      running_request())
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "EXECUTING")]}, {"TaskIds": [OTHER]})
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "SUCCEEDED")]}, {"TaskIds": [OTHER]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"]))

    started = await tasks.start_export(file_system_id=FS, paths=["runs/demo"], token="evt-1-1")

    assert started.task_id == TASK


async def test_a_file_system_busy_past_the_bound_is_backend_unavailable(fsx: tuple[Any, Stubber]) -> None:
    client, stub = fsx
    tasks = FsxExportTasks(client=client, report_path=REPORT, busy_timeout=0, poll_interval=0.01)
    stub.add_client_error("create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
                          http_status_code=400, expected_params=create_request(["runs/demo"]))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "EXECUTING")]}, running_request())

    with pytest.raises(BackendUnavailable, match=f"{OTHER}.*still runs"):
        await tasks.start_export(file_system_id=FS, paths=["runs/demo"], token="evt-1-1")


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("BadRequest", 400, PermanentError),
        ("FileSystemNotFound", 400, PermanentError),
        ("IncompatibleParameterError", 400, PermanentError),
        ("InternalServerError", 500, BackendUnavailable),
        # a quota is refused until a person raises it: permanent (before the one rule: retried)
        ("ServiceLimitExceeded", 400, PermanentError),
        ("ThrottlingException", 400, BackendUnavailable),
        ("InvalidExportPath", 400, PermanentError),  # before the one rule: retried
    ],
    ids=["bad-request", "no-file-system", "incompatible", "internal", "limit", "throttled",
         "bad-export-path"],
)
async def test_create_errors_are_translated(fsx: tuple[Any, Stubber], tasks: FsxExportTasks,
                                            code: str, status: int, error: type[Exception]) -> None:
    _, stub = fsx
    stub.add_client_error("create_data_repository_task", service_error_code=code, http_status_code=status,
                          expected_params=create_request(["runs/demo"]))
    with pytest.raises(error, match=code):
        await tasks.start_export(file_system_id=FS, paths=["runs/demo"], token="evt-1-1")


async def test_describe_of_an_unknown_task_is_permanent(fsx: tuple[Any, Stubber], tasks: FsxExportTasks) -> None:
    _, stub = fsx
    stub.add_client_error("describe_data_repository_tasks", service_error_code="DataRepositoryTaskNotFound",
                          http_status_code=400, expected_params={"TaskIds": [TASK]})
    with pytest.raises(PermanentError, match="DataRepositoryTaskNotFound"):
        await tasks.describe(task_id=TASK)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"file_system_id": "fs-xyz"}, "not fs-<8\\+ hex>"),
        ({"token": "has space"}, "ClientRequestToken"),
        ({"token": "x" * 64}, "ClientRequestToken"),
        ({"paths": []}, "no paths"),
        ({"paths": "runs/demo"}, "not one string"),
        ({"paths": ["/elsewhere/runs"]}, "not under the mount point /fsx"),
        ({"paths": ["/fsx"]}, "whole mount point"),
        ({"paths": ["runs/../etc"]}, "'..'"),
        ({"paths": [f"p{i}" for i in range(101)]}, "at most 100"),
    ],
    ids=["fs-id", "token-space", "token-long", "no-paths", "string", "outside-mount", "mount-itself",
         "dotdot", "too-many"],
)
async def test_start_export_rejects_bad_input_before_calling_aws(tasks: FsxExportTasks,
                                                                 kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"file_system_id": FS, "paths": ["runs/demo"], "token": "evt-1-1"}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        await tasks.start_export(**args)


def test_failures_csv_is_parsed_with_or_without_a_header() -> None:
    text = "FilePath,FileStatus,ErrorCode\nruns/demo/step-7/__0_0.distcp,failed,FileSizeTooLarge\n\n" \
           "\"runs/demo/step-7/a,b\",failed,PathSizeTooLong\n"
    assert parse_failures_csv(text) == [
        ("runs/demo/step-7/__0_0.distcp", "failed", "FileSizeTooLarge"),
        ("runs/demo/step-7/a,b", "failed", "PathSizeTooLong"),
    ]
