"""The drill's figures against its two anchors, measured in the same run.

Runs ``resilienced drill`` (spot scenario, defaults unless given) three times, one after another:

1. **resilienced**: the daemon on, Ray Train's preemption poll at 0.5 s (what docs/trainer.md sets);
2. **daemon off** (anchor): no daemon, periodic checkpoints only; the node is killed at the same
   moment and an autoscaler-like replacement is added by the drill;
3. **Ray's default poll** (anchor): the daemon on, ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=5``.

Prints a table, the ratios (steps lost with the daemon against without; notice -> trainer with
the 0.5 s poll against 5 s) and one JSON line.  Usage::

    python bench/drill.py [--repeat 1] [-- <extra drill flags>]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ("ok", "interrupted_at_step", "checkpoint_step", "steps_lost", "steps_trained_twice",
          "notice_to_trainer_s", "notice_to_checkpoint_s", "notice_to_durable_s", "notice_to_resumed_s",
          "capacity", "losses_match_uninterrupted")
VARIANTS = {
    "resilienced": ["--daemon", "on", "--preemption-poll", "0.5"],
    "daemon off": ["--daemon", "off", "--preemption-poll", "0.5"],
    "ray default poll": ["--daemon", "on", "--preemption-poll", "5"],
}


def run(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bd-", dir="/tmp") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "resilienced", "drill", *flags, "--json-report", str(report)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if not report.exists():
            raise SystemExit(f"the drill wrote no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(report.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant (reported one by one)")
    parser.add_argument("extra", nargs="*", help="flags passed to every drill (after --)")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"machine: {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}")
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeat):
        for name, flags in VARIANTS.items():
            results[name].append(run([*flags, *args.extra]))
    width = max(len(f) for f in FIELDS)
    print(f"{'':<{width}}  " + "  ".join(f"{name:>18}" for name in VARIANTS))
    for i in range(args.repeat):
        for field in FIELDS:
            print(f"{field:<{width}}  " + "  ".join(f"{str(results[n][i].get(field)):>18}" for n in VARIANTS))
        print()

    def mean(name: str, field: str) -> float | None:
        values = [r[field] for r in results[name] if r.get(field) is not None]
        return sum(values) / len(values) if values else None

    lost_on, lost_off = mean("resilienced", "steps_lost"), mean("daemon off", "steps_lost")
    heard_fast, heard_slow = mean("resilienced", "notice_to_trainer_s"), mean("ray default poll", "notice_to_trainer_s")
    summary = {
        "steps_lost_daemon_on": lost_on, "steps_lost_daemon_off": lost_off,
        "steps_lost_ratio_on_to_off": (lost_on / lost_off) if lost_on is not None and lost_off else None,
        "notice_to_trainer_s_poll_0_5": heard_fast, "notice_to_trainer_s_poll_5": heard_slow,
        "notice_to_trainer_ratio_0_5_to_5": (heard_fast / heard_slow) if heard_fast is not None and heard_slow else None,
        "notice_to_durable_s": mean("resilienced", "notice_to_durable_s"),
        "notice_to_resumed_s": mean("resilienced", "notice_to_resumed_s"),
        "all_ok": all(r["ok"] for rs in results.values() for r in rs),
    }
    print(f"steps lost, daemon on / off: {lost_on} / {lost_off}"
          f"  (ratio {summary['steps_lost_ratio_on_to_off']})")
    print(f"notice -> trainer, poll 0.5 s / 5 s: {heard_fast} / {heard_slow} s"
          f"  (ratio {summary['notice_to_trainer_ratio_0_5_to_5']})")
    print(json.dumps({"summary": summary, "runs": results}))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
