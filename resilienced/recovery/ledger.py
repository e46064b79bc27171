"""The follow-up's ledger: what a recovery cost, computed when it ends and kept with its record.

When the follower ends a follow-up (``resumed``) or gives it up (``stuck``),
:meth:`LedgerKeeper.compute` turns the record of that end into the recovery's ledger
(:mod:`resilienced.ops.ledger`, bounded in time), and the follower saves the end with the ledger
kept in it (:meth:`LedgerKeeper.with_ledger`: ``ledgers``, the run's recoveries, oldest first, at
most :data:`KEEP`) in one write of the follow-up store (issue #45: the ledger was a second write),
so every replica, ``resilienced status`` and ``resilienced report`` read the same.  A ledger that
cannot be computed is logged and counted (``resilienced_ledger_failures_total{step="compute"}``)
and never retried in the notice's path: the end is saved without it, the figure is missing.

What the daemon reads (each part names it):

* the run's checkpoint manifests in S3 (``trainer.manifest``): the step time (the two newest
  saves before the notice at the same world size: seconds between them over the steps between
  them, a periodic save's own time included), the save at the notice's ``save_seconds`` (the
  save's pause; a manifest of an older trainer has none: unknown), and when the step the run
  resumed from was saved;
* the trainer's resume record (the follow-up's ``resumed``): the step it resumed from, its world
  size (the ranks), when it trained again;
* training stopped: the save of the step the run resumed from when it was saved after the notice
  (the trainer saved and waited to be torn down); else the instance's end: the notice's deadline
  for a Spot notice (120 s), the notice itself for a loss without one (a state change);
* steps trained twice: the seconds from the resumed step's save to the stop, over the step time;
* the capacity: the follow-up's requeue (``opened_at``) and moves (``fallbacks``), the stage its
  capacity was placed at (``scheduled``/``joined``); prices from :class:`~resilienced.aws.pricing.Prices`
  (a Capacity Block a move of the run bought: its offering's fee, kept in the record's ``bought``);
* accelerators per rank: what the run's worker pods request (``nvidia.com/gpu``, Neuron, ...;
  ray mode: the worker nodes' ``GPU``), located with the run, over its ranks; 1 per rank where none
  is declared (the ledger's ``gpus.source`` says which);
* productive GPU-seconds: the steps the run keeps (the resumed step) x the step time x the ranks;
  the run on Spot before the notice for as long (its instances: the run's ``instance_count``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from dataclasses import dataclass

from resilienced import log
from resilienced.aws.pricing import Prices
from resilienced.aws.s3 import ObjectNotFound, parse_s3_uri
from resilienced.clock import parse_time
from resilienced.model import CAPACITY_NAMES, CapacityOffering, JsonValue
from resilienced.ops.ledger import (
    CapacityUse,
    Gpus,
    Known,
    Ledger,
    Price,
    Recovery,
    compute,
    record_items,
    record_number,
    record_object,
    record_objects,
    record_text,
    record_time,
    record_whole,
)
from resilienced.ops.ledger_metrics import LedgerMetrics
from resilienced.ports import ObjectStore
from trainer.manifest import MANIFEST, Manifest

#: Ledgers kept in a run's follow-up record (its recoveries, newest last).
KEEP = 20
#: How long computing a ledger may take (S3 reads, price calls) before it is given up (counted).
COMPUTE_TIMEOUT_S = 20.0
#: How long a Spot instance lives after its notice.
SPOT_NOTICE = timedelta(seconds=120)
#: Manifests read at most (the newest at or below the resumed step).
MANIFESTS_READ = 6
_STEP_KEY = re.compile(r"step-(\d+)/" + re.escape(MANIFEST) + "$")


async def manifests(objects: ObjectStore, uri: str, *, at_most_step: int | None) -> list[Manifest]:
    """The newest :data:`MANIFESTS_READ` manifests at or below ``at_most_step`` (None: any), newest first."""
    bucket, prefix = parse_s3_uri(uri)
    steps = []
    for o in await objects.list(bucket=bucket, prefix=prefix):
        match = _STEP_KEY.search(o.key[len(prefix):])
        if match and (at_most_step is None or int(match.group(1)) <= at_most_step):
            steps.append((int(match.group(1)), o.key))
    out = []
    for _step, key in sorted(steps, reverse=True)[:MANIFESTS_READ]:
        try:
            out.append(Manifest.parse(await objects.get(bucket=bucket, key=key), where=f"s3://{bucket}/{key}"))
        except (ValueError, KeyError, ObjectNotFound):  # unreadable, or pruned by the trainer since the list
            continue
    return out


@dataclass(frozen=True)
class Held:
    """What the capacity half needs besides the recovery: the lost instances (their replacements),
    the run's instances, the productive GPU-seconds."""

    instances: int
    run_instances: int
    productive: Known


