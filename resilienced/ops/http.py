"""The HTTP server: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz`` (readiness).

- ``/healthz``: 200 while the event loop answers and every long-lived task runs; 503 naming
  each long-lived task that died and why (``resilienced.supervisor.Supervisor.dead``), so the
  kubelet's livenessProbe (deploy/kubernetes/base/deployment.yaml) restarts the pod.
- ``/readyz``: 200 when the queue answered recently (:class:`Readiness`), else 503 with the
  last error.  A replica that cannot reach SQS is not ready.
- ``/metrics``: the daemon's own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from aiohttp import web

from resilienced.ops.metrics import Metrics


class Readiness:
    """Whether the queue answered recently: fed by every receive and by a periodic ping."""

    def __init__(self, *, stale_after: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._stale_after = stale_after
        self._clock = clock
        self._last_ok: float | None = None
        self.last_error: str | None = "the queue has not answered yet"

    def ok(self) -> None:
        self._last_ok = self._clock()
        self.last_error = None

    def failed(self, reason: str) -> None:
        self.last_error = reason

    def ready(self) -> bool:
        return (self.last_error is None and self._last_ok is not None
                and self._clock() - self._last_ok <= self._stale_after)


class HttpServer:
    """aiohttp on ``host:port`` (port 0: a free one, see :attr:`port` once started)."""

    def __init__(self, *, host: str, port: int, metrics: Metrics, readiness: Readiness,
                 dead: Callable[[], Mapping[str, str]]) -> None:
        """``dead()``: the long-lived tasks that died, name -> why (empty: healthy)."""
        self._host, self._port = host, port
        self._metrics, self._readiness, self._dead = metrics, readiness, dead
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_view)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics_view(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(),
                            headers={"Content-Type": Metrics.CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        dead = dict(self._dead())
        if not dead:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": f"long-lived task(s) died: {', '.join(sorted(dead))}",
                                  "dead": dead}, status=503)

    async def _readyz(self, request: web.Request) -> web.Response:
        if self._readiness.ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready",
                                  "reason": self._readiness.last_error or "no recent answer from the queue"},
                                 status=503)
