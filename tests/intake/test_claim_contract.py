"""The ``ports.ClaimStore`` contract (its docstring), run against all three stores.

One table of rules, three stores: ``MemoryClaims`` (plan mode, ``replay``), ``KubeLeaseClaims``
on the emulated Kubernetes API server through the real kubernetes_asyncio client (kubernetes
mode), and ``RayKvClaims`` on the GCS internal KV of a real local Ray cluster (ray mode).  Each
"replica" of the cross-replica stores has its own client (its own connections); memory is one
replica's store, so its replicas share it.  Every store runs on a clock the test moves, so TTLs
and the dedupe window pass without sleeping.  The Lease store runs on the real API server too
(``real-lease``, a ``cluster`` test: tests/support/controlplane), in its namespace ``resilienced``.

Found by this test (issue #22): a holder that lost its claim to another and then completed it
overwrote the new holder's Lease with "done" (the memory and GCS KV stores left it alone); a
second completion of a done claim replaced its details in memory and in the GCS KV (the Lease
store kept the first); and the Lease store's ``get`` returned an expired held claim that the
other two report as free.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from resilienced.doubles import MemoryClaims
from resilienced.local.raycluster import LocalRayCluster
from resilienced.ports import ClaimStore
from tests.support import layers
from tests.support.controlplane.world import ensure_namespace
from tests.support.kubeapi import KubeApiServer
from tests.support.kubeoptions import LOCAL_BOUND_S
from tests.support.ray import session_head

pytestmark = pytest.mark.integration

TTL = 30
WINDOW = 3600.0  # the dedupe window: how long a done claim is remembered
_keys = itertools.count()


@dataclass
class Stores:
    """One store kind: a replica's store by name, the shared clock, and the done-claim sweep."""

    replica: Callable[[str], ClaimStore]
    advance: Callable[[float], None]
    forget_done: Callable[[], Awaitable[None]]
    clients: list[Any] = field(default_factory=list)  # closed after the test


async def _nothing() -> None:
    """Forgetting done claims needs no sweep: they expire with the window."""


# --------------------------------------------------------------------------- the three stores
def memory_stores() -> Stores:
    now = [1000.0]
    store = MemoryClaims(done_ttl_seconds=WINDOW, clock=lambda: now[0])
    return Stores(replica=lambda _name: store, advance=lambda s: now.__setitem__(0, now[0] + s),
                  forget_done=_nothing)


def lease_stores(server: Any) -> Stores:
    """On ``server``: a :class:`KubeApiServer`, or the real control plane (its ``api_client()``)."""
    from resilienced.kube.leases import KubeLeaseClaims

    now = [datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)]
    clients: list[Any] = []

    def replica(_name: str) -> KubeLeaseClaims:
        clients.append(server.api_client())
        return KubeLeaseClaims(clients[-1], namespace="resilienced", clock=lambda: now[0])

    sweeper = replica("sweeper")

    async def sweep() -> None:  # the daemon's sweeper deletes done Leases past the window
        await sweeper.sweep(older_than=timedelta(seconds=WINDOW))

    return Stores(replica=replica, advance=lambda s: now.__setitem__(0, now[0] + timedelta(seconds=s)),
                  forget_done=sweep, clients=clients)


def gcs_stores(cluster: LocalRayCluster) -> Stores:
    from resilienced.ray.claims import RayKvClaims
    from resilienced.ray.gcs import RayGcs

    now = [1_800_000_000.0]

    def replica(_name: str) -> ClaimStore:
        kv = RayGcs(cluster.address, token=cluster.auth_token, timeout=LOCAL_BOUND_S)
        return RayKvClaims(kv=kv, done_ttl_seconds=WINDOW, clock=lambda: now[0])

    return Stores(replica=replica, advance=lambda s: now.__setitem__(0, now[0] + s), forget_done=_nothing)


@pytest.fixture(params=[
    pytest.param("memory", marks=pytest.mark.unit),
    pytest.param("lease"),
    pytest.param("real-lease", marks=pytest.mark.cluster),
    pytest.param("gcs-kv", marks=pytest.mark.e2e),
])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[Stores]:
    if request.param == "memory":
        yield memory_stores()
    elif request.param == "lease":
        async with KubeApiServer() as server:
            made = lease_stores(server)
            try:
                yield made
            finally:
                for client in made.clients:
                    await client.close()
    elif request.param == "real-lease":  # the same store on the real API server (the process's control plane)
        plane = request.getfixturevalue("control_plane")
        layers.started("cluster", "the real control plane")
        ensure_namespace(plane, "resilienced")  # the real server keeps Leases only in one that exists
        made = lease_stores(plane)
        try:
            yield made
        finally:
            for client in made.clients:
                await client.close()
    else:
        yield gcs_stores(session_head(request))


def key() -> str:
    """A fresh key per test (the GCS KV is the session's, shared with other modules), with
    slashes as real keys have."""
    return f"run/evt-{next(_keys)}-{datetime.now().timestamp()}/ml/train"


