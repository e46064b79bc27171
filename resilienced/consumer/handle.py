"""Handling one message: read it, judge it, and act on its plan under the event claim.

1. read the body (``intake.read``: decode, validate, parse, plan) -- never raises -- and judge
   it at ``clock()`` (``intake.judge``): a notice whose deadline passed more than
   ``stale_after_seconds`` ago, or whose time is more than ``future_skew_seconds`` ahead, is not
   actionable (deleted with a ``stale: ...`` reason, counted in ``resilienced_stale_events_total``);
2. not decodable / invalid / not actionable: an outcome at once; actionable: the plan goes to
   :class:`~resilienced.consumer.event_claim.EventClaim`, which acts on it under the event claim.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from resilienced.intake import pipeline as intake
from resilienced.consumer.event_claim import EventClaim
from resilienced.consumer.flight import Flight
from resilienced.log import Logger
from resilienced.ops.metrics import Metrics
from resilienced.model import Kind, Outcome, Result
from resilienced.settings import IntakeSettings


class Handler:
    """Turns one message into its :class:`~resilienced.model.Outcome` (never raises)."""

    def __init__(self, *, settings: IntakeSettings, event_claim: EventClaim, metrics: Metrics,
                 logger: Logger, clock: Callable[[], datetime] | None) -> None:
        self.settings = settings
        self.event_claim = event_claim
        self.metrics = metrics
        self.log = logger
        self.clock = clock

    async def handle(self, flight: Flight) -> Outcome:
        try:
            reading = intake.read(flight.message.body, self.settings)
        except Exception as e:  # a bug in parsing: never crash the loop; redrive bounds retries
            self.log.error("intake failed", message_id=flight.message.message_id,
                           error=f"{type(e).__name__}: {e}", exc_info=e)
            self.metrics.received.labels(Kind.INVALID.value).inc()
            return Outcome(result=Result.RETRY, event=None,
                           reason=f"internal error reading the message: {type(e).__name__}: {e}")
        reading = intake.judge(reading, self.settings, at=self.clock() if self.clock else None)
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
        return await self.event_claim.act(flight, plan)
