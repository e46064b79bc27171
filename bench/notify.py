"""Notification benchmark: what a webhook costs the recovery, healthy or failing.

    python bench/notify.py [--runs 30]

The recovery is the real :class:`~resilienced.recovery.responder.Recovery` acting on a Spot notice for one
run, with a stand-in cluster (one target on the instance; cordon and Events do nothing) and
in-memory claims, so that what is timed is the recovery's own path plus the notifier's part in
it.  The checkpoint and requeue steps are off (no store, no planner): they do not touch the
notifier.  Each mode is a real aiohttp server on 127.0.0.1 (or none):

    none      no notifier (the baseline, measured in the same run)
    ok        the webhook answers 200 at once
    error     it answers 500 (retried twice)
    hang      it holds every request (the notifier's 5 s timeout, retried twice)
    refused   nothing listens on the port

Printed per mode: the median and p99 of ``Recovery.act`` (seconds), and the difference of the
median against the baseline (the issue's bound: within 1 s of no webhook).  The notifier's own
outcome counts (sent / failed) are printed after it is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from resilienced import log
from resilienced.intake import pipeline as intake
from resilienced.doubles import MemoryClaims
from resilienced.model import Target
from resilienced.ops.notify import Notifier, NotifyMetrics
from resilienced.ports import DrainResult, Location
from resilienced.recovery.responder import Recovery
from resilienced.settings import IntakeSettings

INSTANCE = "i-0123456789abcdef0"


class StandInCluster:
    """One run on the instance; cordon and record do nothing (not what is measured)."""

    async def locate(self, *, instance_ids: Any, capacity_reservation_id: Any = None) -> Location:
        target = Target(instance_id=INSTANCE, node="n1", ray_cluster="ml/train-rc", ray_job="ml/train",
                        ray_node_ids=("01" * 28,), checkpoint_uri=None)
        return Location(targets=(target,), unresolved={})

    async def cordon(self, target: Target, *, reason: str, deadline: Any) -> None:
        return None

    async def record(self, target: Target, *, reason: str, message: str, warning: bool) -> None:
        return None


class StandInRay:
    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        return DrainResult(node_id, "drained", True, int(deadline.timestamp() * 1000))


def notice(n: int) -> Any:
    body = {"version": "0", "id": f"00000000-0000-4000-8000-{n:012d}", "source": "aws.ec2",
            "detail-type": "EC2 Spot Instance Interruption Warning", "account": "123456789012",
            "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "region": "us-east-1",
            "resources": [], "detail": {"instance-id": INSTANCE, "instance-action": "terminate"}}
    return intake.read(json.dumps(body), IntakeSettings()).plan


async def server(mode: str, hold: asyncio.Event) -> tuple[str, web.AppRunner | None]:
    if mode == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{s.getsockname()[1]}/hook", None

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if mode == "hang":
            await hold.wait()
        return web.Response(status=500 if mode == "error" else 200)

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook", runner


async def measure(mode: str, runs: int) -> dict[str, Any]:
    runner, notifier, metrics = None, None, NotifyMetrics(CollectorRegistry())
    hold = asyncio.Event()
    if mode != "none":
        url, runner = await server(mode, hold)
        notifier = Notifier(url=url, metrics=metrics)
    ray = StandInRay()
    recovery = Recovery(cluster=StandInCluster(), claims=MemoryClaims(),
                        ray_control=lambda target: _ready(ray), notifier=notifier)
    times = []
    for n in range(runs):
        plan = notice(n)
        start = time.perf_counter()
        outcome = await recovery.act(plan, holder=f"bench/{n}")
        times.append(time.perf_counter() - start)
        assert outcome.result.value == "done", outcome.reason
    if notifier is not None:
        await notifier.close(timeout_s=0.5)
    hold.set()
    if runner is not None:
        await runner.cleanup()
    counts = {o: metrics.notifications.labels(outcome=o)._value.get() for o in ("sent", "failed", "dropped")}
    times.sort()
    return {"median": statistics.median(times), "p99": times[min(len(times) - 1, int(len(times) * 0.99))],
            "counts": counts}


async def _ready(ray: StandInRay) -> StandInRay:
    return ray


async def main(runs: int) -> None:
    log.configure(level="error")
    results = {mode: await measure(mode, runs) for mode in ("none", "ok", "error", "hang", "refused")}
    base = results["none"]["median"]
    print(f"Recovery.act, {runs} runs per mode (one Spot notice, one run each)")
    print(f"{'mode':<8} {'median s':>10} {'p99 s':>10} {'median - none':>14} {'ratio':>7}  notifications")
    for mode, r in results.items():
        print(f"{mode:<8} {r['median']:>10.5f} {r['p99']:>10.5f} {r['median'] - base:>+14.5f} "
              f"{r['median'] / base:>7.2f}  " + ", ".join(f"{k} {int(v)}" for k, v in r["counts"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    asyncio.run(main(parser.parse_args().runs))