# --------------------------------------------------------------------------- the contract
async def test_a_free_key_is_taken_and_another_live_holder_is_refused(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    claim = await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    assert claim is not None and (claim.key, claim.holder, claim.state) == (k, "a/m1", "held")
    assert await b.acquire(k, holder="b/m2", ttl_seconds=TTL) is None
    assert await a.acquire(k, holder="a/m3", ttl_seconds=TTL) is None  # another delivery, same replica
    current = await b.get(k)
    assert current is not None and (current.holder, current.state) == ("a/m1", "held")


async def test_a_renewal_restarts_the_ttl(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    stores.advance(TTL - 5)
    renewed = await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    assert renewed is not None and renewed.holder == "a/m1"
    stores.advance(TTL - 5)  # past the first TTL, within the renewed one
    assert await b.acquire(k, holder="b/m2", ttl_seconds=TTL) is None
    assert (await b.get(k)).holder == "a/m1"


async def test_an_expired_claim_is_free_and_taken_over_and_its_old_holder_has_lost_it(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    stores.advance(TTL + 1)
    assert await b.get(k) is None  # nobody renewed it: free
    taken = await b.acquire(k, holder="b/m2", ttl_seconds=TTL)
    assert taken is not None and taken.holder == "b/m2"
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL) is None  # the old holder's renewal: lost
    current = await a.get(k)
    assert (current.holder, current.state) == ("b/m2", "held")


async def test_a_holder_that_lost_its_claim_neither_completes_nor_releases_the_new_holders(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    stores.advance(TTL + 1)
    assert await b.acquire(k, holder="b/m2", ttl_seconds=TTL)

    await a.complete(k, holder="a/m1", details={"late": True})
    current = await b.get(k)
    assert current is not None and (current.holder, current.state) == ("b/m2", "held"), current
    await a.release(k, holder="a/m1")
    current = await b.get(k)
    assert current is not None and (current.holder, current.state) == ("b/m2", "held"), current
    assert await b.acquire(k, holder="b/m2", ttl_seconds=TTL) is not None  # b still renews it

    await b.complete(k, holder="b/m2", details={"step": 7})  # the new holder decides
    done = await a.get(k)
    assert (done.holder, done.state, dict(done.details)) == ("b/m2", "done", {"step": 7})


async def test_a_done_claim_is_refused_to_everyone_and_keeps_its_first_details(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    await a.complete(k, holder="a/m1", details={"step": 42})
    stores.advance(TTL * 10)  # long past the held TTL, within the dedupe window
    for store, holder in ((a, "a/m1"), (b, "b/m2"), (a, "a/m3")):
        assert await store.acquire(k, holder=holder, ttl_seconds=TTL) is None, holder
    await a.complete(k, holder="a/m1", details={"step": 43})  # a second completion changes nothing
    await b.complete(k, holder="b/m2", details={"step": 44})
    await a.release(k, holder="a/m1")  # nor does a release
    done = await b.get(k)
    assert (done.holder, done.state, dict(done.details)) == ("a/m1", "done", {"step": 42})


async def test_done_lists_the_done_claims_of_a_prefix_to_every_replica(stores: Stores) -> None:
    """``done(prefix)``: whether an event was handled through a run's claim (``run/<event id>/``),
    whichever replica asks; held and released claims and other prefixes are not in it."""
    a, b = stores.replica("a"), stores.replica("b")
    base = key().rsplit("/", 2)[0]  # run/evt-N-T
    finished, working, dropped = f"{base}/ml/one", f"{base}/ml/two", f"{base}/ml/three"
    other = key()
    for k in (finished, working, dropped, other):
        assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    await a.complete(finished, holder="a/m1", details={"outcome": "done"})
    await a.complete(other, holder="a/m1", details={})
    await a.release(dropped, holder="a/m1")
    for store in (a, b):
        found = await store.done(f"{base}/")
        assert [(c.key, c.holder, c.state, dict(c.details)) for c in found] == [
            (finished, "a/m1", "done", {"outcome": "done"})]
    assert await b.done(f"{base}-no-such/") == []


async def test_a_done_claim_is_forgotten_after_the_dedupe_window(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    await a.complete(k, holder="a/m1", details={})
    stores.advance(WINDOW - 60)
    await stores.forget_done()
    assert (await b.get(k)).state == "done"  # still within the window
    stores.advance(120)
    await stores.forget_done()
    assert await b.get(k) is None
    assert (await b.acquire(k, holder="b/m2", ttl_seconds=TTL)).holder == "b/m2"


async def test_release_frees_the_claim_at_once_but_only_for_its_holder(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    await b.release(k, holder="b/m2")  # not b's: nothing happens
    assert (await b.get(k)).holder == "a/m1"
    await a.release(k, holder="a/m1")
    assert await b.get(k) is None
    assert (await b.acquire(k, holder="b/m2", ttl_seconds=TTL)).holder == "b/m2"


@pytest.mark.parametrize("how", ["never acquired", "released", "expired"])
async def test_completing_a_free_claim_records_it_done(stores: Stores, how: str) -> None:
    """The work was done (a holder whose claim lapsed, nobody took it over): remember it."""
    a, b = stores.replica("a"), stores.replica("b")
    k = key()
    if how != "never acquired":
        assert await a.acquire(k, holder="a/m1", ttl_seconds=TTL)
    if how == "released":
        await a.release(k, holder="a/m1")
    if how == "expired":
        stores.advance(TTL + 1)
    await a.complete(k, holder="a/m1", details={"how": how})
    done = await b.get(k)
    assert (done.state, dict(done.details)) == ("done", {"how": how})
    assert await b.acquire(k, holder="b/m2", ttl_seconds=TTL) is None


@pytest.mark.parametrize("expired", [False, True], ids=["free", "expired"])
async def test_of_concurrent_acquires_at_most_one_wins(stores: Stores, expired: bool) -> None:
    replicas = [stores.replica(f"r{i}") for i in range(4)]
    k = key()
    if expired:
        assert await replicas[0].acquire(k, holder="r0/m0", ttl_seconds=TTL)
        stores.advance(TTL + 1)
    results = await asyncio.gather(*(r.acquire(k, holder=f"r{i}/m{i + 1}", ttl_seconds=TTL)
                                     for i, r in enumerate(replicas)))
    winners = [r.holder for r in results if r is not None]
    assert len(winners) == 1, winners
    assert (await replicas[0].get(k)).holder == winners[0]