def recovery_of(record: Mapping[str, JsonValue], saved: Sequence[Manifest]) -> tuple[Recovery, Held]:
    """The ledger's inputs from a follow-up record and the run's manifests (newest first); and what
    else the capacity half needs (``instances``, ``run_instances``, ``productive``)."""
    notice = record_time(record["notice_at"])
    assert notice is not None
    resumed = record_object(record.get("resumed"), "resumed")
    reached = record_object(record.get("reached"), "reached")
    facts = record_object(record_object(record.get("target"), "target").get("facts"), "target.facts")
    ranks = record_whole(resumed.get("world_size") or record.get("durable_world_size") or 1, "world_size")
    again = record_time(resumed.get("at")) or record_time(reached.get("training"))
    kept_step = resumed.get("resumed_from_step")
    step_from = None if kept_step is None else record_whole(kept_step, "resumed.resumed_from_step")
    before = [m for m in saved if m.time <= notice]
    pair = next(((a, b) for a, b in zip(before, before[1:]) if a.world_size == b.world_size and a.step > b.step), None)
    if pair is not None:
        step_time = Known(round((pair[0].saved_at_unix - pair[1].saved_at_unix) / (pair[0].step - pair[1].step), 6),
                          f"checkpoint manifests step-{pair[1].step} and step-{pair[0].step} (a save's own time included)")
    else:
        step_time = Known.unknown("fewer than two checkpoints of one world size before the notice")
    at_notice = min((m for m in saved if m.time >= notice), key=lambda m: m.time, default=None)
    if at_notice is None:
        save = Known.unknown("no checkpoint saved after the notice")
    elif at_notice.save_seconds is None:
        save = Known.unknown(f"manifest step-{at_notice.step} does not say how long its save took (an older trainer)")
    else:
        save = Known(round(at_notice.save_seconds, 3), f"manifest step-{at_notice.step} save_seconds ({at_notice.reason})")
    from_manifest = next((m for m in saved if step_from is not None and m.step == step_from), None)
    if from_manifest is not None and from_manifest.time >= notice:
        stopped, stopped_source = from_manifest.time, f"the save of step {from_manifest.step} the run resumed from"
    elif record.get("kind") == "spot_interruption":
        stopped, stopped_source = notice + SPOT_NOTICE, "the notice's deadline (the node trained until it went)"
    else:
        stopped, stopped_source = notice, "the notice (the instance was already gone)"
    if again is not None:
        stopped = min(stopped, again)
    if step_from is None:
        twice = Known.unknown("the run resumed from scratch or the resume record is not read")
    elif from_manifest is None:
        twice = Known.unknown(f"the manifest of step {step_from} the run resumed from is not read")
    elif from_manifest.time >= stopped or not step_time.value:
        twice = Known(0, f"resumed from step {step_from}, saved when training stopped")
    else:
        n = round((stopped - from_manifest.time).total_seconds() / step_time.value)
        twice = Known(n, f"step {step_from}'s save -> training stopped, over the step time")
    placed = reached.get("joined") or reached.get("scheduled")
    recovery = Recovery(
        notice_at=notice, gpus=gpus_of(facts, ranks),
        steps_trained_twice=twice, step_seconds=step_time, save_seconds=save, training_stopped_at=stopped,
        requeued_at=record_time(record.get("opened_at")), placed_at=record_time(placed), training_again_at=again,
        stopped_source=stopped_source, placed_source=f"the follow-up's {'joined' if reached.get('joined') else 'scheduled'} stage",
        again_source="the trainer's resume record")
    lost = len(record_items(facts.get("lost_instance_ids") or facts.get("instance_ids"), "target.facts.instance_ids"))
    lost = lost or 1
    productive = (Known(round(step_from * step_time.value * ranks, 3),
                        f"{step_from} steps kept x the step time x {ranks} ranks")
                  if step_from is not None and step_time.value is not None
                  else Known.unknown("the steps kept or the step time unknown"))
    return recovery, Held(instances=lost, run_instances=record_whole(facts.get("instance_count") or lost,
                                                               "target.facts.instance_count"),
                          productive=productive)


