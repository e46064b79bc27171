"""The reliability campaign: ``python -m tests.chaos.campaign [--quick] [--only NAME ...]``.

``make chaos`` runs the full form; ``--quick`` is the form the test suite runs
(tests/chaos/test_campaign.py). ``--faults PREFIX ...`` runs only the backend faults of
scenario 2 whose names start with one of the prefixes (``--only backends --faults ec2-``: the EC2
faults; the names are the keys of ``BACKEND_FAULTS`` in tests/chaos/scenarios.py), in the full
form's configuration whether or not ``--quick`` is given. Prints one JSON object per scenario
(its tally, see tests/chaos/scenarios.py) and exits 1 when any scenario found a violation. docs/reliability.md
tabulates the figures.

``--only gcs`` is scenario 2 in ray mode (tests/chaos/gcs.py): two ``resilienced run --mode ray``
replicas on a real local Ray cluster whose GCS is stopped (SIGSTOP), stopped past a whole GCS
call's bound, stopped mid-recovery, or unreachable, while a notice is handled, and (full form
only, on a Redis-backed cluster of its own: GCS fault tolerance) killed with its head and the
head restarted; ``--quick`` runs the first only. The restart needs ``redis-server`` on the PATH
(``make chaos`` installs it); without it the fault is reported in the tally's ``extra.skipped``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tests.chaos import checkpoint_crash, fuzz, gcs, scenarios

#: scenario -> (quick size, full size) and how to run it
SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "flood": ({"total": 150, "runs": 3}, {"total": 5000, "runs": 20}),
    "kill": ({"repeats": 1}, {"repeats": 3}),
    "fuzz": ({"seconds": 8}, {"seconds": 180}),
    "backends": ({"quick": True}, {"quick": False}),
    "checkpoint": ({"repeats": 1, "batch": True}, {"repeats": 3}),
    "gcs": ({"quick": True}, {"quick": False}),
}
RUNNERS: dict[str, Callable[..., scenarios.Tally]] = {
    "flood": scenarios.scenario_flood,
    "kill": scenarios.scenario_kill,
    "backends": scenarios.scenario_backends,
    "checkpoint": checkpoint_crash.scenario_checkpoint,
    "gcs": gcs.scenario_gcs,
}


def run(name: str, *, quick: bool, workdir: Path, moto: Any = None) -> scenarios.Tally:
    size = SIZES[name][0 if quick else 1]
    if name == "fuzz":
        return fuzz.scenario_fuzz(**size)
    return RUNNERS[name](workdir / name, moto=moto, **size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.campaign", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the short form the test suite runs")
    parser.add_argument("--only", nargs="+", choices=sorted(SIZES), default=sorted(SIZES),
                        help="scenarios to run (default: all)")
    parser.add_argument("--out", type=Path, help="also write the tallies to this JSON file")
    parser.add_argument("--flood-total", type=int, help="messages in the flood (default: 150 quick, 5000 full)")
    parser.add_argument("--faults", nargs="+", metavar="PREFIX",
                        help="scenario 2 (backends): only the faults whose names start with these")
    args = parser.parse_args(argv)
    if args.faults:
        scenarios.select_faults(quick=args.quick, only=args.faults)  # an unknown prefix fails here
        for size in SIZES["backends"]:
            size["only"] = args.faults
    if args.flood_total:
        SIZES["flood"][0 if args.quick else 1]["total"] = args.flood_total
    # SIGTERM stops the daemons, the servers and moto too (the worlds' finally blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    started = datetime.now(timezone.utc)
    results = []
    failed = False
    try:
        for name in args.only:
            tally = run(name, quick=args.quick, workdir=workdir)
            results.append(tally.as_json())
            failed |= bool(tally.violations)
            print(json.dumps(tally.as_json()), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"started": started.isoformat(), "quick": args.quick, "machine": _machine(), "scenarios": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


def _machine() -> str:
    import os
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
