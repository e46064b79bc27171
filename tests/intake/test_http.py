"""/healthz, /readyz and /metrics over real HTTP."""

from __future__ import annotations

import json

import aiohttp

from resilienced.ops.http import HttpServer, Readiness
from resilienced.ops.metrics import Metrics

from . import payloads as p
from .conftest import Recorder
import pytest

pytestmark = pytest.mark.integration


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def get(server: HttpServer, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{server.port}{path}") as response:
            return response.status, await response.text()


async def test_readiness_follows_the_queue():
    clock = Clock()
    readiness = Readiness(stale_after=60, clock=clock)
    server = HttpServer(host="127.0.0.1", port=0, metrics=Metrics(), readiness=readiness, dead=dict)
    await server.start()
    try:
        status, body = await get(server, "/readyz")
        assert status == 503 and "has not answered yet" in body
        readiness.ok()
        assert (await get(server, "/readyz"))[0] == 200
        readiness.failed("sqs: receive_message failed: EndpointConnectionError")
        status, body = await get(server, "/readyz")
        assert status == 503 and "EndpointConnectionError" in body
        readiness.ok()
        clock.now += 61  # no answer for longer than stale_after
        assert (await get(server, "/readyz"))[0] == 503
    finally:
        await server.stop()


async def test_health_names_each_dead_long_lived_task():
    dead: dict[str, str] = {}
    server = HttpServer(host="127.0.0.1", port=0, metrics=Metrics(), readiness=Readiness(),
                        dead=lambda: dead)
    await server.start()
    try:
        assert await get(server, "/healthz") == (200, '{"status": "ok"}')
        dead["resilienced.ping"] = "RuntimeError: boom"
        dead["resilienced.kube.cache[pods]"] = "exited unexpectedly"
        status, body = await get(server, "/healthz")
        assert status == 503
        assert json.loads(body) == {
            "status": "long-lived task(s) died: resilienced.kube.cache[pods], resilienced.ping",
            "dead": {"resilienced.ping": "RuntimeError: boom", "resilienced.kube.cache[pods]": "exited unexpectedly"}}
    finally:
        await server.stop()


async def test_metrics_show_what_the_consumer_decided(queues, make_consumer):
    consumer = make_consumer(Recorder())
    queues.send(p.spot())
    queues.send("garbage")
    while len(await consumer.run_once()) < 2:
        pass
    server = HttpServer(host="127.0.0.1", port=0, metrics=consumer.metrics, readiness=consumer.readiness,
                        dead=dict)
    await server.start()
    try:
        status, text = await get(server, "/metrics")
    finally:
        await server.stop()
    assert status == 200
    assert 'resilienced_events_received_total{kind="spot_interruption"} 1.0' in text
    assert 'resilienced_events_decided_total{kind="spot_interruption",outcome="done"} 1.0' in text
    assert 'resilienced_events_decided_total{kind="invalid",outcome="undecodable"} 1.0' in text
    assert "resilienced_handling_seconds_count 2.0" in text
    assert "resilienced_in_flight 0.0" in text
    assert "resilienced_dead_lettered_total 0.0" in text
