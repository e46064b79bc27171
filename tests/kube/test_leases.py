"""KubeLeaseClaims across two replicas sharing one API server: held, done, expired, released."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.kube.leases import KubeLeaseClaims, lease_name
from resilienced.ports import ClaimStore
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

NS = "resilienced"
KEY = "evt-1234/ml/train"


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def replicas(kubeapi: KubeApiServer, clock: Clock) -> AsyncIterator[tuple[KubeLeaseClaims, KubeLeaseClaims]]:
    """Two replicas, each with its own client (its own connections) to the same API server."""
    a_client, b_client = kubeapi.api_client(), kubeapi.api_client()
    try:
        yield (KubeLeaseClaims(a_client, namespace=NS, clock=clock),
               KubeLeaseClaims(b_client, namespace=NS, clock=clock))
    finally:
        await a_client.close()
        await b_client.close()


async def test_it_is_a_claim_store(replicas: tuple[KubeLeaseClaims, KubeLeaseClaims]) -> None:
    assert isinstance(replicas[0], ClaimStore)


async def test_a_held_claim_is_refused_to_the_other_replica(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], kubeapi: KubeApiServer
) -> None:
    a, b = replicas
    claim = await a.acquire(KEY, holder="replica-a", ttl_seconds=90)
    assert claim is not None and (claim.key, claim.holder, claim.state) == (KEY, "replica-a", "held")
    assert await b.acquire(KEY, holder="replica-b", ttl_seconds=90) is None
    assert await a.acquire(KEY, holder="replica-a/other-message", ttl_seconds=90) is None  # another delivery
    lease = kubeapi.get("leases", lease_name(KEY), namespace=NS)
    assert lease["spec"]["holderIdentity"] == "replica-a" and lease["spec"]["leaseDurationSeconds"] == 90
    assert lease["metadata"]["annotations"]["resilienced.io/claim-key"] == KEY
    assert lease["metadata"]["name"].startswith("resilienced-") and len(lease["metadata"]["name"]) == 32


async def test_the_holder_renews_its_claim_so_it_outlives_its_first_ttl(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    a, b = replicas
    assert await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=60) is not None
    clock.now += timedelta(seconds=50)
    renewed = await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=60)  # the consumer's keeper
    assert renewed is not None and renewed.holder == "replica-a/m1"
    clock.now += timedelta(seconds=50)  # 100 s after the first acquire, 50 s after the renewal
    assert await b.acquire(KEY, holder="replica-b/m2", ttl_seconds=60) is None
    lease = kubeapi.get("leases", lease_name(KEY), namespace=NS)
    assert lease["spec"]["holderIdentity"] == "replica-a/m1" and lease["spec"].get("leaseTransitions", 0) == 0


async def test_a_done_claim_stays_done(replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock) -> None:
    a, b = replicas
    await a.acquire(KEY, holder="replica-a", ttl_seconds=30)
    await a.complete(KEY, holder="replica-a", details={"drained": ["ab" * 28], "step": 1200})
    clock.now += timedelta(hours=2)  # long past the lease duration
    assert await b.acquire(KEY, holder="replica-b", ttl_seconds=30) is None
    claim = await b.get(KEY)
    assert claim is not None and claim.state == "done" and claim.holder == "replica-a"
    assert claim.details == {"drained": ["ab" * 28], "step": 1200}
    await a.release(KEY, holder="replica-a")  # releasing a done claim keeps it
    assert (await b.get(KEY)).state == "done"


async def test_an_expired_claim_is_taken_over(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    a, b = replicas
    await a.acquire(KEY, holder="replica-a", ttl_seconds=30)
    clock.now += timedelta(seconds=29)
    assert await b.acquire(KEY, holder="replica-b", ttl_seconds=30) is None
    clock.now += timedelta(seconds=2)
    taken = await b.acquire(KEY, holder="replica-b", ttl_seconds=30)
    assert taken is not None and taken.holder == "replica-b" and taken.state == "held"
    lease = kubeapi.get("leases", lease_name(KEY), namespace=NS)
    assert lease["spec"]["leaseTransitions"] == 1
    assert [r.verb for r in kubeapi.requests if r.verb == "update"] == ["update"]
    assert await a.acquire(KEY, holder="replica-a", ttl_seconds=30) is None


def _calls(kubeapi: KubeApiServer) -> list[tuple[str, int]]:
    return [(r.verb, r.status) for r in kubeapi.requests]


async def test_the_holder_renews_completes_and_releases_with_one_request_each(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    """The writer's copy (kube.leases, issue #45): a renewal had cost a create answered 409, a read
    and an update; a completion and a release a read besides their write."""
    a, b = replicas
    await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30)
    kubeapi.reset_log()
    clock.now += timedelta(seconds=10)
    renewed = await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30)
    assert renewed is not None and renewed.holder == "replica-a/m1"
    assert _calls(kubeapi) == [("update", 200)]
    clock.now += timedelta(seconds=25)  # 35 s after the acquire, 25 after the renewal: still live
    assert await b.acquire(KEY, holder="replica-b/m2", ttl_seconds=30) is None
    kubeapi.reset_log()
    await a.complete(KEY, holder="replica-a/m1", details={"n": 1})
    assert _calls(kubeapi) == [("update", 200)]
    done = await b.get(KEY)
    assert (done.state, done.holder, dict(done.details)) == ("done", "replica-a/m1", {"n": 1})

    other = "move/ml/train"
    await a.acquire(other, holder="replica-a/m1", ttl_seconds=30)
    kubeapi.reset_log()
    await a.release(other, holder="replica-a/m1")
    assert _calls(kubeapi) == [("delete", 200)]
    assert await b.acquire(other, holder="replica-b/m2", ttl_seconds=30) is not None


async def test_a_lease_written_by_someone_else_since_is_read_again_before_the_holder_writes(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    """The writer's copy is only a first try: another writer's change (here an annotation added by
    hand) answers it 409, and the holder goes the reading way, keeping its claim."""
    a, b = replicas
    await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30)
    kubeapi.patch("leases", lease_name(KEY), {"metadata": {"annotations": {"team": "ml"}}}, namespace=NS)
    kubeapi.reset_log()
    clock.now += timedelta(seconds=10)
    assert (await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30)).holder == "replica-a/m1"
    assert _calls(kubeapi) == [("update", 409), ("create", 409), ("get", 200), ("update", 200)]
    kubeapi.patch("leases", lease_name(KEY), {"metadata": {"annotations": {"team": "infra"}}}, namespace=NS)
    await a.release(KEY, holder="replica-a/m1")
    assert await b.acquire(KEY, holder="replica-b/m2", ttl_seconds=30) is not None  # released all the same
    kubeapi.patch("leases", lease_name(KEY), {"metadata": {"annotations": {"team": "ml"}}}, namespace=NS)
    await b.complete(KEY, holder="replica-b/m2", details={})
    assert (await a.get(KEY)).state == "done"
    kubeapi.delete("leases", lease_name(KEY), namespace=NS)  # swept, say: a renewal then creates it
    assert await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30) is not None


async def test_a_holder_that_lost_its_claim_does_not_renew_it_from_its_copy(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    a, b = replicas
    await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30)
    clock.now += timedelta(seconds=31)
    assert (await b.acquire(KEY, holder="replica-b/m2", ttl_seconds=30)).holder == "replica-b/m2"
    assert await a.acquire(KEY, holder="replica-a/m1", ttl_seconds=30) is None
    await a.release(KEY, holder="replica-a/m1")
    claim = await a.get(KEY)
    assert (claim.holder, claim.state) == ("replica-b/m2", "held")
    assert [s for v, s in _calls(kubeapi) if v == "delete"] == []  # the stale copy was dropped: read, then left


async def test_only_one_of_two_racing_takeovers_wins(kubeapi: KubeApiServer, clock: Clock) -> None:
    clients = [kubeapi.api_client() for _ in range(3)]
    try:
        first, *racers = [KubeLeaseClaims(c, namespace=NS, clock=clock) for c in clients]
        await first.acquire(KEY, holder="replica-a", ttl_seconds=10)
        clock.now += timedelta(seconds=11)
        results = await asyncio.gather(*(r.acquire(KEY, holder=f"replica-{i}", ttl_seconds=10) for i, r in enumerate(racers)))
        assert sum(r is not None for r in results) == 1
    finally:
        for c in clients:
            await c.close()


async def test_only_one_of_many_racing_acquires_wins(kubeapi: KubeApiServer, clock: Clock) -> None:
    clients = [kubeapi.api_client() for _ in range(5)]
    try:
        stores = [KubeLeaseClaims(c, namespace=NS, clock=clock) for c in clients]
        results = await asyncio.gather(*(s.acquire(KEY, holder=f"replica-{i}", ttl_seconds=60) for i, s in enumerate(stores)))
        assert sum(r is not None for r in results) == 1
    finally:
        for c in clients:
            await c.close()


async def test_release_frees_the_claim_only_for_its_holder(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], kubeapi: KubeApiServer
) -> None:
    a, b = replicas
    await a.acquire(KEY, holder="replica-a", ttl_seconds=90)
    await b.release(KEY, holder="replica-b")
    assert (await a.get(KEY)).holder == "replica-a"
    await a.release(KEY, holder="replica-a")
    assert await a.get(KEY) is None
    assert (await b.acquire(KEY, holder="replica-b", ttl_seconds=90)).holder == "replica-b"
    delete = next(r for r in kubeapi.requests if r.verb == "delete")
    assert delete.status == 200


async def test_complete_after_losing_the_lease_leaves_the_new_holders_lease_alone(
    replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], clock: Clock, kubeapi: KubeApiServer
) -> None:
    """The ClaimStore contract (tests/intake/test_claim_contract.py): the new holder decides.
    Before issue #22 the old holder's complete overwrote b's Lease with "done"."""
    a, b = replicas
    await a.acquire(KEY, holder="replica-a", ttl_seconds=5)
    clock.now += timedelta(seconds=6)
    await b.acquire(KEY, holder="replica-b", ttl_seconds=5)
    written = sum(1 for r in kubeapi.requests if r.verb == "update" and r.status == 200)
    await a.complete(KEY, holder="replica-a", details={"ok": True})
    claim = await b.get(KEY)
    assert (claim.holder, claim.state) == ("replica-b", "held")
    # not written: a's update against its own last write is answered 409 (kube.leases, the writer's copy)
    assert sum(1 for r in kubeapi.requests if r.verb == "update" and r.status == 200) == written
    notes = kubeapi.get("leases", lease_name(KEY), namespace=NS)["metadata"]["annotations"]
    assert "resilienced.io/details" not in notes


