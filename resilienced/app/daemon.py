"""``resilienced run``: wire settings -> SQS -> consumer loop, the HTTP server, and signals.

Start-up checks, once: settings are valid; the queue answers; it has a redrive policy (a DLQ),
unless ``--allow-no-dlq``.  Then the consumer loop runs until SIGTERM or SIGINT, which stop
receiving and drain within ``--shutdown-timeout``; the process then exits 0.

The responder and the claim store come from :func:`resilienced.app.runtime.open_runtime` for the
configured ``--mode`` (plan: :class:`~resilienced.recovery.plan_only.PlanLogger`; kubernetes or ray:
:class:`~resilienced.recovery.responder.Recovery` with that mode's adapters); :func:`serve` takes them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import TYPE_CHECKING

from resilienced import log
from resilienced.aws.sqs import SqsQueue
from resilienced.doubles import MemoryClaims
from resilienced.consumer.loop import Consumer
from resilienced.consumer.settle import Observer
from resilienced.errors import BackendUnavailable, ConfigError, ResilienceError
from resilienced.ops.http import HttpServer, Readiness
from resilienced.log import Logger
from resilienced.ops.metrics import QUEUE_STATES, Metrics
from resilienced.ports import ClaimStore, Responder
from resilienced.recovery.plan_only import PlanLogger
from resilienced.settings import Settings
from resilienced.supervisor import Supervisor

if TYPE_CHECKING:
    from resilienced.app.runtime import StandIns

#: Seconds between readiness pings of the queue (receives also count).
PING_INTERVAL = 15.0
#: Seconds between reads of the queue's depth (a ping that also reads the message counts).
DEPTH_INTERVAL = 60.0


class StartupError(ResilienceError):
    """The daemon cannot start (the queue does not answer); the CLI exits 1 with this message."""


async def serve(settings: Settings, *, responder: Responder | None = None,
                claims: ClaimStore | None = None, ready: asyncio.Event | None = None,
                metrics: Metrics | None = None, replica: str | None = None,
                observer: Observer | None = None, stop: asyncio.Event | None = None,
                supervisor: Supervisor | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT (or ``stop`` is set); return the exit status (0 after a clean stop).

    ``observer`` is called once per settled message (see :data:`resilienced.consumer.settle.Observer`).
    With ``stop`` the caller owns the signals (the drill): no signal handler is installed.
    ``supervisor`` owns the long-lived tasks (:func:`run` passes the daemon's, which also owns the
    runtime's); the consumer loop, the pinger and the stop waiter run in a scope of it that ends
    with this call.  ``/healthz`` answers 503 naming any of its tasks that died.
    """
    logger = log.get("resilienced.daemon")  # the lines keep their logger name (docs/operations.md)
    qs = settings.queue
    metrics = metrics if metrics is not None else Metrics()
    supervisor = supervisor if supervisor is not None else Supervisor()
    readiness = Readiness(stale_after=max(60.0, 2 * qs.wait_seconds + PING_INTERVAL))
    async with SqsQueue.open(queue_url=qs.queue_url, region=qs.effective_region,
                             endpoint_url=qs.endpoint_url,
                             max_connections=qs.concurrency * 2 + 4) as queue:
        max_receive_count = await _startup_checks(queue, settings, readiness=readiness, metrics=metrics)
        consumer = Consumer(
            queue=queue, responder=responder if responder is not None else PlanLogger(),
            claims=(claims if claims is not None
                    else MemoryClaims(done_ttl_seconds=settings.intake.dedupe_seconds)),
            queue_settings=qs, intake_settings=settings.intake,
            max_receive_count=max_receive_count, metrics=metrics, readiness=readiness,
            **({"replica": replica} if replica else {}),
            observer=observer,
        )
        http = await _start_http(settings, metrics=metrics, readiness=readiness, supervisor=supervisor)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if stop is None else ()
        for sig in signals:
            loop.add_signal_handler(sig, _on_signal, consumer, logger, sig)
        try:
            async with supervisor.scope() as running:  # ends the pinger and the stop waiter
                if stop is not None:
                    running.spawn(_stop_on(stop, consumer), name="resilienced.stop", may_end=lambda: True)
                running.spawn(_ping(queue, readiness, logger, metrics), name="resilienced.ping")
                logger.info("started", queue_url=qs.queue_url, region=qs.effective_region,
                            endpoint_url=qs.endpoint_url, max_receive_count=max_receive_count,
                            concurrency=qs.concurrency, visibility_timeout_s=qs.visibility_timeout,
                            http_port=http.port, replica=consumer.replica,
                            rebalance_policy=settings.intake.rebalance_policy.value)
                if ready is not None:
                    ready.set()
                await running.spawn(consumer.run(), name="resilienced.consumer",
                                    may_end=lambda: consumer.stopping)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            await http.stop()
        logger.info("stopped", released=int(metrics.value("resilienced_released_total")))
    return 0


async def _startup_checks(queue: SqsQueue, settings: Settings, *, readiness: Readiness,
                          metrics: Metrics) -> int | None:
    """The queue answers and has a redrive policy (or ``--allow-no-dlq``); its maxReceiveCount."""
    qs = settings.queue
    try:
        max_receive_count = await queue.max_receive_count()
    except BackendUnavailable as e:
        raise StartupError(f"queue {qs.queue_url} did not answer: {e}") from e
    readiness.ok()
    metrics.ready.set_function(lambda: 1.0 if readiness.ready() else 0.0)
    if max_receive_count is None and not qs.allow_no_dlq:
        raise ConfigError("--queue-url", (
            f"queue {qs.queue_url} has no redrive policy (no DLQ): poison messages would have "
            "nowhere to go. Give it a RedrivePolicy with a dead-letter queue, or pass "
            "--allow-no-dlq (env RESILIENCED_ALLOW_NO_DLQ) to delete them after "
            f"{qs.max_receives_without_dlq} receives"))
    return max_receive_count


