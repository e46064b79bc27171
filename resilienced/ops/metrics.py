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
resilienced_build_info{version,            gauge      1; the daemon's and Ray's versions
  ray_version}
resilienced_ready                          gauge      1 while /readyz says ready, else 0
resilienced_event_age_at_receive_seconds   histogram  event ``time`` to its receive (the 120 s
                                                      notice budget starts at the event's time)
resilienced_last_message_received_         gauge      unix time a message was last received
  timestamp_seconds
resilienced_queue_messages{state}          gauge      the queue's approximate depth (visible,
                                                      in_flight, delayed), read at most once a
                                                      minute
resilienced_backend_errors_total{backend}  counter    temporary failures of a backend (kubernetes,
                                                      ray-gcs, s3, ec2, fsx, autoscaling, ...)
process_*                                  various    CPU, memory, file descriptors, start time
resilienced_stale_events_total{kind,when}  counter    notices not acted on because stale
                                                      (when=past: deadline long gone) or from the
                                                      future (when=future); acknowledged
=========================================  =========  =============================================

Other parts add their metrics as attributes of :class:`Metrics` (or on ``Metrics.registry``),
each with the ``resilienced_`` prefix.  docs/operations.md lists every one (a test checks).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from resilienced import __version__

#: Buckets from a fast no-op (ms) to a checkpoint and an export (minutes).
HANDLING_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300, 600)
#: Event age at receive: EventBridge delivers in well under a second; past 120 s a notice is moot.
EVENT_AGE_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 300, 900, 3600)
#: The queue depth states read from GetQueueAttributes.
QUEUE_STATES = {"visible": "ApproximateNumberOfMessages",
                "in_flight": "ApproximateNumberOfMessagesNotVisible",
                "delayed": "ApproximateNumberOfMessagesDelayed"}


def ray_version() -> str:
    """The installed Ray's version (without importing Ray), or ``none``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "none"


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
        self._daemon_metrics(r)

    def _daemon_metrics(self, r: CollectorRegistry) -> None:
        """What the alerts and the dashboard need besides the message counters."""
        Gauge("resilienced_build_info", "Always 1; the labels say the versions running.",
              ["version", "ray_version"], registry=r).labels(__version__, ray_version()).set(1)
        ProcessCollector(registry=r)
        self.ready = Gauge("resilienced_ready", "1 while the daemon is ready (/readyz 200), else 0.",
                           registry=r)
        self.event_age = Histogram("resilienced_event_age_at_receive_seconds",
                                   "Seconds from the event's time to its receive by the daemon.",
                                   buckets=EVENT_AGE_BUCKETS, registry=r)
        self.last_received = Gauge("resilienced_last_message_received_timestamp_seconds",
                                   "Unix time a message was last received from the queue.",
                                   registry=r)
        self.queue_messages = Gauge("resilienced_queue_messages",
                                    "The queue's approximate number of messages, by state "
                                    "(visible, in_flight, delayed).", ["state"], registry=r)
        self.backend_errors = Counter("resilienced_backend_errors",
                                      "Temporary failures of a backend, by backend.", ["backend"],
                                      registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """The current value of a sample (for tests and the demo); 0 when absent."""
        found = self.registry.get_sample_value(name, labels or None)
        return found or 0.0
