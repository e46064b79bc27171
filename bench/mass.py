"""Mass interruption benchmark (issue #45): a Spot wave of Kueue runs followed end to end, on the
real control plane.

    python bench/mass.py [--runs 50] [--workers 10] [--block-runs 20] [--configs 1,2,off]
    python bench/mass.py --quick          # 3 runs x 2 workers (the quick form's wave)

The real control plane of tests/support/controlplane (kube-apiserver, etcd, the scheduler, the
controller-manager, kwok, the KubeRay operator, Kueue; built by ``make controlplane``), moto for SQS
and S3, the real daemon as deployed (its ServiceAccount's token and RBAC, ``resilienced run``'s
flags, its own process) with the recording GCS stand-in for the Ray side: the wave of
tests/cluster/mass.py (its docstring says what is built, sent and measured).  ``--runs`` RayJobs of
``--workers`` 8-GPU workers on kwok Spot Nodes, a ClusterQueue with Spot quota for all, Capacity
Block quota (and Nodes) for ``--block-runs`` of them and On-Demand for the rest; one notice per
worker Node, a run's notices together.

Configurations, each on a fresh namespace of the same control plane and the same Nodes (made
once: kwok and the node controller make about 3 Nodes Ready a second here; between two waves the
daemon's cordons are lifted and the last wave's pods gone), in one run: ``1`` (one
replica), ``2`` (two replicas, one queue; claims and follow-ups on Leases in both), ``off`` (one
replica, ``--follow-up false``: the baseline, what the follow-up costs and what it is for).

Printed per configuration: notice -> drained / requeued / admitted / scheduled / training again
(p50, p99, max; the follow-up records' own times too), the capacity every run ended on, the
follow-up's ends (``resumed`` / ``stuck`` with the reason), runs requeued twice; the daemon's
API calls per run by verb and resource from the API server's audit log against the floor of
writes (the Node's cordon per lost instance, three writes per move: deactivate the Workload, steer
the RayJob, reactivate the Workload with its PodSets steered) as a ratio, within 2x or not, the
follow-up records' Leases apart from the claims'; reads per run per minute of
follow-up; the daemon processes' CPU seconds and peak RSS.  ``--json PATH`` writes it all, run by
run.  Figures go to docs/benchmarks.md (## Mass interruption on the real control plane).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer  # noqa: E402
from tests.cluster.mass import Result, Wave, report, run_wave  # noqa: E402
from tests.cluster.stage import Aws  # noqa: E402
from tests.support.controlplane import ControlPlane  # noqa: E402
from tests.support.controlplane.world import World, install_daemon_identity  # noqa: E402


def machine() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0)
    return {"arch": platform.machine(), "nproc": os.cpu_count(), "cpu": model, "memory_mib": mem,
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "load_average_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="RayJobs (Kueue-managed)")
    parser.add_argument("--workers", type=int, default=10, help="8-GPU workers per run = notices per run")
    parser.add_argument("--block-runs", type=int, default=None, help="runs the Capacity Block's quota fits "
                        "(default: 2 in 5); On-Demand fits the rest")
    parser.add_argument("--configs", default="1,2,off", help="of 1, 2 (replicas, following), off (the baseline)")
    parser.add_argument("--interval", type=float, default=5.0, help="--follow-up-interval-seconds")
    parser.add_argument("--admitted-bound", type=int, default=30, help="--admitted-bound-seconds")
    parser.add_argument("--concurrency", type=int, default=None, help="the daemon's --concurrency (default: its own, 10)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="each wave's bound, from its first notice")
    parser.add_argument("--quick", action="store_true", help="3 runs x 2 workers, the block fits 1")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this folder and keep it (the daemons' logs, the drains recorded), "
                             "instead of a temporary one")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.workers, args.block_runs = 3, 2, 1
    block_runs = args.block_runs if args.block_runs is not None else (2 * args.runs) // 5
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or set(configs) - {"1", "2", "off"}:
        parser.error("--configs: of 1, 2, off")
    if not (1 <= args.workers <= 10 and args.runs >= 1 and 0 <= block_runs <= args.runs):
        parser.error("need 1 <= --workers <= 10 (a run's notices in one batch), 0 <= --block-runs <= --runs")
    os.environ.update(FAKE_CREDENTIALS)
    start = time.time()
    results: list[Result] = []

    def say(text: str) -> None:
        print(f"[{time.time() - start:6.0f} s] {text}", flush=True)

    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    workdir = (contextlib.nullcontext(str(args.keep)) if args.keep is not None
               else tempfile.TemporaryDirectory(prefix="bench-mass-"))
    with workdir as tmp, MotoServer() as moto, ControlPlane() as plane:
        install_daemon_identity(plane)
        say(f"control plane up ({', '.join(plane.running())})")
        for config in configs:
            wave = Wave(runs=args.runs, workers=args.workers, block_runs=block_runs,
                        replicas=2 if config == "2" else 1, follow_up=config != "off", interval_s=args.interval,
                        admitted_bound_s=args.admitted_bound, timeout_s=args.timeout,
                        extra=("--concurrency", str(args.concurrency)) if args.concurrency else ())
            say(f"wave: {wave.label}")
            moto.reset()
            aws = Aws(moto.endpoint_url).open()
            world = World(plane)
            try:
                results.append(run_wave(plane, world, aws, wave, Path(tmp) / config, progress=say,
                                        keep_nodes=f"mass-{args.runs}x{args.workers}"))
            except AssertionError as err:  # a wave that could not be built or followed: said, not figured
                say(f"wave {wave.label} did not finish: {str(err)[:2000]}")
                continue
            finally:
                world.close()
            print(report(results[-1:]), flush=True)
    print()
    print(f"machine: {json.dumps(machine())}")
    print(f"load: {args.runs} runs x {args.workers} workers, {args.runs * args.workers} notices; block fits "
          f"{block_runs} runs, On-Demand {args.runs - block_runs}; follow-up interval {args.interval} s, "
          f"admitted bound {args.admitted_bound} s")
    print(report(results))
    for r in results:  # the bound: API writes per run within 2x the floor
        a = r.as_json()["api"]
        print(f"API writes per run, {r.wave.label}: {a['writes_per_run']} against the floor's {a['floor_writes_per_run']}: "
              f"x{a['writes_over_floor']}, {'within' if a['within_2x_floor'] else 'NOT within'} 2x "
              f"(named bookkeeping {a['bookkeeping_per_run']} per run, tests/cluster/mass.py)")
    if len(results) > 1:
        base = next((r for r in results if not r.wave.follow_up), None)
        for r in results:
            if r is base or base is None:
                continue
            j, b = r.as_json(), base.as_json()
            print(f"following ({r.wave.label}) vs the baseline: CPU {j['daemon']['cpu_s']} / {b['daemon']['cpu_s']} s "
                  f"(x{j['daemon']['cpu_s'] / max(b['daemon']['cpu_s'], 0.01):.1f}); API writes per run "
                  f"{j['api']['writes_per_run']} / {b['api']['writes_per_run']}, reads per run "
                  f"{j['api']['reads_per_run']} / {b['api']['reads_per_run']}; runs training again "
                  f"{j['stages_s']['training']['n']} / {b['stages_s']['training']['n']}")
            minutes = j["api"]["followup_run_minutes"]
            extra = (j["api"]["reads_per_run"] - b["api"]["reads_per_run"]) * r.wave.runs
            if minutes:
                print(f"  the follow-up's reads (the reads over the baseline's): {extra:.0f} over {minutes} run-minutes "
                      f"of follow-up = {extra / minutes:.1f} reads per run per minute")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": [r.as_json() for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
