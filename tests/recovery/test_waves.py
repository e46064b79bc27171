"""A run's notices in flight in one replica are one wave (resilienced/recovery/waves.py, issue #45):
joiners' instances go into the move until it begins, and every joiner gets the leader's outcome."""

from __future__ import annotations

import asyncio

import pytest

from resilienced.errors import PermanentError, TemporaryError
from resilienced.model import RunFacts, Step, Target
from resilienced.recovery.waves import Waves

pytestmark = pytest.mark.unit

SPOT = (Step.SIGNAL, Step.DURABLE, Step.REQUEUE)


def target(i: int, *, run: str = "ns/train") -> Target:
    return Target(instance_id=f"i-{i}", node=f"node-{i}", ray_cluster="ns/rc", ray_job=run,
                  ray_node_ids=(f"ray-{i}",), checkpoint_uri="s3://b/p",
                  facts=RunFacts(instance_ids=(f"i-{i}",), lost_instance_ids=(f"i-{i}",)))


async def test_joiners_before_the_move_are_in_it_and_share_the_outcome() -> None:
    waves: Waves[str] = Waves()
    async with waves.lead("ns/train", event_id="e1", steps=SPOT) as wave:
        assert waves.current("ns/train") is wave and wave.covers(SPOT)
        assert wave.covers((Step.SIGNAL, Step.COMPLETE_LIFECYCLE))  # the hook is the notice's own
        assert not wave.covers((Step.NOTIFY,))
        assert wave.join(target(2)) and wave.join(target(3))
        moved = wave.begin_move(target(1))
        assert moved.facts.lost_instance_ids == ("i-1", "i-2", "i-3")
        assert moved.facts.instance_ids == ("i-1", "i-2", "i-3")
        assert moved.ray_node_ids == ("ray-1", "ray-2", "ray-3")
        assert not wave.join(target(4))  # the move began: its instance is not in it
        waiting = asyncio.ensure_future(asyncio.shield(wave.ended))
        wave.finish("done")
    assert await waiting == "done"
    assert waves.current("ns/train") is None and len(waves) == 0


@pytest.mark.parametrize("error", [TemporaryError("GCS down", delay=3), PermanentError("no such run")])
async def test_the_leaders_error_is_every_joiners(error: Exception) -> None:
    waves: Waves[str] = Waves()
    with pytest.raises(type(error)):
        async with waves.lead("ns/train", event_id="e1", steps=SPOT) as wave:
            joiner = asyncio.ensure_future(asyncio.shield(wave.ended))
            raise error
    with pytest.raises(type(error)) as got:
        await joiner
    assert got.value is error and waves.current("ns/train") is None


async def test_a_stopped_leader_sends_its_joiners_back_to_the_queue() -> None:
    waves: Waves[str] = Waves()
    started = asyncio.Event()
    joined: list[asyncio.Future[str]] = []

    async def leader() -> None:
        async with waves.lead("ns/train", event_id="e1", steps=SPOT) as wave:
            joined.append(asyncio.ensure_future(asyncio.shield(wave.ended)))
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(leader())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TemporaryError, match="was stopped"):
        await joined[0]


async def test_one_wave_per_run_at_a_time() -> None:
    waves: Waves[str] = Waves()
    async with waves.lead("ns/train", event_id="e1", steps=SPOT) as wave:
        async with waves.lead("ns/other", event_id="e1", steps=SPOT):
            assert len(waves) == 2
        with pytest.raises(RuntimeError):
            async with waves.lead("ns/train", event_id="e2", steps=SPOT):
                pass
        wave.finish("done")


async def test_a_reserved_wave_is_joined_before_its_leader_leads_it_and_dropped_if_it_does_not() -> None:
    waves: Waves[str] = Waves()
    reserved = waves.reserve("ns/train", event_id="e1", steps=SPOT)
    assert reserved is not None and waves.reserve("ns/train", event_id="e2", steps=SPOT) is None
    assert waves.reserved_for("ns/train", "e1") and not waves.reserved_for("ns/train", "e2")
    assert reserved.join(target(2))  # a notice asked meanwhile joins it
    async with waves.lead("ns/train", event_id="e1", steps=SPOT) as wave:
        assert wave is reserved and not waves.reserved_for("ns/train", "e1")
        waves.unreserve("e1")  # led: not dropped
        assert waves.current("ns/train") is wave
        assert wave.begin_move(target(1)).facts.lost_instance_ids == ("i-1", "i-2")
        wave.finish("done")
    assert len(waves) == 0

    dropped = waves.reserve("ns/train", event_id="e3", steps=SPOT)
    assert dropped is not None
    joiner = asyncio.ensure_future(asyncio.shield(dropped.ended))
    waves.unreserve("e3")  # its event claim was another delivery's: it never leads
    with pytest.raises(TemporaryError, match="did not lead"):
        await joiner
    assert waves.current("ns/train") is None
    with pytest.raises(RuntimeError):  # a wave reserved for another notice is not led by this one
        waves.reserve("ns/train", event_id="e4", steps=SPOT)
        async with waves.lead("ns/train", event_id="e5", steps=SPOT):
            pass
