"""wait_durable in auto-export mode against S3 on the moto server over HTTP.

Objects arrive late, out of order, with the wrong size or checksum; manifests are malformed or
older than the notice; deadlines pass.  A checkpoint counts only when its manifest and every
file it lists are in S3 and check out.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from resilienced.aws.s3 import S3Store
from resilienced.errors import BackendUnavailable, PermanentError
from resilienced.recovery.durable import wait_durable

from tests.support.checkpoints import BUCKET, PREFIX, URI, make_ckpt, put_ckpt

pytestmark = pytest.mark.integration

#: The notice, an hour ago (so that a deadline in between has passed by the real clock).
NOTICE = (datetime.now(timezone.utc) - timedelta(hours=1)).replace(microsecond=0)


def before(seconds: float) -> datetime:
    return NOTICE - timedelta(seconds=seconds)


def after(seconds: float) -> datetime:
    return NOTICE + timedelta(seconds=seconds)


def soon(seconds: float) -> datetime:
    """A deadline relative to the real clock (the wait compares it with the system clock)."""
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


PAST = NOTICE + timedelta(minutes=2)  # a deadline that has already passed


class CountingStore:
    """The real S3Store, counting listings: lets a test wait until the waiter looked again."""

    def __init__(self, store: S3Store) -> None:
        self._store = store
        self.lists = 0

    async def list(self, **kwargs: Any) -> Any:
        result = await self._store.list(**kwargs)
        self.lists += 1
        return result

    async def get(self, **kwargs: Any) -> bytes:
        return await self._store.get(**kwargs)

    async def looked_again(self, times: int = 2, *, timeout: float = 10.0) -> None:
        target = self.lists + times

        async def wait() -> None:
            while self.lists < target:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(wait(), timeout)


async def test_files_arriving_late_and_out_of_order_become_durable_only_when_all_are_in(
    s3: Any, store: S3Store
) -> None:
    ckpt = make_ckpt(40, saved=after(3))
    objects = ckpt.objects()
    manifest_key = "step-40/manifest.json"
    # The manifest first, then the data files in reverse order: auto-export has no order.
    ordered = [manifest_key, *sorted((k for k in objects if k != manifest_key), reverse=True)]
    counting = CountingStore(store)
    waiter = asyncio.create_task(wait_durable(store=counting, uri=URI, notice_time=NOTICE,
                                              deadline=soon(60), poll_interval=0.05))
    try:
        for rel in ordered[:-1]:
            await s3.put_object(Bucket=BUCKET, Key=PREFIX + rel, Body=objects[rel])
            await counting.looked_again()
            assert not waiter.done(), f"declared durable while {ordered[-1]} was missing"
        await s3.put_object(Bucket=BUCKET, Key=PREFIX + ordered[-1], Body=objects[ordered[-1]])
        result = await asyncio.wait_for(waiter, 30)
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
    assert result.durable, result.reason
    assert result.step == 40
    assert result.manifest is not None and len(result.manifest.files) == len(ckpt.files)


async def test_a_file_with_the_wrong_size_is_never_durable_and_the_fallback_is_named(
    s3: Any, store: S3Store
) -> None:
    await put_ckpt(s3, make_ckpt(20, saved=before(600), reason="periodic"))
    post = make_ckpt(25, saved=after(2))
    await put_ckpt(s3, post, override={"__1_0.distcp": b"short"})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.fallback_step == 20
    assert result.steps_lost == 5
    assert "step 25: __1_0.distcp has 5 bytes, manifest says 64" in result.reason


async def test_a_file_whose_s3_sha256_differs_from_the_manifest_is_not_durable(
    s3: Any, store: S3Store
) -> None:
    post = make_ckpt(7, saved=after(1))
    same_size_other_bytes = bytes(64)
    await put_ckpt(s3, post, sha256=True, override={"__0_0.distcp": same_size_other_bytes})

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.fallback_step is None
    assert "__0_0.distcp sha256" in result.reason


async def test_matching_sha256_checksums_are_durable(s3: Any, store: S3Store) -> None:
    await put_ckpt(s3, make_ckpt(8, saved=after(1)), sha256=True)

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert result.durable and result.step == 8


async def test_a_malformed_manifest_is_never_trusted(s3: Any, store: S3Store) -> None:
    await put_ckpt(s3, make_ckpt(10, saved=before(300)))
    bad = make_ckpt(11, saved=after(1))
    await put_ckpt(s3, bad, skip=("manifest.json",))
    truncated = b'{"format": "resilienced-checkpoint/1", "step": '
    await s3.put_object(Bucket=BUCKET, Key=PREFIX + "step-11/manifest.json", Body=truncated)

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.fallback_step == 10
    assert "step 11: malformed manifest" in result.reason
    assert "not valid JSON" in result.reason


async def test_a_manifest_that_names_another_step_is_not_trusted(s3: Any, store: S3Store) -> None:
    other = make_ckpt(12, saved=after(1))
    await put_ckpt(s3, other, skip=("manifest.json",))
    await s3.put_object(Bucket=BUCKET, Key=PREFIX + "step-12/manifest.json",
                        Body=make_ckpt(13, saved=after(1)).manifest)

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert "says step 13, its directory says step 12" in result.reason


async def test_a_checkpoint_saved_before_the_notice_does_not_count_as_the_preemption_save(
    s3: Any, store: S3Store
) -> None:
    await put_ckpt(s3, make_ckpt(30, saved=before(5), reason="periodic"))

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.fallback_step == 30
    assert result.steps_lost == 0


async def test_deadline_passed_falls_back_to_the_newest_durable_checkpoint_before_the_notice(
    s3: Any, store: S3Store
) -> None:
    await put_ckpt(s3, make_ckpt(100, saved=before(1800), reason="periodic"))
    await put_ckpt(s3, make_ckpt(200, saved=before(900), reason="periodic"))
    # An older-than-notice checkpoint that is itself incomplete in S3 is skipped.
    await put_ckpt(s3, make_ckpt(250, saved=before(100), reason="periodic"), skip=("rng-rank0.pt",))
    # The preemption save after the notice: only part of it reached S3.
    await put_ckpt(s3, make_ckpt(260, saved=after(4)), skip=("__0_0.distcp", "__1_0.distcp"))

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                grace_seconds=0, poll_interval=0.05)

    assert not result.durable
    assert result.step is None
    assert result.fallback_step == 200
    assert result.fallback_manifest is not None and result.fallback_manifest.step == 200
    assert result.steps_lost == 60
    assert "step 260: 2 of 4 files not in S3 yet" in result.reason
    assert any(r.startswith("step 250:") for r in result.rejected)


async def test_the_newest_of_several_durable_post_notice_checkpoints_wins(s3: Any, store: S3Store) -> None:
    await put_ckpt(s3, make_ckpt(50, saved=after(1)))
    await put_ckpt(s3, make_ckpt(51, saved=after(2)))

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert result.durable and result.step == 51


async def test_nothing_in_s3_means_no_fallback(store: S3Store) -> None:
    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.fallback_step is None
    assert result.steps_lost is None
    assert "no checkpoint saved after the notice" in result.reason


async def test_partial_and_trash_directories_are_ignored(s3: Any, store: S3Store) -> None:
    ckpt = make_ckpt(9, saved=after(1))
    for rel, body in ckpt.objects().items():
        await s3.put_object(Bucket=BUCKET, Key=PREFIX + rel.replace("step-9/", "step-9.partial/"), Body=body)
        await s3.put_object(Bucket=BUCKET, Key=PREFIX + rel.replace("step-9/", ".trash-step-9-1-2/"), Body=body)

    result = await wait_durable(store=store, uri=URI, notice_time=NOTICE, deadline=PAST,
                                poll_interval=0.05)

    assert not result.durable
    assert result.steps_lost is None  # no committed step-<N>/ was seen at all


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"notice_time": datetime(2026, 1, 1)}, "notice_time must be a tz-aware"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": 600}, "poll_interval"),
        ({"grace_seconds": -1}, "grace_seconds"),
        ({"uri": "bucket/x"}, "s3://"),
    ],
    ids=["naive-notice", "zero-poll", "huge-poll", "negative-grace", "bad-uri"],
)
async def test_wait_durable_rejects_bad_arguments(store: S3Store, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"store": store, "uri": URI, "notice_time": NOTICE, "deadline": PAST,
                            "poll_interval": 0.05}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        await wait_durable(**args)


class FlakyStore:
    """The real S3Store behind a link that drops the first ``failures`` listings."""

    def __init__(self, store: S3Store, *, failures: int) -> None:
        self._store = store
        self.failures = failures

    async def list(self, **kwargs: Any) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise BackendUnavailable("s3", "ListObjectsV2 failed: ServerDisconnectedError")
        return await self._store.list(**kwargs)

    async def get(self, **kwargs: Any) -> bytes:
        return await self._store.get(**kwargs)


async def test_s3_errors_while_waiting_are_retried_until_the_deadline(s3: Any, store: S3Store) -> None:
    await put_ckpt(s3, make_ckpt(70, saved=after(1)))
    flaky = FlakyStore(store, failures=3)

    result = await wait_durable(store=flaky, uri=URI, notice_time=NOTICE, deadline=soon(60),
                                poll_interval=0.02)

    assert result.durable and result.step == 70
    assert flaky.failures == 0


async def test_s3_down_through_the_deadline_is_backend_unavailable(aio_session: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from aiobotocore.config import AioConfig

    from resilienced.local.aws import free_port

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    config = AioConfig(connect_timeout=1, read_timeout=1, retries={"max_attempts": 1})
    async with aio_session.create_client("s3", region_name="us-east-1", config=config,
                                         endpoint_url=f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(BackendUnavailable) as info:
            await wait_durable(store=S3Store(client=client), uri=URI, notice_time=NOTICE, deadline=PAST,
                               poll_interval=0.05)
    assert info.value.backend == "s3"


async def test_a_missing_bucket_is_permanent_at_once(store: S3Store) -> None:
    with pytest.raises(PermanentError, match="NoSuchBucket"):
        await wait_durable(store=store, uri="s3://no-such-bucket/x", notice_time=NOTICE, deadline=soon(60),
                           poll_interval=0.05)
