"""MemoryClaims: who may act on an event id, with TTLs on a controlled clock."""

from __future__ import annotations

from resilienced.doubles import MemoryClaims
from resilienced.ports import ClaimStore
import pytest

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(done_ttl: float = 100.0) -> tuple[MemoryClaims, Clock]:
    clock = Clock()
    return MemoryClaims(done_ttl_seconds=done_ttl, clock=clock), clock


def test_it_is_a_claim_store():
    assert isinstance(MemoryClaims(), ClaimStore)


async def test_a_free_key_is_taken_and_a_live_other_holder_is_refused():
    claims, _ = store()
    first = await claims.acquire("event/1", holder="a", ttl_seconds=10)
    assert first is not None and first.holder == "a" and first.state == "held"
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is None
    assert (await claims.get("event/1")).holder == "a"


async def test_the_same_holder_renews_its_claim():
    claims, clock = store()
    await claims.acquire("event/1", holder="a", ttl_seconds=10)
    clock.now += 8
    assert await claims.acquire("event/1", holder="a", ttl_seconds=10) is not None
    clock.now += 8  # 16 s after the first acquire, 8 after the renewal: still held
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is None


async def test_a_dead_holders_claim_expires_and_can_be_taken():
    claims, clock = store()
    await claims.acquire("event/1", holder="a", ttl_seconds=10)
    clock.now += 10
    taken = await claims.acquire("event/1", holder="b", ttl_seconds=10)
    assert taken is not None and taken.holder == "b"


async def test_done_is_remembered_for_the_dedupe_window_then_forgotten():
    claims, clock = store(done_ttl=100)
    await claims.acquire("event/1", holder="a", ttl_seconds=10)
    await claims.complete("event/1", holder="a", details={"result": "done"})
    assert await claims.acquire("event/1", holder="a", ttl_seconds=10) is None
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is None
    done = await claims.get("event/1")
    assert done.state == "done" and done.details == {"result": "done"}
    clock.now += 100
    assert await claims.get("event/1") is None
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is not None


async def test_release_frees_the_key_for_others_but_only_by_the_holder():
    claims, _ = store()
    await claims.acquire("event/1", holder="a", ttl_seconds=10)
    await claims.release("event/1", holder="b")
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is None
    await claims.release("event/1", holder="a")
    assert await claims.acquire("event/1", holder="b", ttl_seconds=10) is not None


async def test_a_holder_that_lost_its_claim_cannot_complete_over_the_new_holder():
    claims, clock = store()
    await claims.acquire("event/1", holder="a", ttl_seconds=10)
    clock.now += 11
    await claims.acquire("event/1", holder="b", ttl_seconds=10)
    await claims.complete("event/1", holder="a", details={})
    current = await claims.get("event/1")
    assert current.holder == "b" and current.state == "held"


async def test_expired_claims_are_pruned_so_memory_stays_bounded():
    claims, clock = store(done_ttl=100)
    for i in range(50):
        await claims.acquire(f"event/{i}", holder="a", ttl_seconds=10)
        await claims.complete(f"event/{i}", holder="a", details={})
    assert claims.count() == 50
    clock.now += 200
    await claims.acquire("event/new", holder="a", ttl_seconds=10)
    assert claims.count() == 1
