"""Prometheus metrics, on a registry of their own (served at ``/metrics``).

=========================================  =========  =============================================
name                                       type       what
=========================================  =========  =============================================
resilienced_events_received_total{kind}    counter    messages received, by the kind they parsed to
resilienced_events_decided_total{kind,     counter    messages decided, by kind and outcome
  outcome}                                            (done, duplicate, not_actionable, invalid, ...)
resilienced_handling_seconds               histogram  receive to settled (deleted/kept/released)
resilienced_in_flight                      gauge      messages being handled now
resilienced_dead_lettered_total            counter    poison messages on their last receive before
                                                      the redrive policy moves them to the DLQ
                                                      (or deleted, without a DLQ)
resilienced_visibility_extensions_total    counter    visibility extensions of slow messages
resilienced_released_total                 counter    messages released unfinished (shutdown)
resilienced_queue_errors_total{operation}  counter    failed queue calls (receive, delete, ...)
resilienced_stale_events_total{kind,when}  counter    notices not acted on because stale
                                                      (when=past: deadline long gone) or from the
                                                      future (when=future); acknowledged
=========================================  =========  =============================================

Other parts add their metrics as attributes of :class:`Metrics` (or on ``Metrics.registry``),
each with the ``resilienced_`` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Buckets from a fast no-op (ms) to a checkpoint and an export (minutes).
HANDLING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300, 600)


class Metrics:
    """The daemon's metrics; one instance per daemon (tests make their own)."""

    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.received = Counter("resilienced_events_received", "Messages received, by kind.",
                                ["kind"], registry=r)
        self.decided = Counter("resilienced_events_decided", "Messages decided, by kind and outcome.",
                               ["kind", "outcome"], registry=r)
        self.handling = Histogram("resilienced_handling_seconds",
                                  "Seconds from receive to the message being settled.",
                                  buckets=HANDLING_BUCKETS, registry=r)
        self.in_flight = Gauge("resilienced_in_flight", "Messages being handled now.", registry=r)
        self.dead_lettered = Counter("resilienced_dead_lettered",
                                     "Poison messages on their last receive before the DLQ.",
                                     registry=r)
        self.visibility_extensions = Counter("resilienced_visibility_extensions",
                                             "Visibility extensions of messages still in handling.",
                                             registry=r)
        self.released = Counter("resilienced_released",
                                "Messages released unfinished (visibility 0) at shutdown.",
                                registry=r)
        self.stale = Counter("resilienced_stale_events",
                             "Notices acknowledged without acting: too old (past) or from the future.",
                             ["kind", "when"], registry=r)
        self.queue_errors = Counter("resilienced_queue_errors", "Failed queue calls.",
                                    ["operation"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """The current value of a sample (for tests and the demo); 0 when absent."""
        found = self.registry.get_sample_value(name, labels or None)
        return found or 0.0