def gpus_of(facts: Mapping[str, JsonValue], ranks: int) -> Gpus:
    """The run's accelerators per rank: what its worker pods request (Ray worker nodes offer) over its
    ranks (the resume record's world size), else 1 per rank."""
    declared = facts.get("accelerators")
    if isinstance(declared, (int, float)) and declared > 0:
        return Gpus(ranks, round(float(declared) / ranks, 6),
                    f"{float(declared):g} accelerator(s) the run's worker pods request (ray mode: its worker "
                    f"nodes offer) over {ranks} rank(s) (the resume record)")
    return Gpus(ranks, 1.0, f"1 per rank: the run declares no accelerator; {ranks} rank(s) (the resume record)")


def capacity_of(record: Mapping[str, JsonValue], recovery: Recovery, *, until: datetime, instances: int,
                run_instances: int, productive: Known, prices: Mapping[str, Price]) -> list[CapacityUse]:
    """The run on Spot before the notice (as long as it trained what it keeps), then the lost instances'
    replacements on each capacity the follow-up moved them to, each until the next move (the last until ``until``)."""
    def price(capacity: str) -> Price:
        return prices.get(capacity) or Price.unknown("", f"no {capacity} price read")

    uses = []
    if productive.value and recovery.gpus.total:
        start = recovery.notice_at - timedelta(seconds=productive.value / recovery.gpus.total)
        uses.append(CapacityUse("spot", start, recovery.notice_at, run_instances, price("spot")))
    fallbacks = record_objects(record.get("fallbacks"), "fallbacks")
    first = str(fallbacks[0]["from"] if fallbacks else record.get("capacity") or "spot").split()[0]
    moves = [(first, recovery.requeued_at or recovery.notice_at)]
    moves += [(str(f["to"]).split()[0], record_time(f.get("at")) or until) for f in fallbacks]
    for (capacity, since), following in zip(moves, [*moves[1:], (None, until)]):
        uses.append(CapacityUse(capacity, since, max(since, following[1]), instances, price(capacity)))
    return uses


def bought_offering(record: Mapping[str, JsonValue], block: object) -> CapacityOffering | None:
    """The offering a move of the run bought ``block`` from (the record's ``bought``), None: not bought here."""
    data = record_object(record.get("bought"), "bought").get(str(block)) if block else None
    if not isinstance(data, Mapping):
        return None
    try:
        return CapacityOffering(
            offering_id=str(data["offering_id"]), instance_type="", availability_zone=str(data.get("availability_zone") or ""),
            instance_count=record_whole(data["instance_count"], "bought.instance_count"),
            start=parse_time(str(data["start"])),
            end=parse_time(str(data["end"])), upfront_fee=Decimal(str(data["upfront_fee"])),
            currency=str(data.get("currency") or "USD"))
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None


