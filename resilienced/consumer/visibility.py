"""Keeping a message invisible while it is handled, and giving it back unfinished.

:meth:`Visibility.keep` extends the message's visibility every third of the visibility timeout
for as long as its handling runs (the consumer starts it before a handling slot is free, so a
message waiting for a slot stays invisible too).  The event claim is renewed beside it by its
own task (``claims.held_claim``), so a claim store that does not answer (ray mode: a stopped GCS
holds a call up to 45 s) never holds up the extensions: the message would become visible, and
another replica would handle the event a second time.

:meth:`Visibility.release` gives an unfinished message back at once (visibility 0): on
SIGTERM, for messages received after stop() and for handling cancelled unfinished.
"""

from __future__ import annotations

import asyncio

from resilienced.consumer.flight import Flight
from resilienced.errors import BackendUnavailable
from resilienced.log import Logger
from resilienced.ops.metrics import Metrics
from resilienced.ports import Queue
from resilienced.settings import QueueSettings


class Visibility:
    """The visibility calls of one consumer's queue."""

    def __init__(self, *, queue: Queue, settings: QueueSettings, metrics: Metrics, logger: Logger) -> None:
        self.queue = queue
        self.settings = settings
        self.metrics = metrics
        self.log = logger

    async def keep(self, flight: Flight) -> None:
        """Every third of the visibility timeout: extend the message's visibility (until cancelled)."""
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

    async def release(self, flight: Flight) -> None:
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
