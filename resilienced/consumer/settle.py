"""Settling a handled message: the ack policy's verdict carried out on the queue, and recorded.

:func:`resilienced.intake.ack_policy.verdict` decides delete / keep / dead-letter; :meth:`Settle.settle`
carries it out (a KEEP with a retry delay sets the message's visibility to it; a DEAD_LETTER
releases it for the redrive policy, or deletes it where the queue has no DLQ), then one
``decision`` log line and the metrics record it, and the observer hears of it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from resilienced import log
from resilienced.intake import ack_policy
from resilienced.consumer.flight import Flight
from resilienced.errors import BackendUnavailable
from resilienced.log import Logger
from resilienced.ops.metrics import Metrics
from resilienced.model import Kind, Outcome, Verdict
from resilienced.ports import Message, Queue
from resilienced.settings import QueueSettings

#: SQS's longest visibility timeout.
MAX_VISIBILITY = 43200

#: Called once per settled message: (message, outcome, verdict, seconds from receive to settled).
Observer = Callable[[Message, Outcome, Verdict, float], None]


class Settle:
    """Acknowledges handled messages on one queue; see the module docstring."""

    def __init__(self, *, queue: Queue, settings: QueueSettings, max_receive_count: int | None,
                 metrics: Metrics, logger: Logger, observer: Observer | None) -> None:
        self.queue = queue
        self.settings = settings
        self.max_receive_count = max_receive_count
        self.metrics = metrics
        self.log = logger
        self.observer = observer

    async def settle(self, flight: Flight, outcome: Outcome) -> Verdict:
        message = flight.message
        verdict = ack_policy.verdict(outcome)
        try:
            action = await self._carry_out(verdict, message, outcome)
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

    async def _carry_out(self, verdict: Verdict, message: Message, outcome: Outcome) -> str | None:
        """The queue calls of ``verdict``; what was done, in words (None: nothing to say)."""
        if verdict is Verdict.DELETE:
            await self.queue.delete(message)
            return None
        if verdict is Verdict.KEEP:
            if outcome.retry_delay is None:
                return None
            seconds = min(MAX_VISIBILITY, max(0, math.ceil(outcome.retry_delay)))
            await self.queue.change_visibility(message, seconds=seconds)
            return f"visible again in {seconds}s"
        return await self._dead_letter(message, outcome)

    async def _dead_letter(self, message: Message, outcome: Outcome) -> str:
        dead = ack_policy.dead_letter_action(
            receive_count=message.receive_count, max_receive_count=self.max_receive_count,
            max_receives_without_dlq=self.settings.max_receives_without_dlq)
        if dead is ack_policy.DeadLetterAction.DELETE:
            await self.queue.delete(message)
            self.metrics.dead_lettered.inc()
            self.log.error("poison message deleted (the queue has no DLQ)",
                           message_id=message.message_id, receive_count=message.receive_count,
                           body=message.body[:512], reason=outcome.reason)
            return "deleted: no DLQ"
        await self.queue.change_visibility(message, seconds=0)
        if dead is ack_policy.DeadLetterAction.RELEASE_LAST:
            self.metrics.dead_lettered.inc()
            return f"to the DLQ (receive {message.receive_count} of {self.max_receive_count})"
        return f"released for the redrive policy (receive {message.receive_count})"
