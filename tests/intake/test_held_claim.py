"""``claims.held_claim``: the one claim lifecycle of event, run and move claims.

acquire -> renew every ttl/3 beside the work -> lost (taken over, or not renewed for a whole TTL)
-> complete / release, with a renewal in flight always landing before the completion or release.
Run on the real in-memory store (wrapped to hold, fail or record calls); its users' races are
tested with them (tests/intake/test_consumer.py, tests/recovery/test_run_claims.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from resilienced.claims import ClaimLost, held_claim
from resilienced.doubles import MemoryClaims
from resilienced.errors import BackendUnavailable

pytestmark = pytest.mark.unit

TTL = 0.3  # renewals every 0.1 s
KEY = "run/evt-1/ml/train"


class Log:
    """A logger that keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def error(self, event: str, **fields: Any) -> None:
        self.lines.append(("error", event, fields))

    def events(self) -> list[str]:
        return [event for _, event, _ in self.lines]


class Store(MemoryClaims):
    """The in-memory store on a clock the test moves; renewals (acquires after the first) can be
    held or made to fail, and every call is written down in order."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(clock=lambda: self.now)
        self.calls: list[str] = []
        self.renewed = asyncio.Event()
        self.renewing = asyncio.Event()
        self.hold: asyncio.Event | None = None  # set: renewals wait for it
        self.fail = False

    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Any:
        renewal = f"acquire {holder}" in self.calls
        self.calls.append(f"acquire {holder}")
        if renewal and self.hold is not None:
            self.renewing.set()
            await self.hold.wait()
        if renewal and self.fail:
            raise BackendUnavailable("test", "the store does not answer")
        claim = await super().acquire(key, holder=holder, ttl_seconds=ttl_seconds)
        if renewal:
            self.calls.append(f"renewed {holder}")
            self.renewed.set()
        return claim

    async def complete(self, key: str, *, holder: str, details: Any) -> None:
        self.calls.append(f"complete {holder}")
        await super().complete(key, holder=holder, details=details)

    async def release(self, key: str, *, holder: str) -> None:
        self.calls.append(f"release {holder}")
        await super().release(key, holder=holder)


async def renewals(store: Store, count: int) -> None:
    """Wait (bounded) until ``count`` renewals have landed."""
    async def enough() -> None:
        while sum(c.startswith("renewed ") for c in store.calls) < count:
            store.renewed.clear()
            await store.renewed.wait()
    await asyncio.wait_for(enough(), timeout=30)


async def lost(held: Any) -> None:
    async def until() -> None:
        while held.lost is None:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(until(), timeout=30)


async def test_a_claim_held_elsewhere_yields_none_and_is_left_alone() -> None:
    store, log = Store(), Log()
    assert await store.acquire(KEY, holder="b", ttl_seconds=60)
    async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log) as held:
        assert held is None
    assert (await store.get(KEY)).holder == "b" and "release a" not in store.calls


async def test_the_claim_is_renewed_beside_the_work_and_completed_after() -> None:
    store, log = Store(), Log()
    async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log) as held:
        await renewals(store, 3)  # three renewals: the claim outlives its first TTL while held
        store.now += 2 * TTL  # the store's clock: live only because the renewals went on
        await renewals(store, 4)
        assert await store.acquire(KEY, holder="b", ttl_seconds=TTL) is None
        await held.complete({"step": 1})
    done = await store.get(KEY)
    assert (done.state, done.holder, dict(done.details)) == ("done", "a", {"step": 1})
    assert store.calls[-1] == "complete a" and log.lines == []


async def test_a_renewal_in_flight_lands_before_the_completion() -> None:
    store, log = Store(), Log()
    store.hold = asyncio.Event()
    async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log) as held:
        await asyncio.wait_for(store.renewing.wait(), timeout=30)  # a renewal is in flight, held
        completing = asyncio.create_task(held.complete({}))
        for _ in range(50):
            await asyncio.sleep(0)
        assert "complete a" not in store.calls  # it waits for the renewal
        store.hold.set()
        await completing
    assert store.calls[-2:] == ["renewed a", "complete a"]
    assert (await store.get(KEY)).state == "done"


async def test_a_claim_taken_over_is_lost_its_holder_stops_and_never_completes_it() -> None:
    store, log = Store(), Log()
    with pytest.raises(ClaimLost) as caught:
        async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log) as held:
            store.now += TTL + 1  # a's claim lapsed (a stalled store, a paused process) ...
            assert await store.acquire(KEY, holder="b", ttl_seconds=60)  # ... and b took it over
            await lost(held)
            assert held.lost == "taken over by b"
            await held.complete({"late": True})
    assert caught.value.delay == TTL and "lost: taken over by b" in str(caught.value)
    assert "complete a" not in store.calls
    current = await store.get(KEY)
    assert (current.holder, current.state) == ("b", "held")  # a's release on the way out left it
    assert ("warning", "claim lost", {"key": KEY, "reason": "taken over by b"}) in log.lines


async def test_a_claim_not_renewed_for_a_whole_ttl_is_lost() -> None:
    store, log = Store(), Log()
    store.fail = True
    async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log, what="move claim") as held:
        await lost(held)
        assert held.lost.startswith(f"not renewed for {TTL:g}s (")
        with pytest.raises(ClaimLost):
            held.check()
    failed = [e for e in log.events() if e == "move claim renewal failed"]
    assert len(failed) >= 3 and "move claim lost" in log.events()


async def test_a_block_that_fails_releases_the_claim() -> None:
    store, log = Store(), Log()
    with pytest.raises(RuntimeError):
        async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log):
            raise RuntimeError("a step failed")
    assert await store.get(KEY) is None and store.calls[-1] == "release a"


@pytest.mark.parametrize("release_on_cancel", [True, False])
async def test_a_cancelled_block_releases_the_claim_unless_told_not_to(release_on_cancel: bool) -> None:
    store, log = Store(), Log()
    inside = asyncio.Event()

    async def work() -> None:
        async with held_claim(store, KEY, holder="a", ttl_seconds=TTL, logger=log,
                              release_on_cancel=release_on_cancel):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(work())
    await asyncio.wait_for(inside.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    claim = await store.get(KEY)
    if release_on_cancel:
        assert claim is None
    else:  # a move stopped midway: its claim lapses with its TTL
        assert claim is not None and claim.holder == "a"
    assert not any(t.get_name().startswith("resilienced.claim-renewal") for t in asyncio.all_tasks())
