"""The SQS consumer: receive -> handle -> ack, one pass (:meth:`Consumer.run_once`) or a loop.

Per message (``Consumer._process``):

1. read the body (``intake.read``: decode, validate, parse, plan) -- never raises -- and judge
   it at ``clock()`` (``intake.judge``): a notice whose deadline passed more than
   ``stale_after_seconds`` ago, or whose time is more than ``future_skew_seconds`` ahead, is not
   actionable (deleted with a ``stale: ...`` reason, counted in ``resilienced_stale_events_total``);
2. not decodable / invalid / not actionable: an outcome at once; actionable: claim the event
   id (idempotency; :func:`resilienced.claims.held_claim`, TTL the visibility timeout, renewed
   every third of it), then hand the plan to the :class:`~resilienced.ports.Responder`,
   while a keeper extends the message's visibility every visibility/3 seconds, for as long as
   the responder runs (the claim's renewal never holds up the extensions);
3. settle: :func:`resilienced.ack.verdict` decides delete / keep / dead-letter; one
   ``decision`` log line and the metrics record it.

Duplicates: EventBridge delivers at least once, so one event id can arrive in two messages.
The first to claim the id acts; a copy that finds the claim done is DUPLICATE (deleted); a copy
that finds it held by another delivery is DUPLICATE too: the holder's own message stays on the
queue until the holder finishes, so if the holder fails, that message comes back and the
event is acted on then -- deleting the copy loses nothing.  The exception is the holder's own
message coming back (its visibility lapsed while the claim is still held): it is kept (RETRY),
never deleted, so a slow or dead holder cannot make its event vanish.

The loop (:meth:`Consumer.run`) receives only when a handling slot is free (``concurrency``),
so received messages never wait unstarted.  :meth:`Consumer.stop` (SIGTERM) stops receiving
(messages a long poll in flight returns after it are released at once, not started), waits up to
``shutdown_timeout`` for in-flight messages, then cancels the rest and releases them
(visibility 0) for another replica; unfinished work is never deleted.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from resilienced import ack, intake, log
from resilienced.claims import HeldClaim, held_claim
from resilienced.errors import BackendUnavailable, PermanentError, TemporaryError, backends_of
from resilienced.http import Readiness
from resilienced.metrics import Metrics
from resilienced.model import Kind, Outcome, Plan, Result, Verdict
from resilienced.ports import ClaimStore, Message, Queue, Responder
from resilienced.settings import IntakeSettings, QueueSettings

#: Longest wait between receives after queue errors, in seconds.
MAX_BACKOFF = 30.0
#: SQS's longest visibility timeout.
MAX_VISIBILITY = 43200

#: Called once per settled message: (message, outcome, verdict, seconds from receive to settled).
Observer = Callable[[Message, Outcome, Verdict, float], None]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def replica_name() -> str:
    """This process's name in claims: the pod name (HOSTNAME) or host, pid, and a nonce."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Flight:
    """One message being handled."""

    message: Message
    holder: str
    received_at: float
    received_unix: float = 0.0  # wall clock, to age the event against its ``time``
    settling: bool = False