class LedgerKeeper:
    """Computes a follow-up's ledger when it ends and keeps it in the record (see the module docstring).

    Args:
        objects: S3 (the manifests; None: the parts that need them unknown).
        prices: ``resilienced.aws.pricing.Prices`` (None: every price unknown, said so).
        metrics: the ledger's metrics.  clock: the daemon's clock.
    """

    def __init__(self, *, objects: ObjectStore | None, prices: Prices | None = None,
                 metrics: LedgerMetrics | None = None, timeout_s: float = COMPUTE_TIMEOUT_S) -> None:
        self.objects, self.prices, self.metrics = objects, prices, metrics
        self.timeout_s = timeout_s
        self._log = log.get("resilienced.ledger")

    async def compute(self, record: Mapping[str, JsonValue], *, at: datetime) -> Ledger | None:
        """The recovery's ledger; None (logged, counted ``compute``) when it cannot be made."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._compute(record, at=at)
        except Exception as e:  # noqa: BLE001 - a ledger never stops a recovery: logged and counted
            self._fail("compute", record, e)
            return None

    async def _compute(self, record: Mapping[str, JsonValue], *, at: datetime) -> Ledger:
        uri = record_object(record.get("target"), "target").get("checkpoint_uri")
        saved: list[Manifest] = []
        if uri and self.objects is not None:
            saved = await manifests(self.objects, str(uri), at_most_step=None)
        recovery, more = recovery_of(record, saved)
        prices = await self._prices(record, recovery)
        until = recovery.training_again_at or at
        uses = capacity_of(record, recovery, until=until, instances=more.instances,
                           run_instances=more.run_instances, productive=more.productive, prices=prices)
        earlier = sum(record_number(led.get("lost_gpu_seconds") or 0.0, "ledgers.lost_gpu_seconds")
                      for led in record_objects(record.get("ledgers"), "ledgers")
                      if led.get("event_id") != record.get("event_id"))
        return compute(recovery, run=str(record["run"]), event_id=str(record["event_id"]), at=at, capacity=uses,
                       prices=prices, productive_gpu_seconds=more.productive, earlier_lost_gpu_seconds=earlier)

    async def _prices(self, record: Mapping[str, JsonValue], recovery: Recovery) -> dict[str, Price]:
        facts = record_object(record_object(record.get("target"), "target").get("facts"), "target.facts")
        if self.prices is None:
            return {c: Price.unknown("", "no price source configured") for c in CAPACITY_NAMES}
        itype, zone = record_text(facts.get("instance_type")), record_text(facts.get("availability_zone"))
        named = [str(f.get(k) or "").split()
                 for f in record_objects(record.get("fallbacks"), "fallbacks") for k in ("from", "to")]
        block = record_text(record.get("reservation_id")) or next((w[1] for w in named if len(w) > 1), None)
        return {"spot": await self.prices.spot(instance_type=itype, zone=zone, at=recovery.notice_at),
                "capacity-block": self.prices.capacity_block(reservation_id=block, offering=bought_offering(record, block)),
                "on-demand": await self.prices.on_demand(instance_type=itype)}

    def with_ledger(self, record: Mapping[str, JsonValue], ledger: Ledger) -> dict[str, JsonValue]:
        """``record`` with ``ledger`` in its ``ledgers`` (this event's replaced), at most :data:`KEEP`."""
        kept: list[JsonValue] = [led for led in record_objects(record.get("ledgers"), "ledgers")
                                 if led.get("event_id") != ledger.event_id]
        return {**record, "ledgers": [*kept, ledger.as_json()][-KEEP:]}

    def kept(self, ledger: Ledger) -> None:
        """``ledger`` is kept in the run's record (:meth:`with_ledger`'s, written by the follow-up with
        its end): counted and logged ``ledger written``."""
        if self.metrics is not None:
            self.metrics.count(ledger)
        self._log.info("ledger written", run=ledger.run, event_id=ledger.event_id,
                       lost_gpu_seconds=ledger.lost_gpu_seconds, premium_usd=ledger.premium.value,
                       goodput=ledger.goodput.value)

    def show(self, records: Sequence[Mapping[str, JsonValue]]) -> None:
        """Every replica, every pass: each run's goodput from its newest ledger; the series of a run
        whose record is gone is dropped (the label set stays the runs with a record)."""
        if self.metrics is None:
            return
        for record in records:
            try:
                kept = record_objects(record.get("ledgers"), "ledgers")
                if kept:
                    self.metrics.show(Ledger.from_json(kept[-1]))
            except ValueError as e:
                self._log.warning("ledger unreadable", run=record.get("run"), error=str(e))
        self.metrics.keep_only(str(r.get("run")) for r in records)

    def _fail(self, step: str, record: Mapping[str, JsonValue], error: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.failures.labels(step=step).inc()
        self._log.warning(f"ledger not {step}d", run=record.get("run"),
                          event_id=record.get("event_id"), error=f"{type(error).__name__}: {error}")


def notification_facts(ledger: Ledger | None) -> dict[str, JsonValue]:
    """The ledger's facts of a ``resumed``/``stuck`` notification (None: all unknown)."""
    if ledger is None:
        return {"lost_gpu_seconds": None, "premium_usd": None, "goodput": None}
    return {"lost_gpu_seconds": round(ledger.lost_gpu_seconds), "premium_usd": ledger.premium.value,
            "goodput": ledger.goodput.value}