async def _start_http(settings: Settings, *, metrics: Metrics, readiness: Readiness,
                      supervisor: Supervisor) -> HttpServer:
    """/metrics, /readyz, and /healthz reading which of ``supervisor``'s tasks died."""
    http = HttpServer(host=settings.http.http_host, port=settings.http.http_port,
                      metrics=metrics, readiness=readiness, dead=supervisor.dead)
    try:
        await http.start()
    except OSError as e:
        raise StartupError(f"cannot serve HTTP on {settings.http.http_host}:{settings.http.http_port}: "
                           f"{e.strerror or e}") from e
    return http


async def _stop_on(stop: asyncio.Event, consumer: Consumer) -> None:
    await stop.wait()
    consumer.stop()


def _on_signal(consumer: Consumer, logger: Logger, sig: signal.Signals) -> None:
    logger.info("signal", signal=sig.name)
    consumer.stop()


async def _ping(queue: SqsQueue, readiness: Readiness, logger: Logger, metrics: Metrics) -> None:
    """Ping the queue every PING_INTERVAL; at most once a DEPTH_INTERVAL the ping reads its depth."""
    loop = asyncio.get_running_loop()
    depth_due = loop.time()
    while True:
        try:
            if loop.time() >= depth_due:
                depth = await queue.depth()
                depth_due = loop.time() + DEPTH_INTERVAL
                for state, attribute in QUEUE_STATES.items():
                    metrics.queue_messages.labels(state=state).set(depth[attribute])
            else:
                await queue.ping()
            readiness.ok()
        except BackendUnavailable as e:
            metrics.queue_errors.labels("get_queue_attributes").inc()
            readiness.failed(str(e))
            logger.warning("queue ping failed", error=str(e))
        await asyncio.sleep(PING_INTERVAL)


# --------------------------------------------------------------------------- the `run` command
def configure(parser: argparse.ArgumentParser) -> None:
    Settings.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    early: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # until run() installs its own: see run()
        signal.signal(sig, lambda signum, frame: early.append(signal.Signals(signum)))
    settings = Settings.from_args(args, os.environ).validate()
    log.configure(level=settings.log.log_level)
    return asyncio.run(run(settings, early_signals=early))


async def run(settings: Settings, *, ready: asyncio.Event | None = None, observer: Observer | None = None,
              stop: asyncio.Event | None = None, stand_ins: StandIns | None = None,
              early_signals: list[signal.Signals] | None = None) -> int:
    """Open the mode's adapters (:func:`resilienced.app.runtime.open_runtime`; ``stand_ins``: those
    given instead, the drill's), then :func:`serve`.

    Without ``stop`` (the ``run`` command) SIGTERM and SIGINT are handled from the start, not only
    once the consumer runs: one that comes while the daemon starts (the runtime's adapters, the
    queue's start-up checks, the HTTP server: tens of seconds when an API server is slow) ends
    the start-up, closes what it had opened, logs ``stopped`` with ``during="start-up"`` and
    returns 0, the status of any stop on SIGTERM. ``early_signals``: those :func:`main` recorded
    before the event loop ran (they count as one that came now).  Once the consumer runs, the
    stop is the consumer's (:func:`serve`: stop receiving, finish or release in-flight work).
    The ``starting`` line is logged once the handlers are in place.
    """
    logger = log.get("resilienced.daemon")
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT) if stop is None else ()
    stop = stop if stop is not None else asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, _on_stop_signal, stop, logger, sig)
    logger.info("starting", mode=settings.mode.mode.value, queue_url=settings.queue.queue_url)
    for sig in early_signals or ():
        _on_stop_signal(stop, logger, sig)
    started = ready if ready is not None else asyncio.Event()
    body = asyncio.create_task(_open_and_serve(settings, started=started, observer=observer, stop=stop,
                                               stand_ins=stand_ins))
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(started.wait())]
    try:
        await asyncio.wait([body, *waits], return_when=asyncio.FIRST_COMPLETED)
        if not body.done() and stop.is_set() and not started.is_set():
            body.cancel()  # still starting: nothing was received, so nothing is left to finish
            try:
                await body
            except asyncio.CancelledError:
                logger.info("stopped", during="start-up", released=0)
                return 0
        return await body
    finally:
        for task in (body, *waits):
            if not task.done():
                task.cancel()
        await asyncio.gather(body, *waits, return_exceptions=True)
        for sig in signals:
            loop.remove_signal_handler(sig)


def _on_stop_signal(stop: asyncio.Event, logger: Logger, sig: signal.Signals) -> None:
    logger.info("signal", signal=sig.name)
    stop.set()


async def _open_and_serve(settings: Settings, *, started: asyncio.Event, observer: Observer | None,
                          stop: asyncio.Event, stand_ins: StandIns | None) -> int:
    from resilienced.consumer.flight import replica_name
    from resilienced.app.runtime import StandIns, open_runtime

    metrics = Metrics()
    replica = replica_name()
    async with Supervisor() as supervisor:  # every long-lived task: the runtime's and serve's
        async with open_runtime(settings, metrics=metrics, replica=replica, stand_ins=stand_ins or StandIns(),
                                supervisor=supervisor) as runtime:
            return await serve(settings, responder=runtime.responder, claims=runtime.claims,
                               ready=started, metrics=metrics, replica=replica, observer=observer,
                               stop=stop, supervisor=supervisor)
