"""RayKvClaims on the GCS internal KV, against the real local Ray cluster."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

import pytest

from resilienced.local.raycluster import LocalRayCluster
from resilienced.ports import ClaimStore
from resilienced.ray.claims import RayKvClaims

from .test_cluster import gcs

pytestmark = pytest.mark.e2e


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def claims(cluster: LocalRayCluster, clock: Clock) -> RayKvClaims:
    return RayKvClaims(kv=gcs(cluster), done_ttl_seconds=3600, clock=clock)


def key(name: str) -> str:
    return f"evt-{name}-{datetime.now().timestamp()}/ml/train"  # unique per run, with slashes


async def test_claims_follow_the_claim_store_rules(ray_cluster: LocalRayCluster, clock: Clock) -> None:
    store = claims(ray_cluster, clock)
    assert isinstance(store, ClaimStore)
    k = key("rules")

    first = await store.acquire(k, holder="replica-a", ttl_seconds=60)
    assert first is not None and first.holder == "replica-a"
    assert await store.acquire(k, holder="replica-b", ttl_seconds=60) is None  # another live holder
    assert await store.acquire(k, holder="replica-a", ttl_seconds=60) is not None  # renewed
    assert (await store.get(k)).holder == "replica-a"

    await store.complete(k, holder="replica-a", details={"step": 42})
    done = await store.get(k)
    assert (done.state, done.details) == ("done", {"step": 42})
    assert await store.acquire(k, holder="replica-b", ttl_seconds=60) is None  # done is remembered
    assert await store.acquire(k, holder="replica-a", ttl_seconds=60) is None

    clock.now += 3601  # the dedupe window is over
    assert await store.get(k) is None


async def test_an_expired_claim_is_taken_over_and_the_old_holder_backs_off(
    ray_cluster: LocalRayCluster, clock: Clock
) -> None:
    store = claims(ray_cluster, clock)
    k = key("takeover")
    assert await store.acquire(k, holder="replica-a", ttl_seconds=30)
    clock.now += 31

    taken = await store.acquire(k, holder="replica-b", ttl_seconds=30)
    assert taken is not None and taken.holder == "replica-b"
    # The old holder's late renew and complete do not steal it back.
    assert await store.acquire(k, holder="replica-a", ttl_seconds=30) is None
    await store.complete(k, holder="replica-a", details={"late": True})
    assert (await store.get(k)).holder == "replica-b"
    assert (await store.get(k)).state == "held"


async def test_racing_takeovers_have_exactly_one_winner(ray_cluster: LocalRayCluster, clock: Clock) -> None:
    stores = [claims(ray_cluster, clock) for _ in range(4)]
    k = key("race")
    assert await stores[0].acquire(k, holder="replica-0", ttl_seconds=10)
    clock.now += 11

    results = await asyncio.gather(*(s.acquire(k, holder=f"replica-{i + 1}", ttl_seconds=10)
                                     for i, s in enumerate(stores)))

    winners = [r.holder for r in results if r is not None]
    assert len(winners) == 1
    assert (await stores[0].get(k)).holder == winners[0]


async def test_release_frees_the_claim_for_another_holder(ray_cluster: LocalRayCluster, clock: Clock) -> None:
    store = claims(ray_cluster, clock)
    k = key("release")
    assert await store.acquire(k, holder="replica-a", ttl_seconds=60)
    await store.release(k, holder="replica-b")  # not its claim: nothing happens
    assert (await store.get(k)).holder == "replica-a"
    await store.release(k, holder="replica-a")
    assert await store.get(k) is None
    assert (await store.acquire(k, holder="replica-b", ttl_seconds=60)).holder == "replica-b"


async def test_an_unreadable_claim_record_does_not_block_forever(ray_cluster: LocalRayCluster, clock: Clock) -> None:
    store = claims(ray_cluster, clock)
    k = key("corrupt")
    client = gcs(ray_cluster)
    base = "claims/" + __import__("urllib.parse").parse.quote(k, safe="") + "/"
    await client.kv_put(base + "000000000001", b"{not json")

    claim = await store.acquire(k, holder="replica-a", ttl_seconds=60)

    assert claim is not None and claim.holder == "replica-a"
    assert json.loads(await client.kv_get(base + "000000000002"))["holder"] == "replica-a"