async def test_complete_without_a_lease_creates_it_done(replicas: tuple[KubeLeaseClaims, KubeLeaseClaims]) -> None:
    a, b = replicas
    await a.complete(KEY, holder="replica-a", details={})
    assert (await b.get(KEY)).state == "done"
    assert await b.acquire(KEY, holder="replica-b", ttl_seconds=60) is None


async def test_complete_retries_after_a_conflict(replicas: tuple[KubeLeaseClaims, KubeLeaseClaims], kubeapi: KubeApiServer) -> None:
    a, _ = replicas
    await a.acquire(KEY, holder="replica-a", ttl_seconds=60)
    kubeapi.fail(verb="update", resource="leases", status=409, times=1)
    await a.complete(KEY, holder="replica-a", details={"n": 1})
    assert (await a.get(KEY)).state == "done"
    assert [r.status for r in kubeapi.requests if r.verb == "update"] == [409, 200]


async def test_keys_map_to_distinct_valid_names(api: k8s.ApiClient) -> None:
    keys = [KEY, KEY + " ", "Événement/ünïcode", "x" * 2000]
    names = {lease_name(k) for k in keys}
    assert len(names) == len(keys)
    store = KubeLeaseClaims(api, namespace=NS)
    for key in keys:
        claim = await store.acquire(key, holder="r", ttl_seconds=1)
        assert claim is not None and claim.key == key


async def test_the_sweep_deletes_done_claims_past_the_window_and_keeps_the_rest(api, kubeapi) -> None:
    from datetime import datetime, timedelta, timezone

    from resilienced.kube.leases import KubeLeaseClaims

    now = [datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)]
    claims = KubeLeaseClaims(api, namespace="resilienced", clock=lambda: now[0])
    assert await claims.acquire("old-done", holder="a", ttl_seconds=60)
    await claims.complete("old-done", holder="a", details={})
    assert await claims.acquire("old-held", holder="a", ttl_seconds=60)
    now[0] += timedelta(hours=30)
    assert await claims.acquire("new-done", holder="b", ttl_seconds=60)
    await claims.complete("new-done", holder="b", details={})

    assert await claims.sweep(older_than=timedelta(hours=24)) == 1

    assert await claims.get("old-done") is None
    # a held claim is never swept (expired, get() reads it as free; the Lease is still there)
    assert kubeapi.get("leases", lease_name("old-held"), namespace="resilienced") is not None
    assert (await claims.get("new-done")).state == "done"
