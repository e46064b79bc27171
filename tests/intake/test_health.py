"""``/healthz`` of the real daemon sees a long-lived task die, names it, and the pod is restarted.

The daemon runs in process (``daemon.run``, kubernetes mode) against moto (SQS with a DLQ, S3,
EC2) and the emulated Kubernetes API server (Karpenter's kinds registered too, so every optional
watch cache runs), and its HTTP server is asked over HTTP.  Each long-lived task is killed by
making the next call it makes into its backend's adapter raise an error that is not the backend's
(a bug, or an error nobody translated): the ping (``SqsQueue.ping``/``depth``), a watch cache (its
next list, after the API server expires every watch), the Lease sweeper
(``KubeLeaseClaims.sweep``) and the follow-up (``KubeFollowUps.all``).  ``/healthz`` answered 200
before (issue #22: ``tasks.alive()`` read a set each task's done-callback had already left), now
503 naming the task and why; the Deployment's livenessProbe reads ``/healthz``, so the kubelet
restarts the pod.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from resilienced.app import daemon
from resilienced.app import runtime
from resilienced.aws.sqs import SqsQueue
from resilienced.kube import cache
from resilienced.kube.followup_store import KubeFollowUps
from resilienced.kube.leases import KubeLeaseClaims
from resilienced.local.aws import free_port
from resilienced.settings import Settings
from tests.kube.conftest import KARPENTER_RESOURCES
from tests.support.kubeapi import KubeApiServer

from .conftest import REGION, Queues

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KILLED = "RuntimeError: killed by the test"
CACHES = ("nodes", "pods", "rayclusters.ray.io", "rayjobs.ray.io", "jobs.batch.volcano.sh",
          "nodepools.karpenter.sh", "ec2nodeclasses.karpenter.k8s.aws", "workloads.kueue.x-k8s.io",
          "nodeclaims.karpenter.sh", "events")  # the last three: the follow-up's looks read them (issue #45)
#: every long-lived task of the daemon in kubernetes mode (the consumer loop's death ends the
#: daemon instead: test_a_dead_consumer_loop_ends_the_daemon)
LONG_LIVED = ("resilienced.ping", "resilienced.lease-sweep", "resilienced.follow-up",
              *(f"resilienced.kube.cache[{r}]" for r in CACHES))


@dataclass
class Daemon:
    """The daemon of one test: its task, its stop event, its /healthz."""

    task: asyncio.Task[int]
    stop: asyncio.Event
    port: int
    kubeapi: KubeApiServer

    async def health(self) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.port}/healthz") as response:
                return response.status, json.loads(await response.text())

    async def until_unhealthy(self, again: Callable[[], None] = lambda: None) -> tuple[int, dict[str, Any]]:
        """/healthz, asked until it is not 200 (bounded: 60 s); ``again`` called once a second."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        poked = loop.time()
        while True:
            status, body = await self.health()
            if status != 200 or loop.time() > deadline:
                return status, body
            if loop.time() - poked >= 1:
                again()
                poked = loop.time()
            await asyncio.sleep(0.05)


@pytest.fixture
async def running(queues: Queues, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    monkeypatch.setattr(daemon, "PING_INTERVAL", 0.2)  # the loops come round within the test
    monkeypatch.setattr(runtime, "SWEEP_INTERVAL_S", 0.2)
    async with KubeApiServer() as kubeapi:
        for kind in KARPENTER_RESOURCES:
            kubeapi.register(kind)
        port = free_port()
        settings = Settings.from_args([
            "--mode", "kubernetes", "--kubeconfig", str(kubeapi.write_kubeconfig(tmp_path / "kubeconfig")),
            "--claims-namespace", "resilienced", "--queue-url", queues.url, "--endpoint-url", queues.endpoint_url,
            "--region", REGION, "--wait-seconds", "1", "--http-host", "127.0.0.1", "--http-port", str(port),
            "--follow-up-interval-seconds", "0.2"], {}).validate()
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(daemon.run(settings, ready=ready, stop=stop))
        await asyncio.wait({task, asyncio.ensure_future(ready.wait())}, timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        assert ready.is_set(), task.exception() if task.done() else "the daemon did not start in 60 s"
        try:
            yield Daemon(task=task, stop=stop, port=port, kubeapi=kubeapi)
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=60)


def raising(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("killed by the test")


def kill(name: str, d: Daemon, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make the long-lived task ``name`` raise at its next call into its adapter; returns what
    to call again until it has (a cache lists again only once the API server ends its watch)."""
    if name == "resilienced.ping":
        monkeypatch.setattr(SqsQueue, "ping", raising)
        monkeypatch.setattr(SqsQueue, "depth", raising)
    elif name == "resilienced.lease-sweep":
        monkeypatch.setattr(KubeLeaseClaims, "sweep", raising)
    elif name == "resilienced.follow-up":
        monkeypatch.setattr(KubeFollowUps, "all", raising)
    else:
        resource = name[len("resilienced.kube.cache["):-1]
        real: Callable[..., Any] = cache.call

        listed: list[bool] = []

        def call(*, verb: str, resource: str, request: Any) -> Any:
            if verb == "list" and resource == target:
                listed.append(True)
                request.close()  # the request coroutine is never awaited
                raise RuntimeError("killed by the test")
            return real(verb=verb, resource=resource, request=request)

        def expire_until_listed() -> None:
            # A cache whose watch was not open yet (still listing, or between its list and its
            # watch) is not ended by an expiry and lists no more: expire again until it has.
            if not listed:
                d.kubeapi.expire_watches()

        target = resource
        monkeypatch.setattr(cache, "call", call)
        d.kubeapi.expire_watches()  # every cache lists again; this one's list raises
        return expire_until_listed
    return lambda: None


def test_the_livenessprobe_reads_healthz_so_a_503_restarts_the_pod() -> None:
    """The kubelet counts an HTTP probe answer outside 200-399 as a failure, and restarts the
    container after ``failureThreshold`` of them."""
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "http"}
    assert any(p["name"] == "http" for p in container["ports"])
    assert probe["failureThreshold"] >= 1 and not 200 <= 503 < 400


async def test_every_long_lived_task_is_one_the_health_check_covers(running: Daemon) -> None:
    names = {t.get_name() for t in asyncio.all_tasks()}
    daemon_tasks = {n for n in names if n.startswith("resilienced.")
                    and not n.startswith(("resilienced.message/", "resilienced.keep/", "resilienced.claim-renewal"))}
    assert daemon_tasks == {*LONG_LIVED, "resilienced.consumer", "resilienced.stop"}
    assert await running.health() == (200, {"status": "ok"})


@pytest.mark.parametrize("name", LONG_LIVED)
async def test_a_dead_long_lived_task_turns_healthz_to_503_naming_it(
        running: Daemon, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    assert await running.health() == (200, {"status": "ok"})
    again = kill(name, running, monkeypatch)
    status, body = await running.until_unhealthy(again)
    assert status == 503, body
    assert body == {"status": f"long-lived task(s) died: {name}", "dead": {name: KILLED}}
    monkeypatch.undo()
    running.stop.set()  # the daemon still stops cleanly
    assert await asyncio.wait_for(running.task, timeout=60) == 0


async def test_a_dead_consumer_loop_ends_the_daemon(running: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer loop is the daemon: its death ends the process (exit status 1, the container
    restarts) rather than leaving a daemon that receives nothing."""
    monkeypatch.setattr(SqsQueue, "receive", raising)
    with pytest.raises(RuntimeError, match="killed by the test"):
        await asyncio.wait_for(running.task, timeout=60)
