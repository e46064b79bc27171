"""The follow-up writes each recovery's ledger when the run trains again, on the emulated Kubernetes
API with the controllers' stand-ins and a scripted clock (whole seconds): the run's cost is known
by construction and each part agrees to the second.  The ledger is written with the end, in the
same write; a ledger that cannot be made is logged and counted, the end stands without it, and
nothing retries it."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from resilienced.app import cli
from resilienced.aws.pricing import PriceFile, Prices
from resilienced.aws.s3 import S3Store
from resilienced.ops.ledger import Ledger
from resilienced.ops.ledger_metrics import LedgerMetrics
from resilienced.ops.plot import png_size
from resilienced.recovery.ledger import LedgerKeeper
from resilienced.doubles import MemoryFollowUps
from tests.support.kubeapi import KubeApiServer
from trainer.manifest import FileEntry, Manifest

from .conftest import BUCKET, DAEMON_NS, instance, node, seed_world
from .test_followup import Follow, requeued_onto_the_block, resume_record
from .test_recovery import BLOCK

pytestmark = pytest.mark.integration

FILE = PriceFile({"on-demand": {"p5.48xlarge": 98.32}})


async def manifest(s3: Any, step: int, saved: datetime) -> None:
    m = Manifest(step=step, world_size=2, time=saved, saved_at_unix=saved.timestamp(), reason="periodic",
                 files=(FileEntry("__0_0.distcp", 1, "a" * 64),))
    await s3.put_object(Bucket=BUCKET, Key=f"runs/train/step-{step}/manifest.json", Body=m.to_json().encode())


async def played(api: Any, kubeapi: KubeApiServer, s3: Any, *, keeper: Any) -> tuple[Follow, datetime, Any]:
    """Worker 1's instance gone at the notice (no save after it); periodic saves of step 10 and 15 at
    -20 s and -10 s (2 s a step); the requeue at +5 s onto the block, whose Nodes exist: the pods are
    bound at the pass at +30 s; the run trains again from step 15 at +90 s (the pass at +100 s)."""
    seed_world(kubeapi, gcs_port=6379)
    notice = datetime.now(timezone.utc).replace(microsecond=0)
    world = Follow(api=api, kubeapi=kubeapi, s3=s3, clock=[notice], max_fallbacks=0)
    world.follower.ledger = keeper(world)
    labels = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK,
              "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
    for name, n in (("b1", 11), ("b2", 12)):
        obj = node(name, instance(n), capacity="reserved")
        obj["metadata"]["labels"].update(labels)
        kubeapi.create(obj)
    await manifest(s3, 10, notice - timedelta(seconds=20))
    await manifest(s3, 15, notice - timedelta(seconds=10))
    await world.cluster.start()
    world.later(timedelta(seconds=5))
    await requeued_onto_the_block(world, when=notice)
    world.later(timedelta(seconds=25))
    (record,) = await world.pass_once()
    assert record.stage == "training" and record.reached["scheduled"] == (notice + timedelta(seconds=30)).isoformat()
    await resume_record(s3, at=notice + timedelta(seconds=90), step=15)
    world.later(timedelta(seconds=70))
    kubeapi.reset_log()
    (record,) = await world.pass_once()
    return world, notice, record


async def test_the_ledger_of_a_recovery_to_the_second(api: Any, kubeapi: KubeApiServer, s3: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    world, notice, record = await played(api, kubeapi, s3, keeper=lambda w: LedgerKeeper(objects=S3Store(client=s3), prices=Prices(file=FILE, region="us-east-1"),
        metrics=LedgerMetrics(w.registry)))
    try:
        assert record.state == "resumed"
        (data,) = record.ledgers
        led = Ledger.from_json(data)
        parts = {p.part: (p.seconds, p.gpu_seconds) for p in led.lost}
        # lost at the notice (a state change): 10 s trained since step 15's save = 5 steps x 2 s, twice
        assert parts["steps_repeated"] == (10.0, 20.0)
        # training stopped at the notice, again at +90; the capacity asked at +5, placed at +30
        assert parts["capacity_wait"] == (25.0, 50.0) and parts["idle"] == (65.0, 130.0)
        assert parts["save_pause"] == (None, None) and "no checkpoint saved after the notice" in led.part("save_pause").source
        assert led.lost_gpu_seconds == 200.0 and led.gpus.ranks == 2
        assert led.prices["spot"].usd_per_hour is None and led.premium.value is None  # no EC2 client: said so
        stored = await world.record()
        assert stored["ledgers"] == [data] and stored["state"] == "resumed"  # kept with the record, in the store
        # the end and its ledger are one write of the record (issue #45: they were two)
        assert [(r.verb, r.plural) for r in kubeapi.requests if r.plural == "leases"
                and r.verb in ("create", "update", "patch")] == [("patch", "leases")]
        assert world.metric("resilienced_lost_gpu_seconds_total", {"part": "capacity_wait"}) == 50.0
        assert world.metric("resilienced_run_goodput_ratio", {"run": record.run}) == led.goodput.value
        assert world.metric("resilienced_recoveries_total", {"outcome": "resumed"}) == 1

        # resilienced report and status read it back from the Leases, as an operator would
        args = ("--kubeconfig", str(kubeapi.write_kubeconfig(tmp_path / "kubeconfig")), "--claims-namespace", DAEMON_NS)
        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["report", record.run, *args, "--json"]) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith('{"format"')]
        assert json.loads(line) == data
        assert await asyncio.to_thread(cli.main, ["report", record.run, *args, "--plot", str(tmp_path / "run.png")]) == 0
        out = capsys.readouterr().out
        assert "0.056" in out.splitlines()[1]  # 200 GPU-seconds in GPU-hours
        assert png_size(tmp_path / "run.png") == (1200, 600)
        assert await asyncio.to_thread(cli.main, ["status", *args, "--json"]) == 0
        (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith('{"time"')]
        assert (row["lost_gpu_hours"], row["premium_usd"], row["ledger"]) == (0.056, None, data)
    finally:
        await world.cluster.stop()


async def test_a_ledger_that_cannot_be_computed_is_counted_once_and_the_end_stands_without_it(
        api: Any, kubeapi: KubeApiServer, s3: Any) -> None:
    """The ledger goes into the record with the follow-up's end, one write (issue #45: it was a
    write of its own after the end).  A ledger that cannot be made in its time (here: none at all)
    is logged and counted; the end is saved without it, and nothing retries it."""
    world, _, record = await played(api, kubeapi, s3, keeper=lambda w: LedgerKeeper(objects=S3Store(client=s3), metrics=LedgerMetrics(w.registry), timeout_s=0.0))
    try:
        assert record.state == "resumed" and record.ledgers == ()
        stored = await world.record()
        assert stored["state"] == "resumed" and not stored.get("ledgers")  # the end saved, no ledger
        assert world.events("TrainingResumed")
        assert world.metric("resilienced_ledger_failures_total", {"step": "compute"}) == 1
        world.later(timedelta(seconds=30))
        await world.pass_once()  # an ended follow-up is not looked at again: nothing retries it
        assert world.metric("resilienced_ledger_failures_total", {"step": "compute"}) == 1
        assert world.metric("resilienced_lost_gpu_seconds_total", {"part": "idle"}) == 0
    finally:
        await world.cluster.stop()


def test_a_block_a_move_bought_is_kept_in_the_record_for_its_price() -> None:
    from decimal import Decimal

    from resilienced.followup.follower import bought_by
    from resilienced.followup.rules import FollowUp
    from resilienced.model import Capacity, CapacityDecision, CapacityOffering, RequeueResult

    start = datetime(2026, 12, 5, 8, 0, tzinfo=timezone.utc)
    offering = CapacityOffering("cbo-1", "p5.48xlarge", "us-east-1a", 2, start, start + timedelta(days=1), Decimal("1440"))
    result = RequeueResult(run_key="ns/r", kind="kuberay", capacity=Capacity.CAPACITY_BLOCK, reason="bought",
                           reservation_id="cr-9", decision=CapacityDecision(
                               capacity=Capacity.CAPACITY_BLOCK, reason="buy", offering=offering))
    bought = bought_by(result)
    assert bought["cr-9"]["upfront_fee"] == "1440" and bought["cr-9"]["offering_id"] == "cbo-1"
    assert bought_by(RequeueResult(run_key="ns/r", kind="kuberay", capacity=Capacity.SPOT, reason="spot")) == {}
    record = FollowUp(run="ns/r", event_id="e", kind="spot_interruption", notice_at=start, opened_at=start,
                      target={}, capacity="capacity-block", reservation_id="cr-9", stages=("scheduled", "training"),
                      stage="scheduled", stage_since=start, bought=bought)
    assert FollowUp.from_json(record.as_json()).bought == bought
