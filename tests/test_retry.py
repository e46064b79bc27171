"""resilienced.retry: the one backoff the daemon's retries wait by."""

from __future__ import annotations

import asyncio

import pytest

from resilienced import retry
from resilienced.consumer.loop import MAX_BACKOFF
from resilienced.kube.cache import CacheOptions
from resilienced.retry import Backoff

pytestmark = pytest.mark.unit


def test_the_receive_loops_waits_double_from_one_second_up_to_the_cap() -> None:
    backoff = Backoff(1.0, maximum=MAX_BACKOFF)
    assert [backoff.next() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_reset_starts_from_the_first_wait_again() -> None:
    backoff = Backoff(0.5, maximum=30)
    [backoff.next() for _ in range(4)]
    backoff.reset()
    assert backoff.next() == 0.5


def test_the_informers_jitter_stays_within_a_quarter_of_each_wait() -> None:
    options = CacheOptions()
    backoff = Backoff(options.backoff_initial_s, maximum=options.backoff_max_s, jitter=0.25)
    waits = [backoff.next() for _ in range(12)]
    bases = [min(30.0, 0.5 * 2 ** n) for n in range(12)]
    assert all(0.75 * base <= wait <= 1.25 * base for wait, base in zip(waits, bases)), waits
    assert len(set(waits)) > 1


def test_a_backend_down_for_days_still_gets_the_cap() -> None:
    """A failing API server retried every 30 s for 9 hours is past 1,024 doublings: the wait is
    still the cap, not an OverflowError that kills the informer (the old kube/cache.py backoff
    computed ``initial * 2 ** (failures - 1)`` and raised there)."""
    backoff = Backoff(0.5, maximum=30.0, jitter=0.25)
    for _ in range(2000):
        wait = backoff.next()
    assert 22.5 <= wait <= 37.5


@pytest.mark.parametrize("kwargs", [{"initial": -1}, {"initial": 1, "maximum": -1},
                                    {"initial": 1, "jitter": 1.0}, {"initial": 1, "jitter": -0.1}])
def test_a_backoff_that_cannot_be_waited_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**kwargs)


async def collect(count: int, backoff: Backoff | None = None, *, stop_at: int | None = None) -> list[int]:
    seen = []
    async for attempt in retry.attempts(count, backoff=backoff):
        seen.append(attempt)
        if attempt == stop_at:
            break
    return seen


def test_attempts_counts_and_waits_between_them_only() -> None:
    backoff = Backoff(0.0)
    assert asyncio.run(collect(3, backoff)) == [0, 1, 2]
    assert backoff.failures == 2  # two waits: before the second and the third attempt


def test_attempts_without_a_backoff_and_a_caller_that_stops_early() -> None:
    assert asyncio.run(collect(5, stop_at=1)) == [0, 1]


def test_attempts_refuses_zero() -> None:
    with pytest.raises(ValueError, match="count=0"):
        asyncio.run(collect(0))
