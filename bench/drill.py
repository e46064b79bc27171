"""The drill's figures against its two anchors, measured in the same run.

Runs ``resilienced drill`` (spot scenario, defaults unless given) three times, one after another:

1. **resilienced**: the daemon on, Ray Train's preemption poll at 0.5 s (what docs/trainer.md sets);
2. **daemon off** (anchor): no daemon, periodic checkpoints only; the node is killed at the same
   moment and an autoscaler-like replacement is added by the drill;
3. **Ray's default poll** (anchor): the daemon on, ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=5``.

Prints a table, the ratios (steps lost with the daemon against without; notice -> trainer with
the 0.5 s poll against 5 s) and one JSON line.

``--elastic`` (issue #15) runs instead, one after the other on the same machine and with the
same sizes (3 workers, the same steps, a replacement node that joins ``--node-boot-seconds``
after the daemon asks for it): the gang requeue (``--scenario spot``) and the elastic run
(``--scenario elastic``, min 2 workers), and prints the idle worker-seconds of the interruption
for each (``worker_seconds_idle``: worker nodes up minus ranks training, from the notice until
the run is back at 3) and their ratio, elastic / gang (goals, issue #24: at most 1 with a 60 s
boot, at most 1/3 with 180 s), with the steps lost and each run's restarts (``restarts``: from
what each waited for to its first step; the elastic run's own measure and its phases are in
``restarts_measured`` in the JSON line).
Usage::

    python bench/drill.py [--repeat 1] [-- <extra drill flags>]
    python bench/drill.py --elastic [--repeat 1] [-- <extra drill flags>]
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
          "capacity", "losses_match_uninterrupted", "worker_seconds_idle")
VARIANTS = {
    "resilienced": ["--daemon", "on", "--preemption-poll", "0.5"],
    "daemon off": ["--daemon", "off", "--preemption-poll", "0.5"],
    "ray default poll": ["--daemon", "on", "--preemption-poll", "5"],
}
#: --elastic: the same sizes for both (the elastic scenario's defaults, docs/benchmarks.md).
ELASTIC_SIZES = ["--workers", "3", "--steps", "300", "--node-boot-seconds", "60"]
ELASTIC_VARIANTS = {
    "gang requeue (spot)": ["--scenario", "spot", *ELASTIC_SIZES],
    "elastic": ["--scenario", "elastic", *ELASTIC_SIZES],
}
ELASTIC_FIELDS = ("ok", "steps_lost", "steps_trained_twice", "resumed_world_size", "back_to_full_s",
                  "worker_seconds_idle", "notice_to_resumed_s", "losses_match_uninterrupted", "loss_max_rel_diff",
                  "restarts", "elastic_decision", "replacement")


def run(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bd-", dir="/tmp") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "resilienced", "drill", *flags, "--json-report", str(report)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if not report.exists():
            raise SystemExit(f"the drill wrote no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(report.read_text())


def run_all(variants: dict[str, list[str]], fields: tuple[str, ...], *, repeat: int,
            extra: list[str]) -> dict[str, list[dict]]:
    """Every variant ``repeat`` times, one after another; prints the table of ``fields``."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, flags in variants.items():
            results[name].append(run([*flags, *extra]))
    width = max(len(f) for f in fields)
    print(f"{'':<{width}}  " + "  ".join(f"{name:>20}" for name in variants))
    for i in range(repeat):
        for field in fields:
            print(f"{field:<{width}}  " + "  ".join(f"{str(results[n][i].get(field)):>20}" for n in variants))
        print()
    return results


def mean(results: dict[str, list[dict]], name: str, field: str) -> float | None:
    values = [r[field] for r in results[name] if r.get(field) is not None]
    return sum(values) / len(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def done(summary: dict, results: dict[str, list[dict]]) -> int:
    """The JSON line; exit 0 when every drill's report was ok."""
    summary["all_ok"] = all(r["ok"] for rs in results.values() for r in rs)
    print(json.dumps({"summary": summary, "runs": results}))
    return 0 if summary["all_ok"] else 1


def elastic(repeat: int, extra: list[str]) -> int:
    """Idle worker-seconds per interruption: the gang requeue against the elastic run."""
    results = run_all(ELASTIC_VARIANTS, ELASTIC_FIELDS, repeat=repeat, extra=extra)
    gang = mean(results, "gang requeue (spot)", "worker_seconds_idle")
    grown = mean(results, "elastic", "worker_seconds_idle")
    lost = (mean(results, "gang requeue (spot)", "steps_lost"), mean(results, "elastic", "steps_lost"))
    print(f"idle worker-seconds per interruption, gang / elastic: {gang} / {grown}"
          f"  (ratio elastic / gang {ratio(grown, gang)}; goals: <= 1 at a 60 s boot, <= 1/3 at 180 s)")
    print(f"steps lost, gang / elastic: {lost[0]} / {lost[1]}")
    return done({"worker_seconds_idle_gang": gang, "worker_seconds_idle_elastic": grown,
                 "ratio_elastic_to_gang": ratio(grown, gang), "steps_lost_gang": lost[0],
                 "steps_lost_elastic": lost[1]}, results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant (reported one by one)")
    parser.add_argument("--elastic", action="store_true",
                        help="the gang requeue against the elastic run (idle worker-seconds)")
    parser.add_argument("extra", nargs="*", help="flags passed to every drill (after --)")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"machine: {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}")
    if args.elastic:
        return elastic(args.repeat, args.extra)
    results = run_all(VARIANTS, FIELDS, repeat=args.repeat, extra=args.extra)

    lost_on, lost_off = mean(results, "resilienced", "steps_lost"), mean(results, "daemon off", "steps_lost")
    heard_fast = mean(results, "resilienced", "notice_to_trainer_s")
    heard_slow = mean(results, "ray default poll", "notice_to_trainer_s")
    summary = {
        "steps_lost_daemon_on": lost_on, "steps_lost_daemon_off": lost_off,
        "steps_lost_ratio_on_to_off": ratio(lost_on, lost_off),
        "notice_to_trainer_s_poll_0_5": heard_fast, "notice_to_trainer_s_poll_5": heard_slow,
        "notice_to_trainer_ratio_0_5_to_5": ratio(heard_fast, heard_slow),
        "notice_to_durable_s": mean(results, "resilienced", "notice_to_durable_s"),
        "notice_to_resumed_s": mean(results, "resilienced", "notice_to_resumed_s"),
    }
    print(f"steps lost, daemon on / off: {lost_on} / {lost_off}"
          f"  (ratio {summary['steps_lost_ratio_on_to_off']})")
    print(f"notice -> trainer, poll 0.5 s / 5 s: {heard_fast} / {heard_slow} s"
          f"  (ratio {summary['notice_to_trainer_ratio_0_5_to_5']})")
    return done(summary, results)


if __name__ == "__main__":
    sys.exit(main())
