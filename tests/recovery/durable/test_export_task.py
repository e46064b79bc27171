"""wait_durable in ``--export-mode task``: FSx export tasks through the Stubber, S3 on moto.

FSx itself is not here: where a test needs "the task exported the files", a hook on the fsx
client uploads them to moto S3 when the create call is made, as the real export would.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from botocore.stub import Stubber

from resilienced.aws.fsx import FsxExportTasks
from resilienced.aws.s3 import S3Store
from resilienced.recovery.durable import wait_durable

from tests.support.checkpoints import BUCKET, URI, make_ckpt, put_ckpt
from tests.aws.test_fsx import FS, OTHER, REPORT, TASK, create_request, running_request, task
import pytest

pytestmark = pytest.mark.integration

NOTICE = (datetime.now(timezone.utc) - timedelta(minutes=5)).replace(microsecond=0)
TASK2 = "task-0aaaaaaaaaaaaaaaa1"


def soon(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


def exporter(client: Any) -> FsxExportTasks:
    return FsxExportTasks(client=client, report_path=REPORT, mount_point="/fsx", poll_interval=0.01)


async def test_succeeded_export_then_verified_in_s3(fsx: tuple[Any, Stubber], s3: Any, store: S3Store) -> None:
    client, stub = fsx
    await put_ckpt(s3, make_ckpt(7, saved=NOTICE + timedelta(seconds=2)))
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"], token="evt-1-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="EXECUTING")]}, {"TaskIds": [TASK]})
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="SUCCEEDED")]}, {"TaskIds": [TASK]})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.01, export=exporter(client), file_system_id=FS,
                                export_paths=["/fsx/runs/demo"], export_token="evt-1")

    assert result.durable, result.reason
    assert result.step == 7
    assert result.export_tasks == (TASK,)


async def test_failed_export_reads_the_report_from_s3_and_falls_back(
    fsx: tuple[Any, Stubber], s3: Any, store: S3Store
) -> None:
    client, stub = fsx
    await put_ckpt(s3, make_ckpt(5, saved=NOTICE - timedelta(minutes=20), reason="periodic"))
    await put_ckpt(s3, make_ckpt(6, saved=NOTICE + timedelta(seconds=3)), skip=("__1_0.distcp",))
    await s3.put_object(
        Bucket=BUCKET, Key=f"runs/demo/reports/{TASK}/failures.csv",
        Body=b"runs/demo/step-6/__1_0.distcp,failed,FileSizeTooLarge\n",
    )
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"], token="evt-2-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="FAILED", failure="1 file failed to export")]},
                      {"TaskIds": [TASK]})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.01, export=exporter(client), file_system_id=FS,
                                export_paths=["runs/demo"], export_token="evt-2")

    assert not result.durable
    assert result.fallback_step == 5
    assert result.steps_lost == 1
    assert f"export task {TASK} FAILED: 1 file failed to export" in result.reason
    assert "failed files: runs/demo/step-6/__1_0.distcp (FileSizeTooLarge)" in result.reason
    assert result.export_tasks == (TASK,)


async def test_a_failed_export_without_its_report_says_so(fsx: tuple[Any, Stubber], store: S3Store) -> None:
    client, stub = fsx
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"], token="evt-3-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="FAILED", failure="path not found")]},
                      {"TaskIds": [TASK]})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.01, export=exporter(client), file_system_id=FS,
                                export_paths=["runs/demo"], export_token="evt-3")

    assert not result.durable
    assert f"no report at {REPORT}/{TASK}/failures.csv" in result.reason


async def test_an_export_that_ran_before_the_save_finished_is_followed_by_another(
    fsx: tuple[Any, Stubber], s3: Any, store: S3Store
) -> None:
    client, stub = fsx
    ckpt = make_ckpt(12, saved=NOTICE + timedelta(seconds=4))
    creates = 0

    async def fsx_exports_on_create(**_: Any) -> None:
        nonlocal creates
        creates += 1
        if creates == 2:  # by the second export the trainer's save is on the file system
            await put_ckpt(s3, ckpt)

    client.meta.events.register("before-parameter-build.fsx.CreateDataRepositoryTask", fsx_exports_on_create)
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"], token="evt-4-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="SUCCEEDED")]}, {"TaskIds": [TASK]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task(TASK2)},
                      create_request(["runs/demo"], token="evt-4-2"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(TASK2, lifecycle="SUCCEEDED")]}, {"TaskIds": [TASK2]})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.01, export=exporter(client), file_system_id=FS,
                                export_paths=["runs/demo"], export_token="evt-4")

    assert result.durable, result.reason
    assert result.step == 12
    assert result.export_tasks == (TASK, TASK2)


async def test_a_busy_file_system_is_waited_out_then_exported(
    fsx: tuple[Any, Stubber], s3: Any, store: S3Store
) -> None:
    client, stub = fsx
    await put_ckpt(s3, make_ckpt(3, saved=NOTICE + timedelta(seconds=1)))
    stub.add_client_error("create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
                          http_status_code=400, expected_params=create_request(["runs/demo"], token="evt-5-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "EXECUTING")]}, running_request())
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(OTHER, "SUCCEEDED")]}, {"TaskIds": [OTHER]})
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task()},
                      create_request(["runs/demo"], token="evt-5-1"))
    stub.add_response("describe_data_repository_tasks",
                      {"DataRepositoryTasks": [task(lifecycle="SUCCEEDED")]}, {"TaskIds": [TASK]})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.01, export=exporter(client), file_system_id=FS,
                                export_paths=["runs/demo"], export_token="evt-5")

    assert result.durable and result.step == 3
    assert result.export_tasks == (TASK,)
