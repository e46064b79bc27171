"""The ledger's metrics (``resilienced.ops.ledger``), on the daemon's registry.

Cardinality (docs/operations.md, "Metrics"): ``part`` is one of the four parts
(:data:`resilienced.ops.ledger.PARTS`), ``capacity`` one of ``capacity-block`` and ``on-demand``
(Spot has no premium over itself), ``step`` one of ``compute`` and ``write``; ``run`` (the
goodput gauge) is one series per run that has a follow-up record with a ledger: the records are
one per run and deleted ``--follow-up-keep`` (24 h) after their end, and the series goes with
the record (:meth:`LedgerMetrics.keep_only`), so the set is bounded by the runs recovered in a
day.  Every replica reads every record: take ``min``/``max`` over replicas, never ``sum``.
The counters are counted once per ledger, by the replica that writes it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from resilienced.ops.ledger import PARTS, Ledger, premium_by_capacity

PREMIUM_CAPACITIES = ("capacity-block", "on-demand")
#: ``write`` stays a series (dashboards keep it) but is 0 since issue #45: the ledger is saved in the
#: follow-up's write of its end, which the follow-up retries as any write of its record.
FAILURE_STEPS = ("compute", "write")


class LedgerMetrics:
    """``resilienced_lost_gpu_seconds_total{part}``, ``resilienced_capacity_premium_usd_total{capacity}``,
    ``resilienced_run_goodput_ratio{run}``, ``resilienced_goodput_floor_ratio`` and
    ``resilienced_ledger_failures_total{step}``."""

    def __init__(self, registry: CollectorRegistry, *, goodput_floor: float = 0.8) -> None:
        self.lost = Counter(
            "resilienced_lost_gpu_seconds", "GPU-seconds interruptions cost the runs, by part (steps_repeated, "
            "save_pause, idle, capacity_wait): each recovery's ledger, counted once when it is written.",
            ["part"], registry=registry)
        self.premium = Counter(
            "resilienced_capacity_premium_usd", "USD the moves off Spot cost over Spot's price, by the capacity "
            "moved to (capacity-block, on-demand); only spans whose prices are known.",
            ["capacity"], registry=registry)
        self.goodput = Gauge(
            "resilienced_run_goodput_ratio", "A run's goodput so far: productive GPU-seconds / GPU-seconds held "
            "(productive + lost), from its newest ledger; one series per run with a follow-up record.",
            ["run"], registry=registry)
        self.floor = Gauge(
            "resilienced_goodput_floor_ratio", "The goodput below which a run is alerted on (--goodput-floor).",
            registry=registry)
        self.failures = Counter(
            "resilienced_ledger_failures", "Ledgers that could not be computed or written (logged; never retried "
            "in a notice's path; the recovery goes on), by step (compute, write).",
            ["step"], registry=registry)
        self.floor.set(goodput_floor)
        for part in PARTS:
            self.lost.labels(part=part)
        for capacity in PREMIUM_CAPACITIES:
            self.premium.labels(capacity=capacity)
        for step in FAILURE_STEPS:
            self.failures.labels(step=step)

    def count(self, ledger: Ledger) -> None:
        """Count a ledger just written: its parts, its premium per capacity, the run's goodput."""
        for part in ledger.lost:
            if part.gpu_seconds:
                self.lost.labels(part=part.part).inc(part.gpu_seconds)
        for capacity, usd in premium_by_capacity(ledger.capacity, ledger.price("spot")).items():
            if capacity in PREMIUM_CAPACITIES and usd > 0:
                self.premium.labels(capacity=capacity).inc(usd)
        self.show(ledger)

    def show(self, ledger: Ledger) -> None:
        """Set the run's goodput gauge (every replica, for every record it reads)."""
        if ledger.goodput.value is not None:
            self.goodput.labels(run=ledger.run).set(ledger.goodput.value)

    def keep_only(self, runs: Iterable[str]) -> None:
        """Drop the goodput series of runs without a record any more (the label set stays bounded)."""
        keep = set(runs)
        for (run,) in [labels for labels in list(self.goodput._metrics) if labels[0] not in keep]:  # noqa: SLF001
            self.goodput.remove(run)
