"""``resilienced report RUN``: what each interruption of a run cost, and what its capacity cost.

Reads the run's follow-up record from where ``status`` reads it (kubernetes mode: the Lease next
to the run claims; ray mode: the GCS KV; the same mode flags), and prints the run's ledgers
(``resilienced.ops.ledger``: one per interruption, kept in the record, oldest first; at most
``KEEP_LEDGERS``) one per line::

    NOTICE                     EVENT  LOST GPU-h  STEPS_REPEATED  SAVE_PAUSE  IDLE  CAPACITY_WAIT  CAPACITY               PREMIUM  GOODPUT
    2026-12-05T08:00:00+00:00  e-1    1.658       0.044           0.013       0.311 1.289          spot $4/h > on-demand $10/h  $6.00  0.906

(GPU-hours; ``-``: unknown, ``--json`` says why), then the run's totals.  ``--json``: one ledger
per line, whole.  ``--plot FILE.png``: the run's timeline (``resilienced.ops.plot``, matplotlib:
the ``plot`` extra).  ``--file FILE`` reads a follow-up record (or a ledger list, or the drill's
``--json-report``) from a file instead of the claim store.

Exit status: 0; 1 when the run has no record (or the store does not answer); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from resilienced.errors import ConfigError
from resilienced.model import JsonValue
from resilienced.ops.ledger import PARTS, Ledger, record_object, record_objects

#: Ledgers a run's follow-up record keeps (its recoveries, newest last).
KEEP_LEDGERS = 20
COLUMNS = ("NOTICE", "EVENT", "LOST GPU-h", *(p.upper() for p in PARTS), "CAPACITY", "PREMIUM", "GOODPUT")


def configure(parser: argparse.ArgumentParser) -> None:
    from resilienced.app.status import MODE_FLAGS
    from resilienced.settings import ModeSettings

    parser.add_argument("run", metavar="RUN", help="the run: namespace/name of its RayJob or RayCluster "
                                                   "(ray mode: as status shows it)")
    parser.add_argument("--json", action="store_true", help="one ledger per line, whole (JSON)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the run's timeline to FILE.png (matplotlib)")
    parser.add_argument("--file", metavar="FILE", help="read the follow-up record (or ledgers) from FILE "
                                                       "instead of the claim store")
    ModeSettings.add_arguments(parser, only=MODE_FLAGS)


def ledgers_of(record: Mapping[str, JsonValue]) -> list[Ledger]:
    """The ledgers in a follow-up record (``ledgers``), a list of ledgers, or a drill report (``ledger.whole``)."""
    drill = record.get("ledger")
    if "format" in record and str(record.get("format", "")).startswith("resilienced-ledger"):
        items: Sequence[Mapping[str, JsonValue]] = [record]
    elif isinstance(drill, dict) and "whole" in drill:
        items = [record_object(drill["whole"], "ledger.whole")]
    else:
        items = record_objects(record.get("ledgers"), "ledgers")
    return [Ledger.from_json(item) for item in items if item]


def _h(gpu_seconds: float | None) -> str:
    return "-" if gpu_seconds is None else f"{gpu_seconds / 3600:.3f}"


def line(led: Ledger) -> list[str]:
    """One interruption's cells, in :data:`COLUMNS` order."""
    chain = " > ".join(f"{u.capacity} " + ("$?/h" if u.price.usd_per_hour is None else f"${u.price.usd_per_hour:g}/h")
                       for u in led.capacity) or "-"
    premium = led.premium.value
    good = led.goodput.value
    return [led.notice_at.isoformat(), led.event_id, _h(led.lost_gpu_seconds),
            *(_h(led.part(p).gpu_seconds) for p in PARTS), chain,
            "-" if premium is None else f"${premium:.2f}", "-" if good is None else f"{good:.3f}"]


def render(ledgers: Sequence[Ledger]) -> str:
    """The table, then the run's totals."""
    cells = [list(COLUMNS), *(line(led) for led in ledgers)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths[:-1])) + "  " + row[-1] for row in cells]
    lost = sum(led.lost_gpu_seconds for led in ledgers)
    premiums = [led.premium.value for led in ledgers]
    known = [p for p in premiums if p is not None]
    total = f"${sum(known):.2f}" if len(known) == len(premiums) else "-"
    last = ledgers[-1].goodput if ledgers else None
    out.append(f"{len(ledgers)} interruption(s): lost {lost / 3600:.3f} GPU-hours, premium over Spot {total}, "
               f"goodput {'-' if last is None or last.value is None else f'{last.value:.3f}'}"
               + ("" if last is None or last.reason is None else f" ({last.reason})"))
    for led in ledgers:
        for reason in {p.source for p in led.lost if p.seconds is None} | (
                {led.premium.reason} if led.premium.reason else set()):
            out.append(f"  {led.event_id}: {reason}")
    return "\n".join(out) + "\n"


async def _record(args: argparse.Namespace) -> Mapping[str, JsonValue] | None:
    from resilienced.app.status import mode_settings, records

    _, follow_ups = await records(mode_settings(args, os.environ))
    return next((r for r in follow_ups if r.get("run") == args.run), None)


def main(args: argparse.Namespace) -> int:
    from resilienced import log

    log.configure(level="warning", stream=sys.stderr)
    if args.file:
        try:
            record = json.loads(Path(args.file).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError("--file", f"{args.file}: {e}") from None
        record = record if isinstance(record, Mapping) else {"ledgers": record}
    else:
        record = asyncio.run(_record(args))
    if record is None:
        print(f"no follow-up record of {args.run} (records are kept a day after their end)", file=sys.stderr)
        return 1
    try:
        ledgers = ledgers_of(record)
    except ValueError as e:
        print(f"resilienced: error: {e}", file=sys.stderr)
        return 1
    if not ledgers:
        print(f"{args.run}: no ledger yet (written once the run trains again or is stuck)", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.writelines(json.dumps(led.as_json()) + "\n" for led in ledgers)
    else:
        sys.stdout.write(render(ledgers))
    if args.plot:
        from resilienced.ops.plot import plot

        print(f"wrote {plot(ledgers, args.plot)}", file=sys.stderr)
    return 0
