"""What a follow-up look writes (issue #45: API writes per run within 2x the floor).

The follow-up record (a Lease in kubernetes mode) is written when something must persist for this
replica and one that takes the follow-up over: the stages one look reaches are saved in one write
with the look's verdict (the end, or the wait's: the stage reached and its evidence), not one
write per stage; a look that waits where the last one waited, with the same evidence, writes
nothing.  Counted by the emulated API server over HTTP.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tests.support.kubeapi import KubeApiServer

from .conftest import instance, node
from .test_followup import BOUND, Follow, requeued_onto_the_block, resume_record, world  # noqa: F401 (fixture)
from .test_followup_reads import leases_written
from .test_recovery import BLOCK

pytestmark = pytest.mark.integration

BLOCK_LABELS = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": BLOCK,
                "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}


@pytest.fixture
async def block(world: Follow, kubeapi: KubeApiServer) -> None:
    """The world's run requeued onto the block whose Nodes exist: its workers are bound at once
    (KubeRay run: stages scheduled -> training)."""
    for name, n in (("b1", 11), ("b2", 12)):
        obj = node(name, instance(n), capacity="reserved")
        obj["metadata"]["labels"].update(BLOCK_LABELS)
        kubeapi.create(obj)
    await requeued_onto_the_block(world, when=world.clock[0])


@pytest.mark.usefixtures("block")
async def test_the_stages_one_look_reaches_are_one_write_of_the_record(world: Follow, kubeapi: KubeApiServer,
                                                                      s3: Any) -> None:
    await resume_record(s3, at=world.clock[0] + timedelta(seconds=5), step=5)  # trains before the first look
    world.later(timedelta(seconds=10))
    kubeapi.reset_log()
    (record,) = await world.pass_once()
    assert record.state == "resumed" and set(record.reached) == {"scheduled", "training"}
    assert leases_written(kubeapi) == 1, kubeapi.counts()  # the end, with both stages (was 2: one per stage)
    assert world.events("TrainingResumed")


@pytest.mark.usefixtures("block")
async def test_a_look_that_reaches_a_stage_and_waits_writes_once_and_a_wait_like_the_last_writes_nothing(
        world: Follow, kubeapi: KubeApiServer, s3: Any) -> None:
    kubeapi.reset_log()
    (record,) = await world.pass_once()  # scheduled; no attempt has trained yet
    assert (record.stage, record.state) == ("training", "following") and "scheduled" in record.reached
    assert "no attempt has trained a step since the notice" in (record.evidence or "")
    assert leases_written(kubeapi) == 1  # the stage reached and the evidence, one write
    stored = await world.record()
    assert stored["stage"] == "training" and stored["evidence"] == record.evidence  # a takeover sees it

    kubeapi.reset_log()
    world.later(timedelta(seconds=15))
    (again,) = await world.pass_once()
    assert (again.stage, again.version) == (record.stage, record.version) and leases_written(kubeapi) == 0

    await resume_record(s3, at=world.clock[0] + timedelta(seconds=1), step=5)
    world.later(timedelta(seconds=5))
    kubeapi.reset_log()
    (ended,) = await world.pass_once()
    assert ended.state == "resumed" and leases_written(kubeapi) == 1
    assert ended.stage_seconds()["scheduled"] < ended.stage_seconds()["training"]


async def test_new_evidence_in_the_stage_it_waited_in_is_written_once_the_stage_waited_half_its_bound(
        world: Follow, kubeapi: KubeApiServer, s3: Any) -> None:
    """A look's progress within a stage ("1 of 2 worker pods bound") is not written each time it
    changes (under load a run's record was written once per pod bound): the first evidence of the
    stage is, and new evidence again once the stage has waited half its bound (a stall nears:
    status shows why)."""
    _, scheduler = await requeued_onto_the_block(world, when=world.clock[0])  # no Node of the block
    world.later(timedelta(seconds=5))
    (record,) = await world.pass_once()
    assert record.stage == "scheduled" and (record.evidence or "").startswith("0 of 2 worker pod(s)")
    obj = node("b1", instance(11), capacity="reserved")
    obj["metadata"]["labels"].update(BLOCK_LABELS)
    kubeapi.create(obj)
    scheduler.step()  # one worker bound to the block's one Node; the other still unschedulable
    world.later(timedelta(seconds=5))
    kubeapi.reset_log()
    (again,) = await world.pass_once()
    assert (again.version, again.evidence) == (record.version, record.evidence) and leases_written(kubeapi) == 0
    world.later(BOUND / 2)
    kubeapi.reset_log()
    (late,) = await world.pass_once()
    assert late.stage == "scheduled" and (late.evidence or "").startswith("1 of 2 worker pod(s)"), late.evidence
    assert leases_written(kubeapi) == 1
    assert (await world.record())["evidence"] == late.evidence
