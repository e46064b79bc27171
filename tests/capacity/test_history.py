"""Interruption history (sliding window per pool), the ICE cache, and the request built from a target."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from resilienced.capacity.decision import Pool
from resilienced.capacity.history import InterruptionHistory, UnavailableCache
from resilienced.capacity.request import CapacityRequest
from resilienced.model import Capacity
from resilienced.model import Event, Kind, RunFacts, Target

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
M = timedelta(minutes=1)
A = Pool("p5.48xlarge", "us-east-1a")
B = Pool("p5.48xlarge", "us-east-1b")


def test_history_counts_per_pool_within_the_window() -> None:
    history = InterruptionHistory(keep=timedelta(hours=2))
    history.record(A, NOW - 90 * M, event_id="e1")
    history.record(A, NOW - 10 * M, event_id="e2")
    history.record(B, NOW - 5 * M, event_id="e3")
    assert history.recent(A, now=NOW, window=timedelta(hours=1)) == (NOW - 10 * M,)
    assert history.recent(A, now=NOW) == (NOW - 90 * M, NOW - 10 * M)
    assert history.recent(B, now=NOW, window=timedelta(hours=1)) == (NOW - 5 * M,)


def test_history_counts_a_redelivered_event_once() -> None:
    history = InterruptionHistory()
    assert history.record(A, NOW, event_id="same") is True
    assert history.record(A, NOW, event_id="same") is False
    assert history.record(A, NOW, event_id=None) is True  # no id: cannot tell, counted
    assert len(history.recent(A, now=NOW)) == 2


def test_history_forgets_what_is_older_than_keep() -> None:
    history = InterruptionHistory(keep=timedelta(hours=1))
    history.record(A, NOW - 2 * timedelta(hours=1), event_id="old")
    history.record(A, NOW, event_id="new")
    assert history.recent(A, now=NOW, window=timedelta(days=1)) == (NOW,)
    # The forgotten id may be counted again (it is outside every window anyway).
    assert history.record(A, NOW - 2 * timedelta(hours=1), event_id="old") is True


def test_history_is_bounded_per_pool() -> None:
    history = InterruptionHistory(max_per_pool=3)
    for i in range(5):
        history.record(A, NOW - i * M, event_id=f"e{i}")
    assert len(history.recent(A, now=NOW)) == 3


def test_history_rejects_naive_times() -> None:
    with pytest.raises(ValueError, match="at must be a timezone-aware"):
        InterruptionHistory().record(A, datetime(2026, 1, 1))


def test_ice_cache_expires_and_matches_pool() -> None:
    cache = UnavailableCache(ttl=timedelta(minutes=3))
    cache.mark(A, "spot", now=NOW)
    cache.mark(Pool("p5.48xlarge"), "cr-any-az", now=NOW)  # AZ-less entry: every AZ
    assert cache.unavailable(A, now=NOW + M) == {"spot", "cr-any-az"}
    assert cache.unavailable(B, now=NOW + M) == {"cr-any-az"}
    assert cache.unavailable(Pool("p4d.24xlarge", "us-east-1a"), now=NOW) == frozenset()
    assert cache.unavailable(A, now=NOW + 3 * M) == frozenset()


def _target(**facts) -> Target:
    return Target(instance_id="i-0abc", node="n1", ray_cluster="ml/rc", ray_job="ml/job",
                  ray_node_ids=(), checkpoint_uri=None, facts=RunFacts(**facts))


def test_request_from_target_reads_the_documented_facts() -> None:
    event = Event(kind=Kind.CAPACITY_BLOCK_EXPIRY, event_id="ev-1", capacity_reservation_id="cr-old")
    request = CapacityRequest.from_target(
        _target(instance_type="p5.48xlarge", availability_zone="us-east-1a", capacity_type="reserved",
                reservation_id="cr-old", moved_at="2026-08-20T10:00:00Z", instance_count=4,
                run_needs_seconds=7200),
        event=event)
    assert request.pool == A
    assert request.current_capacity is Capacity.CAPACITY_BLOCK  # Karpenter's "reserved"
    assert request.current_reservation_id == "cr-old"
    assert request.last_move == datetime(2026, 8, 20, 10, tzinfo=timezone.utc)
    assert request.instance_count == 4
    assert request.run_needs == timedelta(hours=2)
    assert request.exclude == {"cr-old"}  # leave the expiring block
    assert request.purchase_key == "ev-1/ml/job"


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({}, r"facts\.instance_type is missing"),
        ({"instance_type": "p5.48xlarge", "capacity_type": "preemptible"}, r"facts\.capacity_type=.* is not a capacity type"),
        ({"instance_type": "p5.48xlarge", "moved_at": "yesterday"}, r"facts\.moved_at=.* is not an ISO-8601 time"),
        ({"instance_type": "p5.48xlarge", "instance_count": "many"}, r"facts\.instance_count=.* is not a whole number"),
    ],
    ids=["no instance type", "bad capacity type", "bad moved-at", "bad count"],
)
def test_request_from_target_names_the_bad_fact(attrs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CapacityRequest.from_target(_target(**attrs), event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="e"))
