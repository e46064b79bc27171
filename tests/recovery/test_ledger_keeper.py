"""The follow-up's ledger (resilienced.recovery.ledger.LedgerKeeper) against a recovery whose cost is
known by construction: the run's manifests in S3 (moto) on a scripted clock, its follow-up record as
the follower leaves it, prices from moto's DescribeSpotPriceHistory and a price file; each part to
the second.  A price that cannot be read leaves its figure null with the reason; a ledger that
cannot be computed or written is logged and counted, the record of the recovery untouched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from aiobotocore.config import AioConfig
from prometheus_client import CollectorRegistry

from resilienced.aws.pricing import PriceFile, Prices
from resilienced.aws.s3 import S3Store
from resilienced.ops.ledger import Ledger
from resilienced.ops.ledger_metrics import LedgerMetrics
from resilienced.recovery.ledger import LedgerKeeper
from tests.support.checkpoints import BUCKET, PREFIX, URI, aio_session, s3, store  # noqa: F401  (fixtures)
from resilienced.doubles import MemoryFollowUps
from trainer.manifest import FileEntry, Manifest

pytestmark = pytest.mark.integration

T = datetime(2026, 12, 5, 8, 0, 0, tzinfo=timezone.utc)
FILE = PriceFile({"on-demand": {"m5.large": 0.096},
                  "capacity-block": {"cr-1": {"upfront_fee": 2.4, "hours": 24, "instances": 2}}})


def at(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


async def put_manifest(s3: Any, step: int, saved: float, reason: str, save_seconds: float | None = None) -> None:
    m = Manifest(step=step, world_size=2, time=at(saved), saved_at_unix=at(saved).timestamp(), reason=reason,
                 files=(FileEntry("__0_0.distcp", 1, "a" * 64),), save_seconds=save_seconds)
    await s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}step-{step}/manifest.json", Body=m.to_json().encode())


# Periodic saves at -20 s (step 10) and -10 s (step 15): 2 s a step.  The notice's save (step 16,
# 0.5 s) at +1 s; the trainer trained on and saved step 20 at +9 s before it was torn down.  The
# requeue at +5 s to the block, which stalled: at +30 s the follow-up moved the run to On-Demand, whose
# node joined at +60 s; the run trained again at +90 s from step 20.
RECORD = {
    "run": "127.0.0.1:6379/train", "event_id": "e-1", "kind": "spot_interruption",
    "notice_at": at(0).isoformat(), "opened_at": at(5).isoformat(), "capacity": "on-demand",
    "reservation_id": None, "state": "resumed",
    "target": {"checkpoint_uri": URI, "facts": {"instance_type": "m5.large", "availability_zone": "us-east-1a",
                                                "instance_count": 2, "lost_instance_ids": ["i-1"]}},
    "fallbacks": [{"from": "capacity-block cr-1", "to": "on-demand", "at": at(30).isoformat()}],
    "reached": {"joined": at(60).isoformat(), "training": at(90).isoformat()},
    "resumed": {"resumed_from_step": 20, "world_size": 2, "at": at(90).isoformat()},
}


@pytest.fixture
async def ec2(aws: Any) -> AsyncIterator[Any]:
    from aiobotocore.session import AioSession

    async with AioSession().create_client("ec2", region_name="us-east-1", endpoint_url=aws.endpoint_url) as client:
        yield client


@pytest.fixture
async def run(s3: Any) -> None:  # noqa: F811
    await put_manifest(s3, 10, -20, "periodic")
    await put_manifest(s3, 15, -10, "periodic")
    await put_manifest(s3, 16, 1, "preemption", 0.5)
    await put_manifest(s3, 20, 9, "preemption", 0.75)


async def test_each_part_and_price_to_the_second(run: None, store: S3Store, ec2: Any) -> None:  # noqa: F811
    keeper = LedgerKeeper(objects=store, prices=Prices(ec2=ec2, file=FILE, region="us-east-1"))
    led = await keeper.compute(RECORD, at=at(100))
    assert led is not None
    parts = {p.part: p for p in led.lost}
    assert (parts["steps_repeated"].seconds, parts["save_pause"].seconds) == (0.0, 0.5)
    assert "resumed from step 20" in parts["steps_repeated"].source and "step-10 and step-15" in parts["steps_repeated"].source
    # stopped at +9 (step 20 saved), trained again at +90: 81 s; the capacity asked at +5, placed at +60
    assert (parts["capacity_wait"].seconds, parts["idle"].seconds) == (51.0, 30.0)
    assert (parts["capacity_wait"].gpu_seconds, parts["idle"].gpu_seconds, parts["save_pause"].gpu_seconds) == (102.0, 60.0, 1.0)
    assert "save of step 20" in parts["idle"].source and "save_seconds" in parts["save_pause"].source
    assert [(u.capacity, (u.start - T).total_seconds(), (u.end - T).total_seconds(), u.instances) for u in led.capacity] == [
        ("spot", -40.0, 0.0, 2), ("capacity-block", 5.0, 30.0, 1), ("on-demand", 30.0, 90.0, 1)]
    assert led.prices_per_hour() == {"spot": 0.00001, "capacity-block": 0.05, "on-demand": 0.096}
    assert led.premium.value == round((0.05 - 0.00001) * 25 / 3600 + (0.096 - 0.00001) * 60 / 3600, 6)
    # productive: 20 steps x 2 s x 2 ranks = 80 GPU-s; lost 163
    assert led.goodput.value == round(80 / (80 + 163), 6)


async def test_a_spot_story_without_a_save_after_the_notice_counts_the_steps_trained_twice(
        run: None, store: S3Store, ec2: Any) -> None:  # noqa: F811
    # resumed from step 15 (saved at -10): the node trained until the notice's deadline (+120 s) but
    # the run trained again at +90: stopped at +90 at the latest; 100 s of steps retrained = 50 steps
    record = {**RECORD, "resumed": {**RECORD["resumed"], "resumed_from_step": 15}}
    led = await LedgerKeeper(objects=store, prices=None).compute(record, at=at(100))
    assert led is not None and led.part("steps_repeated").seconds == 100.0
    assert "step 15's save" in led.part("steps_repeated").source
    assert led.premium.value is None and "no price source" in (led.premium.reason or "")


async def test_a_price_that_cannot_be_read_is_null_with_its_reason_and_the_ledger_is_written(
        run: None, store: S3Store) -> None:  # noqa: F811
    from aiobotocore.session import AioSession

    follow_ups = MemoryFollowUps()
    version = await follow_ups.put(RECORD["run"], RECORD, version=None)
    registry = CollectorRegistry()
    config = AioConfig(retries={"max_attempts": 0}, connect_timeout=1)
    async with AioSession().create_client("ec2", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                                          aws_access_key_id="t", aws_secret_access_key="t", config=config) as dead:
        keeper = LedgerKeeper(objects=store, prices=Prices(ec2=dead, file=FILE, region="us-east-1"),
                              metrics=LedgerMetrics(registry))
        led = await keeper.compute(RECORD, at=at(100))
    assert led is not None and led.prices["spot"].usd_per_hour is None
    assert "DescribeSpotPriceHistory" in (led.prices["spot"].reason or "")
    assert led.premium.value is None and led.lost_gpu_seconds == 163.0
    # what the follower does with the end: the record with the ledger in it, one write; then counted
    assert await follow_ups.put(RECORD["run"], keeper.with_ledger(RECORD, led), version=version) is not None
    keeper.kept(led)
    stored, _ = await follow_ups.get(RECORD["run"])
    assert [Ledger.from_json(x).event_id for x in stored["ledgers"]] == ["e-1"]
    assert {k: stored[k] for k in RECORD} == RECORD  # the recovery's record itself unchanged
    assert registry.get_sample_value("resilienced_lost_gpu_seconds_total", {"part": "capacity_wait"}) == 102.0


async def test_a_failure_to_compute_is_logged_counted_and_not_retried(store: S3Store) -> None:  # noqa: F811
    registry = CollectorRegistry()
    keeper = LedgerKeeper(objects=store, metrics=LedgerMetrics(registry))
    assert await keeper.compute({**RECORD, "notice_at": "never"}, at=at(100)) is None
    assert registry.get_sample_value("resilienced_ledger_failures_total", {"step": "compute"}) == 1.0
    led = await keeper.compute(RECORD, at=at(100))  # the manifests are not there: parts unknown, said so
    assert led is not None and led.part("steps_repeated").seconds is None
    assert registry.get_sample_value("resilienced_ledger_failures_total", {"step": "compute"}) == 1.0
    assert registry.get_sample_value("resilienced_lost_gpu_seconds_total", {"part": "idle"}) == 0.0


def test_a_notification_carries_the_ledger_on_resumed_and_stuck_only() -> None:
    from resilienced.ops.notify import slack_body
    from resilienced.recovery.ledger import notification_facts

    from tests.test_ledger import BLOCK, OD, SPOT, ledger

    led = ledger({"spot": SPOT, "capacity-block": BLOCK, "on-demand": OD})
    base = {"run": "ns/job", "outcome": "resumed", "stage": "training", "capacity": "on-demand"}
    fields = str(slack_body({**base, **notification_facts(led)})["blocks"])
    assert "*Lost GPU-seconds*\\n5968" in fields and "*Premium over Spot (USD)*\\n32.0" in fields
    assert f"*Goodput*\\n{led.goodput.value}" in fields
    assert "Lost GPU-seconds" not in str(slack_body({**base, "outcome": "done"})["blocks"])
    assert notification_facts(None) == {"lost_gpu_seconds": None, "premium_usd": None, "goodput": None}


def test_every_replica_shows_each_runs_goodput_and_drops_a_run_without_a_record() -> None:
    from tests.test_ledger import SPOT, ledger

    registry = CollectorRegistry()
    keeper = LedgerKeeper(objects=None, metrics=LedgerMetrics(registry))
    led = ledger({"spot": SPOT})
    keeper.show([{"run": "ns/job", "ledgers": [led.as_json()]}, {"run": "ns/none"}])
    assert registry.get_sample_value("resilienced_run_goodput_ratio", {"run": "ns/job"}) == led.goodput.value
    keeper.show([{"run": "ns/none"}])
    assert registry.get_sample_value("resilienced_run_goodput_ratio", {"run": "ns/job"}) is None


async def test_gpu_seconds_count_the_accelerators_the_run_declares(run: None, store: S3Store) -> None:  # noqa: F811
    facts = {**RECORD["target"]["facts"], "accelerators": 16.0}  # 2 worker pods x nvidia.com/gpu 8
    record = {**RECORD, "target": {**RECORD["target"], "facts": facts}}
    led = await LedgerKeeper(objects=store).compute(record, at=at(100))
    assert led is not None and (led.gpus.ranks, led.gpus.per_rank) == (2, 8.0)
    assert led.part("capacity_wait").gpu_seconds == 51.0 * 16 and "over 2 rank(s)" in led.gpus.source
    plain = await LedgerKeeper(objects=store).compute(RECORD, at=at(100))
    assert plain is not None and plain.gpus.per_rank == 1.0 and "declares no accelerator" in plain.gpus.source


async def test_a_block_the_run_bought_is_priced_from_its_offering(run: None, store: S3Store) -> None:  # noqa: F811
    offering = {"offering_id": "cbo-1", "availability_zone": "us-east-1a", "instance_count": 1,
                "start": at(0).isoformat(), "end": (at(0) + timedelta(days=1)).isoformat(), "upfront_fee": "720.00",
                "currency": "USD"}
    record = {**RECORD, "bought": {"cr-1": offering}}
    led = await LedgerKeeper(objects=store, prices=Prices(region="us-east-1")).compute(
        record, at=at(100))
    assert led is not None and led.prices["capacity-block"].usd_per_hour == 30.0  # 720 USD / 24 h / 1 instance
    assert led.prices["capacity-block"].source == "offering cbo-1"


class PrunedAfterListing:
    """The real S3Store on moto, where the trainer's retention deletes the newest manifest between
    the keeper's list and its read (as a run that trains on after the notice does)."""

    def __init__(self, store: S3Store, s3: Any, key: str) -> None:
        self.store, self.s3, self.key = store, s3, key

    async def list(self, **kwargs: Any) -> Any:
        listed = await self.store.list(**kwargs)
        await self.s3.delete_object(Bucket=BUCKET, Key=self.key)
        return listed

    async def get(self, **kwargs: Any) -> bytes:
        return await self.store.get(**kwargs)


async def test_a_manifest_pruned_between_the_list_and_the_read_is_passed_over(
    run: None, store: S3Store, s3: Any,  # noqa: F811
) -> None:
    """Found in make test (the drill's daemon under load): a manifest the trainer pruned after the
    keeper listed it was S3's NoSuchKey, and the whole ledger was lost (\"ledger not computed\")."""
    from resilienced.recovery.ledger import manifests

    pruned = PrunedAfterListing(store, s3, f"{PREFIX}step-20/manifest.json")
    read = await manifests(pruned, URI, at_most_step=None)  # type: ignore[arg-type]
    assert [m.step for m in read] == [16, 15, 10]
    keeper = LedgerKeeper(objects=pruned, prices=None)  # type: ignore[arg-type]
    await s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}step-20/manifest.json",
                        Body=(await store.get(bucket=BUCKET, key=f"{PREFIX}step-16/manifest.json")))
    assert await keeper.compute(RECORD, at=at(100)) is not None
