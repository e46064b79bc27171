"""Acting on a plan under the event claim: idempotency across deliveries and replicas.

The event id is claimed (:func:`resilienced.claims.held_claim`, TTL the visibility timeout,
renewed every third of it) while the :class:`~resilienced.ports.Responder` works; then the
claim is completed (released for a retry), unless it was lost meanwhile.

Duplicates: EventBridge delivers at least once, so one event id can arrive in two messages.
The first to claim the id acts; a copy that finds the claim done is DUPLICATE (deleted); a copy
that finds it held by another delivery is DUPLICATE too: the holder's own message stays on the
queue until the holder finishes, so if the holder fails, that message comes back and the
event is acted on then -- deleting the copy loses nothing.  The exception is the holder's own
message coming back (its visibility lapsed while the claim is still held): it is kept (RETRY),
never deleted, so a slow or dead holder cannot make its event vanish.

No event claim: a responder that says so for a plan (:class:`~resilienced.ports.SharesClaims`,
``needs_event_claim`` False: ``Recovery`` for a notice whose runs this replica handles now, which
joins their handling) is asked at once.  Its steps run under the claims of the run's handling (or
are a cordon, which is idempotent), so a duplicate still acts once; the message is still settled
only after the responder's outcome (issue #45: a gang's notices handled as one write one event
claim, not one per notice).  A responder that needs the claim for a plan is told when this
delivery's handling is over, acted on or not (``settled``: ``Recovery`` lets go of the run's
handling it reserved for the plan, which the run's other notices joined meanwhile).
"""

from __future__ import annotations

from resilienced.intake import ack_policy
from resilienced.claims import HeldClaim, held_claim, not_free
from resilienced.consumer.flight import Flight
from resilienced.errors import PermanentError, TemporaryError, backends_of
from resilienced.log import Logger
from resilienced.ops.metrics import Metrics
from resilienced.model import Outcome, Plan, Result
from resilienced.ports import ClaimStore, Message, Responder, SharesClaims
from resilienced.settings import QueueSettings


class EventClaim:
    """Runs the responder under the event claim; see the module docstring."""

    def __init__(self, *, claims: ClaimStore, responder: Responder, settings: QueueSettings,
                 metrics: Metrics, logger: Logger) -> None:
        self.claims = claims
        self.responder = responder
        self.settings = settings
        self.metrics = metrics
        self.log = logger

    async def act(self, flight: Flight, plan: Plan) -> Outcome:
        """Under the event claim (held while the responder works), or an outcome saying who has it."""
        event, message = plan.event, flight.message
        key = f"event/{event.event_id}" if event.event_id else f"message/{message.message_id}"
        if isinstance(self.responder, SharesClaims) and not await self.responder.needs_event_claim(plan):
            return await self._respond(plan, flight)
        try:
            return await self._claimed(plan, flight, key)
        finally:
            if isinstance(self.responder, SharesClaims):  # acted on or not: what it set aside is let go
                self.responder.settled(plan)

    async def _claimed(self, plan: Plan, flight: Flight, key: str) -> Outcome:
        event, message = plan.event, flight.message
        try:  # a TemporaryError here is the claim store's, on the acquire or the look at who has it
            async with held_claim(self.claims, key, holder=flight.holder, logger=self.log,
                                  ttl_seconds=float(self.settings.visibility_timeout)) as held:
                if held is None:
                    existing = await self.claims.get(key)
                    return not_free(plan, existing, holder=flight.holder, what="the event",
                                    held_delay=float(self.settings.visibility_timeout))
                outcome = await self._respond(plan, flight)
                return await self._settle_claim(held, outcome)
        except TemporaryError as e:
            self._count_backends(e)
            return Outcome(result=Result.RETRY, event=event, plan=plan,
                           reason=f"claim store: {e}", retry_delay=self._retry_delay(e, message))

    async def _respond(self, plan: Plan, flight: Flight) -> Outcome:
        """The responder's outcome; what it raises becomes one (it never raises itself)."""
        event, message = plan.event, flight.message
        try:
            return await self.responder.act(plan, holder=flight.holder)
        except TemporaryError as e:
            self._count_backends(e)
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

    def _retry_delay(self, error: TemporaryError, message: Message) -> float | None:
        """When to receive a message again after ``error``: a backend's failure backs off with
        the receive count (:func:`ack_policy.backend_retry_delay`); anything else (a run held by another
        replica: retry when its claim would lapse) after the delay it gives."""
        if not backends_of(error):
            return error.delay
        return ack_policy.backend_retry_delay(suggested=error.delay,
                                       visibility_timeout=float(self.settings.visibility_timeout),
                                       receive_count=message.receive_count)

    def _count_backends(self, error: TemporaryError) -> None:
        for backend in backends_of(error):
            self.metrics.backend_errors.labels(backend=backend).inc()
