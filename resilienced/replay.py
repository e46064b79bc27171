"""``resilienced replay``: read message bodies from files and say what the daemon would decide.

Each PATH is a file holding one SQS message body, or a directory: its files are taken
recursively in name order (hidden files skipped).  Every file gives one row, built by
:func:`row` (the only place a row is made, so later fields such as ``targets`` go there).
Bodies go through exactly the daemon's path (``intake.read``), so the two cannot disagree.

``--dry-run``: nothing outside the process is touched.  Without it, actionable plans are also
handed to the responder -- today :class:`~resilienced.respond.PlanLogger`, which only logs them
(stderr).  Exit status: 0 when every input was read (invalid events included), 2 on a usage
error or an unreadable path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from resilienced import intake, log
from resilienced.errors import ConfigError
from resilienced.intake import Reading
from resilienced.respond import PlanLogger, Responder
from resilienced.settings import IntakeSettings
from resilienced.validate import isoformat


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a file holding one SQS message body, or a directory of such files")
    parser.add_argument("--dry-run", action="store_true",
                        help="touch nothing outside this process (no responder is called)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per input file on stdout, instead of a table")
    IntakeSettings.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    settings = IntakeSettings.from_args(args, os.environ)
    settings.validate()
    files = collect(args.paths)
    log.configure(level="warning" if args.dry_run else "info", stream=sys.stderr)
    responder = None if args.dry_run else PlanLogger()
    rows = asyncio.run(replay(files, settings=settings, responder=responder))
    write(rows, as_json=args.json, stream=sys.stdout)
    return 0


def collect(paths: Sequence[str]) -> list[tuple[str, bytes]]:
    """(name, body) for every input file, in order; ConfigError for an unreadable path."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            try:
                entries = sorted(p for p in path.rglob("*")
                                 if p.is_file() and not any(part.startswith(".")
                                                            for part in p.relative_to(path).parts))
            except OSError as e:
                raise ConfigError(text, f"cannot list the directory: {e.strerror or e}") from None
            found.extend(entries)
        elif path.exists():
            found.append(path)
        else:
            raise ConfigError(text, "no such file or directory")
    bodies = []
    for path in found:
        try:
            bodies.append((str(path), path.read_bytes()))
        except OSError as e:
            raise ConfigError(str(path), f"cannot read: {e.strerror or e}") from None
    return bodies


async def replay(files: Sequence[tuple[str, bytes]], *, settings: IntakeSettings,
                 responder: Responder | None) -> list[dict[str, Any]]:
    rows = []
    for name, body in files:
        reading = intake.read(body, settings)
        if responder is not None and reading.plan.actionable:
            # Where acting happens: the same responder the daemon uses.
            await responder.act(reading.plan, holder=f"replay/{name}")
        rows.append(row(name, reading))
    return rows


def row(source_file: str, reading: Reading) -> dict[str, Any]:
    """The replay record of one input (the CLI contract; add new fields here)."""
    plan, event = reading.plan, reading.event
    return {
        "source_file": source_file,
        "event_id": event.event_id,
        "kind": event.kind.value,
        "instance_ids": list(plan.instance_ids or event.instance_ids),
        "capacity_reservation_id": plan.capacity_reservation_id or event.capacity_reservation_id,
        "actionable": plan.actionable,
        "deadline": isoformat(plan.deadline),
        "reason": plan.reason,
        "steps": [step.value for step in plan.steps],
        "source": event.source,
        "detail_type": event.detail_type,
        "wrapping": event.wrapping.value if reading.decoded else None,
        "time": isoformat(event.time),
    }


COLUMNS = (("FILE", "source_file"), ("KIND", "kind"), ("ACT", "actionable"),
           ("EVENT ID", "event_id"), ("INSTANCES", "instance_ids"), ("DEADLINE", "deadline"),
           ("STEPS", "steps"), ("REASON", "reason"))


def write(rows: Sequence[dict[str, Any]], *, as_json: bool, stream: TextIO,
          columns: Sequence[tuple[str, str]] = COLUMNS) -> None:
    """JSON lines, or a table of ``columns`` (title, key)."""
    if as_json:
        for record in rows:
            stream.write(json.dumps(record) + "\n")
        return
    stream.write(table(rows, columns))


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A plain-text table (the last column is not padded)."""
    def cell(value: Any) -> str:
        if value is None or value == []:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return ",".join(str(v) for v in value)
        return str(value).replace("\n", " ")
    cells = [[cell(r.get(key)) for _, key in columns] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells]) for i, (title, _) in enumerate(columns)]
    lines = []
    for values in [[title for title, _ in columns]] + cells:
        padded = [v.ljust(w) for v, w in zip(values[:-1], widths[:-1], strict=True)] + [values[-1]]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"