class Consumer:
    """Consumes one queue; see the module docstring.  All collaborators are injected."""

    def __init__(self, *, queue: Queue, responder: Responder, claims: ClaimStore,
                 queue_settings: QueueSettings, intake_settings: IntakeSettings,
                 max_receive_count: int | None, metrics: Metrics | None = None,
                 readiness: Readiness | None = None, replica: str | None = None,
                 observer: Observer | None = None, logger: Any | None = None,
                 clock: Callable[[], datetime] | None = utcnow) -> None:
        """``clock`` gives the time events are judged at (stale or from the future); None
        judges each event as of its own time, as ``replay`` does (the demo plays recorded
        samples so)."""
        self.queue = queue
        self.responder = responder
        self.claims = claims
        self.settings = queue_settings
        self.intake = intake_settings
        self.max_receive_count = max_receive_count
        self.metrics = metrics or Metrics()
        self.readiness = readiness or Readiness()
        self.replica = replica or replica_name()
        self.observer = observer
        self.log = logger or log.get("resilienced.consumer")
        self.clock = clock
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

    def _flight(self, message: Message) -> Flight:
        return Flight(message=message, holder=f"{self.replica}/{message.message_id}",
                      received_at=time.monotonic(), received_unix=time.time())

    async def _process(self, flight: Flight) -> Outcome:
        """Handle and settle one message; release it (visibility 0) if cancelled unfinished."""
        self.metrics.in_flight.inc()
        # The keeper starts before a handling slot is free: a message waiting for a slot
        # (run_once with more messages than ``concurrency``) stays invisible too.
        keeper = asyncio.create_task(self._keep_visible(flight),
                                     name=f"resilienced.keep/{flight.message.message_id}")
        try:
            try:
                async with self._slots:
                    outcome = await self._handle(flight)
            except asyncio.CancelledError:
                keeper.cancel()
                await self._release(flight)
                raise
            finally:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            flight.settling = True
            await self._settle(flight, outcome)
            return outcome
        finally:
            self.metrics.in_flight.dec()

    # ----------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Receive and handle until :meth:`stop`; then finish or release what is in flight."""
        backoff = 0.0
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
                    backoff = min(MAX_BACKOFF, max(1.0, backoff * 2))
                    await self._until_stopped(asyncio.sleep(backoff))
                    continue
                backoff = 0.0
                if self._stopping.is_set():  # a long poll that answered as stop() came
                    await self._give_back(messages or [])
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
        flight = self._flight(message)
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

    async def _until_stopped(self, awaitable: Any) -> Any:
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

    async def _handle(self, flight: Flight) -> Outcome:
        try:
            reading = intake.read(flight.message.body, self.intake)
        except Exception as e:  # a bug in parsing: never crash the loop; redrive bounds retries
            self.log.error("intake failed", message_id=flight.message.message_id,
                           error=f"{type(e).__name__}: {e}", exc_info=e)
            self.metrics.received.labels(Kind.INVALID.value).inc()
            return Outcome(result=Result.RETRY, event=None,
                           reason=f"internal error reading the message: {type(e).__name__}: {e}")
        reading = intake.judge(reading, self.intake, at=self.clock() if self.clock else None)
        event, plan = reading.event, reading.plan
        self.metrics.received.labels(event.kind.value).inc()
        if event.time is not None and reading.decoded and event.kind is not Kind.INVALID:
            self.metrics.event_age.observe(max(0.0, flight.received_unix - event.time.timestamp()))
        if not reading.decoded:
            return Outcome(result=Result.UNDECODABLE, event=event, plan=plan, reason=event.reason)
        if event.kind is Kind.INVALID:
            return Outcome(result=Result.INVALID, event=event, plan=plan, reason=event.reason)
        if reading.stale:
            self.metrics.stale.labels(event.kind.value, reading.stale).inc()
            return Outcome(result=Result.NOT_ACTIONABLE, event=event, plan=plan, reason=plan.reason,
                           details={"stale": reading.stale})
        if not plan.actionable:
            return Outcome(result=Result.NOT_ACTIONABLE, event=event, plan=plan, reason=plan.reason)
        return await self._act(flight, plan)

    async def _act(self, flight: Flight, plan: Plan) -> Outcome:
        """Under the event claim (held while the responder works), or an outcome saying who has it."""
        event, message = plan.event, flight.message
        key = f"event/{event.event_id}" if event.event_id else f"message/{message.message_id}"
        try:  # a TemporaryError here is the claim store's, on the acquire or the look at who has it
            async with held_claim(self.claims, key, holder=flight.holder, logger=self.log,
                                  ttl_seconds=float(self.settings.visibility_timeout)) as held:
                if held is None:
                    existing = await self.claims.get(key)
                    return self._not_claimed(event_id=event.event_id, plan=plan, message=message,
                                             existing=existing)
                outcome = await self._respond(plan, flight)
                return await self._settle_claim(held, outcome)
        except TemporaryError as e:
            for backend in backends_of(e):
                self.metrics.backend_errors.labels(backend=backend).inc()
            return Outcome(result=Result.RETRY, event=event, plan=plan,
                           reason=f"claim store: {e}", retry_delay=self._retry_delay(e, message))

    async def _respond(self, plan: Plan, flight: Flight) -> Outcome:
        """The responder's outcome; what it raises becomes one (it never raises itself)."""
        event, message = plan.event, flight.message
        try:
            return await self.responder.act(plan, holder=flight.holder)
        except TemporaryError as e:
            for backend in backends_of(e):
                self.metrics.backend_errors.labels(backend=backend).inc()
            return Outcome(result=Result.RETRY, event=event, plan=plan, reason=str(e),
                           retry_delay=self._retry_delay(e, message))
        except PermanentError as e:
            return Outcome(result=Result.FAILED, event=event, plan=plan, reason=str(e))
        except Exception as e:
            self.log.error("responder raised", event_id=event.event_id,
                           error=f"{type(e).__name__}: {e}", exc_info=e)
            return Outcome(result=Result.RETRY, event=event, plan=plan,
                           reason=f"responder raised {type(e).__name__}: {e}")

    async def _settle_claim(self, held: HeldClaim, outcome: Outcome) -> Outcome:
        """Complete the event claim (release it for a retry), unless it was lost meanwhile."""
        await held.stop_renewing()  # a renewal in flight lands first; none starts after
        if held.lost is not None:
            return self._lost(held, outcome)
        try:
            if outcome.result is Result.RETRY:
                await held.release()
            else:
                await held.complete({"result": outcome.result.value})
        except TemporaryError as e:
            self.log.warning("claim update failed", key=held.key, error=str(e))
        return outcome

    def _retry_delay(self, error: TemporaryError, message: Message) -> float | None:
        """When to receive a message again after ``error``: a backend's failure backs off with
        the receive count (:func:`ack.backend_retry_delay`); anything else (a run held by another
        replica: retry when its claim would lapse) after the delay it gives."""
        if not backends_of(error):
            return error.delay
        return ack.backend_retry_delay(suggested=error.delay,
                                       visibility_timeout=float(self.settings.visibility_timeout),
                                       receive_count=message.receive_count)

    def _lost(self, held: HeldClaim, outcome: Outcome) -> Outcome:
        """The event claim was lost while this replica handled the event (taken over: it could
        not renew it within its TTL, a stalled claim store, a starved process; or no renewal
        succeeded for a whole TTL): the holder decides the event, so this replica's outcome is
        not final. It neither completes nor releases the claim, and keeps the message (RETRY
        after the TTL): if the holder dies unfinished, the next delivery takes the event again.
        Every step of the work is idempotent, and the recovery's run claims fence its steps the
        same way."""
        key = held.key
        self.log.warning("event claim lost while handling it", key=key, why=held.lost,
                         result=outcome.result.value)
        return Outcome(result=Result.RETRY, event=outcome.event, plan=outcome.plan,
                       retry_delay=float(self.settings.visibility_timeout),
                       reason=f"event claim {key} lost while handling it ({held.lost}); its "
                              f"holder decides (this delivery's outcome was {outcome.result.value}: "
                              f"{outcome.reason})")

    def _not_claimed(self, *, event_id: str | None, plan: Plan, message: Message,
                     existing: Any) -> Outcome:
        event = plan.event
        if existing is None:  # it was freed between acquire and get: try again soon
            return Outcome(result=Result.RETRY, event=event, plan=plan, retry_delay=0,
                           reason="claim changed hands while checking it")
        if existing.state == "done":
            return Outcome(result=Result.DUPLICATE, event=event, plan=plan,
                           reason=f"event {event_id} already handled by {existing.holder}")
        if existing.holder.endswith("/" + message.message_id):
            return Outcome(result=Result.RETRY, event=event, plan=plan,
                           retry_delay=float(self.settings.visibility_timeout),
                           reason=f"an earlier delivery of this message ({existing.holder}) still "
                                  "holds the event")
        return Outcome(result=Result.DUPLICATE, event=event, plan=plan,
                       reason=f"event {event_id} is being handled by {existing.holder}; its "
                              "message stays on the queue until that finishes")

    async def _keep_visible(self, flight: Flight) -> None:
        """Every third of the visibility timeout: extend the message's visibility.

        The event claim is renewed beside it by its own task (``claims.held_claim``), so a claim
        store that does not answer (ray mode: a stopped GCS holds a call up to 45 s) never holds
        up the extensions: the message would become visible, and another replica would handle
        the event a second time.
        """
        interval = self.settings.visibility_timeout / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self.queue.change_visibility(flight.message,
                                                   seconds=self.settings.visibility_timeout)
                self.metrics.visibility_extensions.inc()
            except BackendUnavailable as e:
                self.metrics.queue_errors.labels("change_visibility").inc()
                self.log.warning("visibility extension failed",
                                 message_id=flight.message.message_id, error=str(e))

    async def _give_back(self, messages: list[Message]) -> None:
        """Messages received after stop() was called: not started, visible again at once."""
        for message in messages:
            await self._release(self._flight(message))

    async def _release(self, flight: Flight) -> None:
        """Give an unfinished message back to the queue at once (its event claim, if it held
        one, was released as its handling was cancelled: ``claims.held_claim``)."""
        try:
            await self.queue.change_visibility(flight.message, seconds=0)
        except BackendUnavailable as e:
            self.metrics.queue_errors.labels("change_visibility").inc()
            self.log.warning("release failed; the message returns after its visibility timeout",
                             message_id=flight.message.message_id, error=str(e))
        self.metrics.released.inc()
        self.log.info("released", message_id=flight.message.message_id,
                      receive_count=flight.message.receive_count)

    async def _settle(self, flight: Flight, outcome: Outcome) -> Verdict:
        message = flight.message
        verdict = ack.verdict(outcome)
        action = None
        try:
            if verdict is Verdict.DELETE:
                await self.queue.delete(message)
            elif verdict is Verdict.KEEP:
                if outcome.retry_delay is not None:
                    seconds = min(MAX_VISIBILITY, max(0, math.ceil(outcome.retry_delay)))
                    await self.queue.change_visibility(message, seconds=seconds)
                    action = f"visible again in {seconds}s"
            else:
                dead = ack.dead_letter_action(
                    receive_count=message.receive_count, max_receive_count=self.max_receive_count,
                    max_receives_without_dlq=self.settings.max_receives_without_dlq)
                if dead is ack.DeadLetterAction.DELETE:
                    await self.queue.delete(message)
                    self.metrics.dead_lettered.inc()
                    action = "deleted: no DLQ"
                    self.log.error("poison message deleted (the queue has no DLQ)",
                                   message_id=message.message_id, receive_count=message.receive_count,
                                   body=message.body[:512], reason=outcome.reason)
                else:
                    await self.queue.change_visibility(message, seconds=0)
                    if dead is ack.DeadLetterAction.RELEASE_LAST:
                        self.metrics.dead_lettered.inc()
                        action = f"to the DLQ (receive {message.receive_count} of {self.max_receive_count})"
                    else:
                        action = f"released for the redrive policy (receive {message.receive_count})"
        except BackendUnavailable as e:
            self.metrics.queue_errors.labels(verdict.value).inc()
            action = f"ack failed: {e}"
        latency = time.monotonic() - flight.received_at
        kind = outcome.event.kind.value if outcome.event else Kind.INVALID.value
        self.metrics.decided.labels(kind, outcome.result.value).inc()
        self.metrics.handling.observe(latency)
        log.decision(self.log, outcome=outcome, verdict=verdict, message_id=message.message_id,
                     receive_count=message.receive_count, latency_s=latency, action=action)
        if self.observer is not None:
            self.observer(message, outcome, verdict, latency)
        return verdict
