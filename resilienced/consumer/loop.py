"""The SQS consumer: receive -> handle -> ack, one pass (:meth:`Consumer.run_once`) or a loop.

Per message (:meth:`Consumer._process`), in the order of this package's parts:

1. ``visibility``: a keeper extends the message's visibility every visibility/3 seconds for as
   long as it is handled (:class:`~resilienced.consumer.visibility.Visibility`);
2. ``handle``: read and judge the body; an actionable plan goes to the responder
   (:class:`~resilienced.consumer.handle.Handler`)...
3. ``event_claim``: ...under the event claim, across deliveries and replicas
   (:class:`~resilienced.consumer.event_claim.EventClaim`);
4. ``settle``: the ack policy's verdict carried out on the queue, one ``decision`` log line and
   the metrics (:class:`~resilienced.consumer.settle.Settle`).

The loop (:meth:`Consumer.run`) receives only when a handling slot is free (``concurrency``),
so received messages never wait unstarted.  :meth:`Consumer.stop` (SIGTERM) stops receiving
(messages a long poll in flight returns after it are released at once, not started), waits up to
``shutdown_timeout`` for in-flight messages, then cancels the rest and releases them
(visibility 0) for another replica; unfinished work is never deleted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

from resilienced import log
from resilienced.clock import utcnow
from resilienced.consumer.event_claim import EventClaim
from resilienced.consumer.flight import Flight, replica_name
from resilienced.consumer.handle import Handler
from resilienced.consumer.settle import Observer, Settle
from resilienced.consumer.visibility import Visibility
from resilienced.errors import BackendUnavailable
from resilienced.ops.http import Readiness
from resilienced.log import Logger
from resilienced.ops.metrics import Metrics
from resilienced.model import Outcome
from resilienced.ports import ClaimStore, Message, Queue, Responder
from resilienced.retry import Backoff
from resilienced.settings import IntakeSettings, QueueSettings

T = TypeVar("T")

#: Longest wait between receives after queue errors, in seconds.
MAX_BACKOFF = 30.0


class Consumer:
    """Consumes one queue; see the module docstring.  All collaborators are injected."""

    def __init__(self, *, queue: Queue, responder: Responder, claims: ClaimStore,
                 queue_settings: QueueSettings, intake_settings: IntakeSettings,
                 max_receive_count: int | None, metrics: Metrics | None = None,
                 readiness: Readiness | None = None, replica: str | None = None,
                 observer: Observer | None = None, logger: Logger | None = None,
                 clock: Callable[[], datetime] | None = utcnow) -> None:
        """``clock`` gives the time events are judged at (stale or from the future); None
        judges each event as of its own time, as ``replay`` does (the demo plays recorded
        samples so)."""
        self.queue = queue
        self.settings = queue_settings
        self.metrics = metrics or Metrics()
        self.readiness = readiness or Readiness()
        self.replica = replica or replica_name()
        self.log = logger or log.get("resilienced.consumer")
        self.visibility = Visibility(queue=queue, settings=queue_settings, metrics=self.metrics, logger=self.log)
        self.handler = Handler(settings=intake_settings, clock=clock, metrics=self.metrics, logger=self.log,
                               event_claim=EventClaim(claims=claims, responder=responder, settings=queue_settings,
                                                      metrics=self.metrics, logger=self.log))
        self.settler = Settle(queue=queue, settings=queue_settings, max_receive_count=max_receive_count,
                              observer=observer, metrics=self.metrics, logger=self.log)
        self._slots = asyncio.Semaphore(queue_settings.concurrency)
        self._flights: dict[asyncio.Task[Outcome], Flight] = {}
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()

    # ----------------------------------------------------------------- one pass
    async def run_once(self) -> list[Outcome]:
        """One receive, every message handled (``concurrency`` at a time) and settled."""
        messages = await self._receive(self.settings.batch_size)
        tasks = [self._start(message) for message in messages]
        return list(await asyncio.gather(*tasks))

    async def _process(self, flight: Flight) -> Outcome:
        """Handle and settle one message; release it (visibility 0) if cancelled unfinished."""
        self.metrics.in_flight.inc()
        # The keeper starts before a handling slot is free: a message waiting for a slot
        # (run_once with more messages than ``concurrency``) stays invisible too.
        keeper = asyncio.create_task(self.visibility.keep(flight),
                                     name=f"resilienced.keep/{flight.message.message_id}")
        try:
            try:
                async with self._slots:
                    outcome = await self.handler.handle(flight)
            except asyncio.CancelledError:
                keeper.cancel()
                await self.visibility.release(flight)
                raise
            finally:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            flight.settling = True
            await self.settler.settle(flight, outcome)
            return outcome
        finally:
            self.metrics.in_flight.dec()

    # ----------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Receive and handle until :meth:`stop`; then finish or release what is in flight."""
        backoff = Backoff(1.0, maximum=MAX_BACKOFF)
        try:
            while not self._stopping.is_set():
                free = self.settings.concurrency - len(self._flights)
                if free <= 0:
                    self._slot_freed.clear()
                    await self._until_stopped(self._slot_freed.wait())
                    continue
                try:
                    messages = await self._until_stopped(
                        self._receive(min(self.settings.batch_size, free)))
                except BackendUnavailable:
                    await self._until_stopped(asyncio.sleep(backoff.next()))
                    continue
                backoff.reset()
                if self._stopping.is_set():  # a long poll that answered as stop() came
                    for message in messages or ():  # not started: visible again at once
                        await self.visibility.release(Flight.of(message, replica=self.replica))
                    break
                for message in messages or ():
                    self._start(message)
        finally:
            await self._drain()

    def stop(self) -> None:
        """Stop receiving; :meth:`run` then drains within ``shutdown_timeout`` and returns."""
        if not self._stopping.is_set():
            self.log.info("stopping", in_flight=len(self._flights),
                          shutdown_timeout_s=self.settings.shutdown_timeout)
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    # ----------------------------------------------------------------- internals
    def _start(self, message: Message) -> asyncio.Task[Outcome]:
        flight = Flight.of(message, replica=self.replica)
        task = asyncio.get_running_loop().create_task(
            self._process(flight), name=f"resilienced.message/{message.message_id}")
        self._flights[task] = flight
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Outcome]) -> None:
        self._flights.pop(task, None)
        self._slot_freed.set()
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            self.log.error("message task failed", error=f"{type(error).__name__}: {error}",
                           exc_info=error)

    async def _until_stopped(self, awaitable: Awaitable[T]) -> T | None:
        """Await ``awaitable`` unless stop() comes first (then cancel it and return None)."""
        work = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None

    async def _receive(self, count: int) -> list[Message]:
        try:
            messages = await self.queue.receive(
                max_messages=count, wait_seconds=self.settings.wait_seconds,
                visibility_timeout=self.settings.visibility_timeout)
        except BackendUnavailable as e:
            self.metrics.queue_errors.labels("receive").inc()
            self.readiness.failed(str(e))
            self.log.warning("receive failed", error=str(e))
            raise
        self.readiness.ok()
        if messages:
            self.metrics.last_received.set(time.time())
        return messages

    async def _drain(self) -> None:
        if not self._flights:
            return
        tasks = list(self._flights)
        self.log.info("draining", in_flight=len(tasks), timeout_s=self.settings.shutdown_timeout)
        _, pending = await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout)
        unfinished = [task for task in pending
                      if task in self._flights and not self._flights[task].settling]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if unfinished:
            self.log.warning("released unfinished messages", count=len(unfinished))
