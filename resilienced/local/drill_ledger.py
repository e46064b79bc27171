"""The drill's ledger (issue #43): what its interruption cost, from what the drill saw.

The drill knows its run to the line: the trainer's metric lines (one per step, with its time and
world size), its events (the saves, with ``save_seconds``), the worker nodes' spans (joined,
gone) and the daemon's follow-up record (the requeue, the stage the capacity was placed at,
the fallbacks).  :func:`drill_ledger` turns them into the recovery's
:class:`~resilienced.ops.ledger.Ledger` (pure; tests/local/drill/test_ledger.py builds a run
whose cost is known by construction), priced with :func:`drill_prices`: Spot from moto's
``DescribeSpotPriceHistory`` (the drill's EC2), On-Demand and the Capacity Block's fee from the
price file the drill writes and also gives the daemon (``--on-demand-prices``).

Inputs, each with the source the ledger names:

* steps trained twice: the metric lines (a step with two lines); the step time: the median gap
  between the lines of the attempt the notice interrupted;
* the save's pause: the first ``checkpoint_committed`` (reason ``preemption``) after the notice,
  its ``save_seconds``;
* training stopped: the end of that attempt's training (its last line); training again: the
  start of the first attempt after the notice (one step before its first line), as
  ``worker_seconds_idle`` counts them;
* the requeue and the capacity placed: the follow-up's ``opened_at`` and its ``joined`` (or
  ``scheduled``) stage.

Capacity spans: the survivors on Spot from the run's start to its end, each lost instance on Spot
until its node went, and its replacement on the capacity the daemon moved it to from the requeue
(each fallback starts a span) to the run's end; ``instances`` per span as counted.

``idle`` against ``worker_seconds_idle``: the ledger counts the run's ranks over its downtime
(ranks x ``[training stopped, training again]``: what the run was short of, split into ``idle`` and
``capacity_wait``); ``worker_seconds_idle`` counts machines up and not training from the notice to
training again.  They count the same seconds where exactly one node held each rank throughout;
otherwise ``worker_seconds_idle`` = the ledger's idle + capacity wait - the rank-seconds no node held
(the lost node gone, its replacement not joined yet) + the node-seconds beyond the ranks (a
replacement up while the lost node still trained): :func:`node_balance`, both in the report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from resilienced.clock import parse_time
from resilienced.model import JsonValue
from resilienced.ops.ledger import (
    CapacityUse,
    Gpus,
    Known,
    Ledger,
    Price,
    Recovery,
    compute,
    record_object,
    record_objects,
    record_time,
    summary,
)

#: The drill's nodes are local CPU processes (instance type ``drill.cpu``, which EC2 does not sell):
#: their prices are those of an instance type moto's DescribeSpotPriceHistory knows, ``PRICED_AS``.
PRICED_AS = "m5.large"
#: The drill's price file: On-Demand per instance-hour of ``PRICED_AS`` (us-east-1's list price) and the
#: Capacity Block's upfront fee for ``BLOCK_HOURS`` hours of the drill's workers (0.05 USD per instance-hour).
ON_DEMAND_USD_PER_HOUR = 0.096
BLOCK_FEE_USD = 2.4
BLOCK_HOURS = 24


def price_file(path: Path, *, instance_type: str, block_id: str, instances: int, also: Sequence[str] = ()) -> Path:
    """Write the drill's ``--on-demand-prices`` file (On-Demand and the block's fee); ``also``: more
    instance types at the same price (the daemon's facts name the drill's own, ``drill.cpu``)."""
    path.write_text(json.dumps({
        "on-demand": {t: ON_DEMAND_USD_PER_HOUR for t in (instance_type, *also)},
        "capacity-block": {block_id: {"upfront_fee": BLOCK_FEE_USD, "hours": BLOCK_HOURS, "instances": instances}},
    }, indent=1) + "\n")
    return path


async def drill_prices(*, endpoint: str, region: str, zone: str, instance_type: str, block_id: str,
                       file: Path, at: datetime) -> dict[str, Price]:
    """Spot from moto's DescribeSpotPriceHistory, On-Demand and the block from the price file."""
    from aiobotocore.session import get_session

    from resilienced.aws.pricing import PriceFile, Prices

    async with get_session().create_client("ec2", region_name=region, endpoint_url=endpoint) as ec2:
        prices = Prices(ec2=ec2, file=PriceFile.read(file), region=region)
        return {"spot": await prices.spot(instance_type=instance_type, zone=zone, at=at),
                "capacity-block": prices.capacity_block(reservation_id=block_id),
                "on-demand": await prices.on_demand(instance_type=instance_type)}


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _spans(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, int, float]]:
    """(start, end, world size, median step) of each attempt (a step before its first line -> its last)."""
    by_attempt: dict[Any, list[Mapping[str, Any]]] = {}
    for m in metrics:
        by_attempt.setdefault(m.get("attempt"), []).append(m)
    out = []
    for lines in by_attempt.values():
        times = sorted(float(m["time"]) for m in lines)
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        step = gaps[len(gaps) // 2] if gaps else 0.0
        out.append((times[0] - step, times[-1], int(lines[0].get("world_size") or 0), step))
    return sorted(out)


def world_sizes(metrics: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The ranks training over time (``resilienced.ops.plot.WorldSize``): each attempt's size from its
    start, 0 after its last line until the next one."""
    from resilienced.ops.plot import WorldSize

    out = []
    for start, end, size, _step in _spans(metrics):
        out += [WorldSize(_utc(start), size), WorldSize(_utc(end), 0)]
    return out


def node_balance(node_spans: Sequence[tuple[float, float | None]], *, ranks: int,
                 window: tuple[float, float]) -> tuple[float, float]:
    """(surplus, unheld) in ``window``: node-seconds up beyond the ranks (a replacement up while the
    lost node still was), and rank-seconds no node held (the lost node gone, its replacement not yet)."""
    cuts = sorted({window[0], window[1], *(t for span in node_spans for t in span
                                           if t is not None and window[0] < t < window[1])})
    surplus = unheld = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        up = sum(1 for joined, gone in node_spans if joined <= mid and (gone is None or gone > mid))
        surplus += max(0, up - ranks) * (b - a)
        unheld += max(0, ranks - up) * (b - a)
    return round(surplus, 3), round(unheld, 3)


def drill_ledger(*, run: str, event_id: str, workers: int, metrics: Sequence[Mapping[str, Any]],
                 events: Sequence[Mapping[str, Any]], notice: float, steps_trained_twice: int,
                 follow_up: Mapping[str, JsonValue] | None, prices: Mapping[str, Price],
                 node_spans: Sequence[tuple[float, float | None]] = (), lost_instances: int = 1) -> Ledger | None:
    """The ledger of the drill's recovery (see the module docstring); None without a notice or lines."""
    spans = _spans(metrics)
    before = [s for s in spans if s[0] < notice]
    after = [s for s in spans if s[0] >= notice]
    if not before:
        return None
    interrupted = before[-1]
    step = Known(interrupted[3], "the trainer's metric lines: the median step of the interrupted attempt") \
        if interrupted[3] > 0 else Known.unknown("the interrupted attempt trained fewer than two steps")
    save = next((e for e in events if e.get("event") == "checkpoint_committed" and e.get("reason") == "preemption"
                 and float(e["time"]) >= notice), None)
    save_seconds = (Known(round(float(save["save_seconds"]), 3),
                          f"the trainer's save record: step {save.get('step')} committed (preemption)")
                    if save is not None and save.get("save_seconds") is not None
                    else Known.unknown("no save at the notice (the trainer's save records)"))
    record = follow_up or {}
    reached = record_object(record.get("reached"), "reached")
    placed_at = reached.get("joined") or reached.get("scheduled")
    r = Recovery(
        notice_at=_utc(notice), gpus=Gpus(workers, 1.0, "1 per rank: the drill's ranks declare no accelerator"),
        steps_trained_twice=Known(steps_trained_twice, "the trainer's metric lines: steps with two lines"),
        step_seconds=step, save_seconds=save_seconds,
        training_stopped_at=_utc(interrupted[1]), requeued_at=record_time(record.get("opened_at")),
        placed_at=record_time(placed_at), training_again_at=_utc(after[0][0]) if after else None,
        stopped_source="the interrupted attempt's last metric line",
        placed_source=f"the follow-up's {'joined' if reached.get('joined') else 'scheduled'} stage",
        again_source="the first attempt after the notice, a step before its first metric line")
    end = max(s[1] for s in spans)
    start = spans[0][0]
    gone = min((g for _joined, g in node_spans if g is not None), default=None)  # the lost node went
    lost_until = gone if gone is not None else (after[0][0] if after else end)
    uses = [CapacityUse("spot", _utc(start), _utc(end), workers - lost_instances, _price(prices, "spot")),
            CapacityUse("spot", _utc(start), _utc(max(start, lost_until)), lost_instances, _price(prices, "spot"))]
    moves: list[tuple[str, datetime]] = []
    if r.requeued_at is not None:
        fallbacks = record_objects(record.get("fallbacks"), "fallbacks")
        first = fallbacks[0].get("from") if fallbacks else record.get("capacity")
        moves.append((str(first).split()[0], r.requeued_at))
        for f in fallbacks:
            moves.append((str(f["to"]).split()[0], record_time(f["at"]) or r.requeued_at))
    for (capacity, since), following in zip(moves, [*moves[1:], (None, _utc(end))]):
        uses.append(CapacityUse(capacity, since, max(since, following[1]), lost_instances, _price(prices, capacity)))
    productive = sum(s[2] * (s[1] - s[0]) for s in spans) - (steps_trained_twice * interrupted[3] * workers)
    return compute(r, run=run, event_id=event_id, at=_utc(end), capacity=uses, prices=prices,
                   productive_gpu_seconds=Known(round(productive, 3), "ranks x seconds training, from the metric "
                                                                     "lines, less the steps trained twice"))


def report_ledger(ledger: Ledger | None, *, worker_seconds_idle: float | None,
                  node_spans: Sequence[tuple[float, float | None]], workers: int) -> dict[str, JsonValue] | None:
    """The drill report's ``ledger``: the summary, the whole ledger, and idle against worker_seconds_idle."""
    if ledger is None:
        return None
    out: dict[str, JsonValue] = dict(summary(ledger))
    marks = ledger.marks
    if "stopped" in marks and "again" in marks:
        window = (ledger.notice_at.timestamp(), parse_time(marks["again"]).timestamp())
        down = round(sum(ledger.part(p).gpu_seconds or 0.0 for p in ("idle", "capacity_wait")), 3)
        balance = node_balance(node_spans, ranks=workers, window=window) if node_spans else None
        surplus, unheld = balance or (None, None)
        out["idle_vs_worker_seconds_idle"] = {
            "ledger_idle_and_wait": down, "worker_seconds_idle": worker_seconds_idle,
            "surplus_node_seconds": surplus, "unheld_rank_seconds": unheld,
            "ledger_less_unheld_plus_surplus": None if balance is None else round(down - balance[1] + balance[0], 1)}
    out["whole"] = ledger.as_json()
    return out


def _price(prices: Mapping[str, Price], capacity: str) -> Price:
    return prices.get(capacity) or Price.unknown("", f"no {capacity} price read")
