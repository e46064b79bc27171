"""Run claims of a replica that dies mid-recovery lapse soon; a live holder keeps its claim.

Found by the reliability campaign (tests/chaos, scenario 1, docs/reliability.md): a run claim used
to live for max(300 s, deadline + grace) without renewal, and a replica finding it held looked
again after 0.5 s. When the holder was SIGKILLed, the other replica's looks used up the message's
receives and the notice went to the DLQ before the claim lapsed: the run was never requeued.
Now the claim's TTL is the queue's visibility timeout, renewed by its holder every third of it,
and the replica that finds it held looks again only once a dead holder's claim has lapsed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from resilienced.errors import TemporaryError
from resilienced.kube.leases import KEY_ANNOTATION, STATE_ANNOTATION, STATE_DONE, lease_name
from resilienced.model import Result

from .conftest import DAEMON_NS, NS, instance, put_checkpoint
from .test_recovery import World, body, plan_of, world  # noqa: F401  (the fixture)
import pytest

pytestmark = pytest.mark.integration

TTL = 2.0


def spot_plan() -> Any:
    return plan_of(body("EC2 Spot Instance Interruption Warning",
                        {"instance-id": instance(1), "instance-action": "terminate"},
                        when=datetime.now(timezone.utc)))


def lease_of(world: World, key: str) -> dict[str, Any]:
    leases = world.kubeapi.list("leases", namespace=DAEMON_NS)
    return next(l for l in leases if l["metadata"]["annotations"][KEY_ANNOTATION] == key)


async def test_a_dead_holders_run_claim_lapses_and_the_other_replica_takes_over(world: World) -> None:
    world.recovery.options = replace(world.recovery.options, claim_ttl_seconds=TTL)
    plan = spot_plan()
    key = f"run/{plan.event.event_id}/{NS}/train"
    await put_checkpoint(world.s3, step=5, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"r" * 50, ".metadata": b"m"})
    # a replica took the run and was SIGKILLed: its claim is never renewed.  Taken last, right
    # before the other replica looks: a slow checkpoint upload in between (a loaded machine, under
    # coverage) let the claim lapse before the look, and the look rightly took the run.
    assert await world.claims.acquire(key, holder="replica-dead/m1", ttl_seconds=TTL) is not None
    try:
        await world.recovery.act(plan, holder="replica-b/m2")
        raise AssertionError("a held run claim was not noticed")
    except TemporaryError as e:
        assert "being handled by replica-dead/m1" in str(e)
        assert e.delay == TTL  # one more receive, once the dead claim has lapsed; not one every 0.5 s
        await asyncio.sleep(e.delay)  # what the consumer does: the message is hidden that long
    outcome = await world.recovery.act(plan, holder="replica-b/m2")
    assert outcome.result is Result.DONE, outcome.reason
    assert len(world.gcs.drains) == 1 and lease_of(world, key)["spec"]["holderIdentity"] == "replica-b/m2"


async def test_a_live_holder_renews_its_run_claim_while_it_waits(world: World) -> None:
    world.recovery.options = replace(world.recovery.options, claim_ttl_seconds=TTL)
    plan = spot_plan()
    key = f"run/{plan.event.event_id}/{NS}/train"
    working = asyncio.create_task(world.recovery.act(plan, holder="replica-a/m1"))  # waits for S3
    while not world.gcs.drains:
        await asyncio.sleep(0.02)
    first = lease_of(world, key)["spec"]
    assert first["leaseDurationSeconds"] == TTL and first["holderIdentity"] == "replica-a/m1"
    end = time.monotonic() + 10 * TTL
    while lease_of(world, key)["spec"]["renewTime"] == first["renewTime"]:
        assert time.monotonic() < end, "the holder never renewed its run claim"
        await asyncio.sleep(0.05)
    try:  # renewed, so still held: another replica keeps off
        await world.recovery.act(plan, holder="replica-b/m2")
        raise AssertionError("a live holder's run claim was taken")
    except TemporaryError as e:
        assert "being handled by replica-a/m1" in str(e)
    await put_checkpoint(world.s3, step=6, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"r" * 50, ".metadata": b"m"})
    outcome = await asyncio.wait_for(working, timeout=60)
    assert outcome.result is Result.DONE and len(world.gcs.drains) == 1


async def test_a_renewal_in_flight_finishes_before_the_run_claim_is_completed(world: World) -> None:
    """The keeper is stopped and awaited before ``complete()``: it was cancelled and left running,
    so a renewal in flight could land after the completion (in ray mode, where the GCS KV has no
    compare-and-set and its calls run on threads a cancel does not stop, that turns the done claim
    back into a held one). Here the API server holds the renewal while the run finishes: it must
    be answered, not abandoned, and the completion must come after it."""
    world.recovery.options = replace(world.recovery.options, claim_ttl_seconds=TTL)
    plan = spot_plan()
    key = f"run/{plan.event.event_id}/{NS}/train"
    name = lease_name(key)
    hold = world.kubeapi.delay(1.0, verb="update", resource="leases", name=name)
    working = asyncio.create_task(world.recovery.act(plan, holder="replica-a/m1"))  # waits for S3
    end = time.monotonic() + 10 * TTL
    while hold.hits == 0:  # the keeper's first renewal is being held
        assert time.monotonic() < end, "the holder never renewed its run claim"
        await asyncio.sleep(0.02)
    await put_checkpoint(world.s3, step=6, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"r" * 50, ".metadata": b"m"})
    outcome = await asyncio.wait_for(working, timeout=60)

    assert outcome.result is Result.DONE, outcome.reason
    updates = [r.status for r in world.kubeapi.requests
               if r.verb == "update" and r.plural == "leases" and r.name == name]
    assert 499 not in updates, f"a renewal was abandoned mid-request: {updates}"
    assert updates[-2:] == [200, 200], updates  # the held renewal, then the completion
    assert lease_of(world, key)["metadata"]["annotations"][STATE_ANNOTATION] == STATE_DONE


async def test_a_holder_whose_claim_was_taken_over_stops_before_its_next_step(world: World) -> None:
    """Fencing: a replica that could not renew its claim in time (a stalled API server, a paused
    process) and finds it taken over takes no further step and does not complete the claim; the
    new holder finishes the run. Before, it went on and requeued the run as well (found reading
    the keeper after the campaign's scenario 1 failed once under heavy load: a late renewal lets
    the other replica take over while the first still works)."""
    world.recovery.options = replace(world.recovery.options, claim_ttl_seconds=TTL)
    plan = spot_plan()
    key = f"run/{plan.event.event_id}/{NS}/train"
    name = lease_name(key)
    working = asyncio.create_task(world.recovery.act(plan, holder="replica-a/m1"))  # waits for S3
    while not world.gcs.drains:
        await asyncio.sleep(0.02)
    # replica b takes the claim over (as it may once a's renewals are late past the TTL)
    lease = lease_of(world, key)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    world.kubeapi.put({**lease, "spec": {**lease["spec"], "holderIdentity": "replica-b/m2", "renewTime": now,
                                         "leaseDurationSeconds": 600}})
    reads = sum(1 for r in world.kubeapi.requests if r.verb == "get" and r.name == name)
    end = time.monotonic() + 10 * TTL
    while sum(1 for r in world.kubeapi.requests if r.verb == "get" and r.name == name) == reads:
        assert time.monotonic() < end, "the holder never tried to renew its run claim"
        await asyncio.sleep(0.02)  # a's keeper has looked at the lease and found b holding it
    await put_checkpoint(world.s3, step=6, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"r" * 50, ".metadata": b"m"})
    try:
        await asyncio.wait_for(working, timeout=60)
        raise AssertionError("a replica that lost its claim finished the run")
    except TemporaryError as e:
        assert "lost: taken over by replica-b/m2" in str(e) and e.delay == TTL, str(e)
    assert world.events("Requeued") == [], "the replica that lost its claim requeued the run"
    job = world.kubeapi.get("rayjobs", "train", namespace=NS)
    assert not any(k.startswith("resilienced.io/requeued") for k in job["metadata"].get("annotations", {}))
    after = lease_of(world, key)  # b's claim: not completed, not released by a
    assert after["spec"]["holderIdentity"] == "replica-b/m2"
    assert after["metadata"]["annotations"][STATE_ANNOTATION] != STATE_DONE


async def test_a_holder_that_cannot_renew_for_a_whole_ttl_stops_before_its_next_step(world: World) -> None:
    """The API server refuses every renewal for longer than the claim's TTL: the claim may have
    been taken over meanwhile, so the holder takes no further step (as client-go's leader
    election gives up leading when it cannot renew within its deadline)."""
    world.recovery.options = replace(world.recovery.options, claim_ttl_seconds=TTL)
    plan = spot_plan()
    key = f"run/{plan.event.event_id}/{NS}/train"
    working = asyncio.create_task(world.recovery.act(plan, holder="replica-a/m1"))  # waits for S3
    while not world.gcs.drains:
        await asyncio.sleep(0.02)
    # a renewal is an update against the holder's last write (kube.leases, the writer's copy)
    refused = world.kubeapi.fail(verb="update", resource="leases", status=500, times=None)
    end = time.monotonic() + 10 * TTL
    while refused.hits < 3:  # three renewals refused: a whole TTL (2 s, one every 2/3 s) without one
        assert time.monotonic() < end, "the holder never tried to renew its run claim"
        await asyncio.sleep(0.02)
    await put_checkpoint(world.s3, step=6, saved=datetime.now(timezone.utc),
                         files={"__0_0.distcp": b"r" * 50, ".metadata": b"m"})
    try:
        await asyncio.wait_for(working, timeout=60)
        raise AssertionError("a replica that could not renew its claim finished the run")
    except TemporaryError as e:
        assert f"lost: not renewed for {TTL:g}s" in str(e), str(e)
    assert world.events("Requeued") == []
