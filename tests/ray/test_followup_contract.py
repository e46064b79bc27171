"""The ``ports.FollowUpStore`` contract (its docstring), run against all three stores.

One table of rules, three stores: ``MemoryFollowUps`` (the in-process double,
resilienced/doubles.py), ``KubeFollowUps`` on Leases of the emulated Kubernetes API server
through the real kubernetes_asyncio client (kubernetes mode), and ``RayKvFollowUps`` on the GCS
internal KV of a real local Ray cluster, head only (ray mode).  Each "replica" of the cross-replica stores has
its own client; the memory store is one replica's, so its replicas share it.  The Lease store runs
on the real API server too (``real-lease``, a ``cluster`` test: tests/support/controlplane).

Both cross-replica stores share their place with the run claims (the Leases of
``--claims-namespace``, the GCS KV namespace ``resilienced``): ``all`` must list follow-ups only.
The GCS store's update is a read-check-write made under the run's move claim
(resilienced/ray/followup_store.py), so concurrent *updates* are not part of this contract; concurrent
*creates* are (each store's create is atomic).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pytest

from resilienced.local.raycluster import LocalRayCluster
from resilienced.ports import FollowUpStore
from resilienced.doubles import MemoryFollowUps
from tests.support import layers
from tests.support.controlplane.world import ensure_namespace
from tests.support.kubeapi import KubeApiServer
from tests.support.kubeoptions import LOCAL_BOUND_S
from tests.support.ray import session_head

pytestmark = pytest.mark.integration

NAMESPACE = "resilienced"
_runs = itertools.count()


@dataclass
class Stores:
    """One store kind: a replica's store by name, and a claim written where that store lives."""

    replica: Callable[[str], FollowUpStore]
    claim: Callable[[str], Awaitable[None]]
    clients: list[Any] = field(default_factory=list)  # closed after the test


def memory_stores() -> Stores:
    store = MemoryFollowUps()

    async def no_claim(_key: str) -> None:  # memory claims live in another object
        pass

    return Stores(replica=lambda _name: store, claim=no_claim)


def lease_stores(server: Any) -> Stores:
    """On ``server``: a :class:`KubeApiServer`, or the real control plane (its ``api_client()``)."""
    from resilienced.kube.followup_store import KubeFollowUps
    from resilienced.kube.leases import KubeLeaseClaims

    clients: list[Any] = []

    def client() -> Any:
        clients.append(server.api_client())
        return clients[-1]

    async def claim(key: str) -> None:
        assert await KubeLeaseClaims(client(), namespace=NAMESPACE).acquire(key, holder="a/m1", ttl_seconds=30)

    return Stores(replica=lambda _name: KubeFollowUps(client(), namespace=NAMESPACE), claim=claim,
                  clients=clients)


def gcs_stores(cluster: LocalRayCluster) -> Stores:
    from resilienced.ray.claims import RayKvClaims
    from resilienced.ray.followup_store import RayKvFollowUps
    from resilienced.ray.gcs import RayGcs

    def kv() -> RayGcs:
        return RayGcs(cluster.address, token=cluster.auth_token, timeout=LOCAL_BOUND_S)

    async def claim(key: str) -> None:
        assert await RayKvClaims(kv=kv()).acquire(key, holder="a/m1", ttl_seconds=30)

    return Stores(replica=lambda _name: RayKvFollowUps(kv=kv()), claim=claim)


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


def run() -> str:
    """A fresh run per test (the GCS KV is the session's, shared with other modules), with the slash and
    characters real run names have."""
    return f"ml-{next(_runs)}-{datetime.now().timestamp():.6f}/train job"


RECORD = {"state": "following", "stage": "joined", "moves": 1, "capacities": ["spot", "on-demand"],
          "evidence": {"nodes": 2, "ready": None}}


# --------------------------------------------------------------------------- the contract
#: Found on the real API server (issue #40): a PUT of a missing Lease creates it (its strategy's
#: AllowCreateOnUpdate; the emulator answered 404 and now creates it too), so KubeFollowUps.put
#: with a version recreated a deleted record; it writes with a merge patch now (404 when gone).
async def test_a_run_without_a_record_reads_none_and_nothing_is_listed_for_it(stores: Stores) -> None:
    a = stores.replica("a")
    r = run()
    assert await a.get(r) is None
    assert await a.put(r, RECORD, version="1") is None  # an update of nothing writes nothing
    assert await a.get(r) is None
    assert await a.delete(r, version="1") is False


async def test_a_created_record_reads_back_as_written_from_another_replica(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    r = run()
    version = await a.put(r, RECORD, version=None)
    assert version is not None
    assert await b.get(r) == (RECORD, version)
    # A value JSON cannot hold is stored as its text, in every store.
    when = datetime(2026, 12, 3, 6, 0, tzinfo=timezone.utc)
    later = await b.put(r, {**RECORD, "since": when}, version=version)
    assert later is not None
    assert (await a.get(r)) == ({**RECORD, "since": str(when)}, later)


async def test_a_second_create_and_a_write_on_an_old_version_are_refused_and_change_nothing(
    stores: Stores,
) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    r = run()
    first = await a.put(r, RECORD, version=None)
    assert await b.put(r, {**RECORD, "moves": 9}, version=None) is None  # someone created it first

    second = await b.put(r, {**RECORD, "stage": "training"}, version=first)
    assert second is not None and second != first
    assert await a.put(r, {**RECORD, "stage": "stale"}, version=first) is None  # read before b wrote
    assert await a.get(r) == ({**RECORD, "stage": "training"}, second)

    third = await a.put(r, {**RECORD, "stage": "resumed"}, version=second)  # read again: it writes
    assert third is not None and third not in (first, second)
    assert await b.get(r) == ({**RECORD, "stage": "resumed"}, third)


async def test_delete_needs_the_current_version(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    r = run()
    first = await a.put(r, RECORD, version=None)
    second = await b.put(r, {**RECORD, "moves": 2}, version=first)
    assert await a.delete(r, version=first) is False  # b wrote since
    assert await a.get(r) == ({**RECORD, "moves": 2}, second)
    assert await a.delete(r, version=second) is True
    assert await b.get(r) is None
    assert await b.delete(r, version=second) is False  # gone already
    assert await b.put(r, RECORD, version=None) is not None  # and it can be created again


async def test_all_lists_every_follow_up_with_its_version_and_no_claim(stores: Stores) -> None:
    a, b = stores.replica("a"), stores.replica("b")
    r1, r2 = run(), run()
    v1 = await a.put(r1, {**RECORD, "run": r1}, version=None)
    v2 = await b.put(r2, {**RECORD, "run": r2}, version=None)
    await stores.claim(f"run/{r1}")  # a run claim next to the follow-ups

    listed = {record["run"]: version for record, version in await b.all() if record.get("run") in (r1, r2)}
    assert listed == {r1: v1, r2: v2}
    assert all("state" in record for record, _ in await a.all())  # only follow-up records

    assert await a.delete(r1, version=v1)
    assert [record["run"] for record, _ in await b.all() if record.get("run") in (r1, r2)] == [r2]


async def test_of_concurrent_creates_exactly_one_wins(stores: Stores) -> None:
    replicas = [stores.replica(f"r{i}") for i in range(4)]
    r = run()
    results = await asyncio.gather(*(s.put(r, {**RECORD, "by": i}, version=None) for i, s in enumerate(replicas)))
    winners = [(i, v) for i, v in enumerate(results) if v is not None]
    assert len(winners) == 1, results
    (by, version), = winners
    assert await replicas[0].get(r) == ({**RECORD, "by": by}, version)
