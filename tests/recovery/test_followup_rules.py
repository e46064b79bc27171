"""The follow-up's pure rules (``resilienced.followup.rules``): the verdict per look, when a requeue opens
a new follow-up, the record and target as JSON, what counts as overdue.  Tables, no I/O."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from resilienced.followup.rules import (
    Bounds,
    FollowUp,
    Stage,
    State,
    judge,
    opens_new,
    overdue,
    stages_for,
    stalled_key,
    target_from,
    target_json,
    unusable_now,
)
from resilienced.model import RunFacts, StageSeen, Target
from resilienced.recovery.steps import DurableStep, StepResults

pytestmark = pytest.mark.unit

T0 = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
BOUNDS = Bounds(admitted=timedelta(minutes=10), scheduled=timedelta(minutes=15), training=timedelta(minutes=15))
TARGET = Target(instance_id="i-0aaa", node="n1", ray_cluster="ml/rc", ray_job="ml/job", ray_node_ids=("ab",),
                checkpoint_uri="s3://b/runs/x",
                facts=RunFacts(instance_type="p5.48xlarge", capacity_type="spot", instance_ids=("i-0aaa",),
                               lost_instance_ids=("i-0aaa",), groups=("gpu",), moved_at=T0, elastic=True))


def record(*, stage: str = "scheduled", since: timedelta = timedelta(0), fallbacks: int = 0,
           state: str = "following", **extra) -> FollowUp:
    return FollowUp(run="ml/job", event_id="ev-1", kind="spot_interruption", notice_at=T0, opened_at=T0,
                    target=target_json(TARGET), capacity="capacity-block", reservation_id="cr-1",
                    stages=("admitted", "scheduled", "training"), stage=stage, stage_since=T0 + since,
                    fallbacks=tuple({"from": "spot", "to": "capacity-block cr-1"} for _ in range(fallbacks)),
                    state=state, **extra)


NOT_YET = StageSeen(False, "2 pods Unschedulable")


@pytest.mark.parametrize("rec, seen, after, action", [
    (record(), StageSeen(True, "bound"), timedelta(0), "advance"),
    (record(stage="training"), StageSeen(True, "trained"), timedelta(0), "resumed"),
    (record(), NOT_YET, timedelta(minutes=14, seconds=59), "wait"),
    (record(), NOT_YET, timedelta(minutes=15), "fall_back"),
    (record(stage="admitted"), NOT_YET, timedelta(minutes=10), "fall_back"),  # its own, shorter bound
    (record(since=timedelta(minutes=5)), NOT_YET, timedelta(minutes=15), "wait"),  # counted from its start
    (record(fallbacks=2), NOT_YET, timedelta(minutes=15), "stuck"),
    (record(fallbacks=1), NOT_YET, timedelta(minutes=15), "fall_back"),
    (record(state="stuck"), NOT_YET, timedelta(hours=5), "wait"),  # stuck: watched, never moved again
    (record(stage="training", elastic=True), NOT_YET, timedelta(minutes=15), "stuck"),  # never moved
], ids=["reached", "trains again", "within the bound", "past the bound", "admitted bound",
        "bound from the stage's start", "no move left", "one move left", "stuck", "elastic"])
def test_the_verdict_after_a_look(rec: FollowUp, seen: StageSeen, after: timedelta, action: str) -> None:
    verdict = judge(rec, seen, now=T0 + after, bounds=BOUNDS, max_fallbacks=2)
    assert verdict.action == action
    if action in ("fall_back", "stuck"):
        assert rec.stage in verdict.reason and "2 pods Unschedulable" in verdict.reason


@pytest.mark.parametrize("existing, event_id, changed, when, opens", [
    (None, "ev-2", False, T0, True),
    (record(), "ev-1", True, T0, False),  # a redelivery of the same event keeps it
    (record(), "ev-2", True, T0, True),  # a new move supersedes it
    (record(), "ev-2", False, T0, False),  # the run is still on its way back from ev-1
    (record(state="resumed", ended_at=T0 + timedelta(minutes=3)), "ev-2", False, T0 + timedelta(minutes=2), False),
    (record(state="resumed", ended_at=T0 + timedelta(minutes=3)), "ev-2", False, T0 + timedelta(minutes=4), True),
    (record(state="stuck"), "ev-2", False, T0, True),
], ids=["none yet", "redelivery", "a new move", "no change while followed", "news older than the end",
        "a new interruption after the end", "stuck"])
def test_when_a_requeue_opens_a_new_follow_up(existing, event_id, changed, when, opens) -> None:
    assert opens_new(existing, event_id=event_id, event_time=when, changed=changed) is opens


def test_the_record_and_its_target_survive_json() -> None:
    rec = record(unusable={"cr-1": (T0 + timedelta(minutes=30)).isoformat()}, moving={"to": {"capacity": "spot"}},
                 reached={"admitted": T0.isoformat()}, durable_step=12)
    back = FollowUp.from_json(rec.as_json(), version="7")
    assert back == rec and back.version == "7"
    target = target_from(back.target, exclude=("cr-1",))
    assert target.facts == replace(TARGET.facts, moved_at=T0.isoformat(), exclude=("cr-1",))
    assert (target.run_key, target.ray_node_ids, target.checkpoint_uri) == ("ml/job", ("ab",), "s3://b/runs/x")


@pytest.mark.parametrize("broken, field", [({"stage": "flying"}, "flying"), ({"notice_at": "noon"}, "noon"),
                                           ({"notice_at": "2026-08-20T12:00:00"}, "time zone")])
def test_a_malformed_record_is_refused_naming_what_is_wrong(broken: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FollowUp.from_json({**record().as_json(), **broken})


def test_overdue_is_a_stage_past_its_bound_or_stuck_and_never_an_ended_one() -> None:
    assert not overdue(record(), now=T0 + timedelta(minutes=14), bounds=BOUNDS)
    assert overdue(record(), now=T0 + timedelta(minutes=15), bounds=BOUNDS)
    assert overdue(record(state="stuck"), now=T0, bounds=BOUNDS)
    assert not overdue(record(state="resumed"), now=T0 + timedelta(hours=9), bounds=BOUNDS)


def test_the_stalled_capacity_and_its_cool_down() -> None:
    assert stalled_key("capacity-block", "cr-1") == "cr-1"  # the block, not every block
    assert stalled_key("spot", None) == "spot"
    rec = record(unusable={"cr-1": (T0 + timedelta(minutes=30)).isoformat(), "spot": (T0 - timedelta(1)).isoformat()})
    assert unusable_now(rec, now=T0) == ("cr-1",) and unusable_now(None, now=T0) == ()


def test_the_stages_by_where_the_run_lives() -> None:
    assert stages_for(mode="kubernetes", applier="kueue") == (Stage.ADMITTED, Stage.SCHEDULED, Stage.TRAINING)
    assert stages_for(mode="kubernetes", applier="kuberay") == (Stage.SCHEDULED, Stage.TRAINING)
    assert stages_for(mode="ray", applier="ray") == (Stage.JOINED, Stage.TRAINING)
    assert State.RESUMED.value == "resumed"


def test_the_follow_up_settings_have_their_documented_defaults_and_ranges() -> None:
    from resilienced.errors import ConfigError
    from resilienced.settings import Settings

    fs = Settings.from_args([], {}).follow_up
    fs.validate()
    assert (fs.follow_up, fs.admitted_bound_seconds, fs.scheduled_bound_seconds, fs.training_bound_seconds,
            fs.max_fallbacks, fs.fallback_cooldown_seconds) == (True, 600, 900, 900, 2, 1800)
    env = Settings.from_args([], {"RESILIENCED_FOLLOW_UP": "false", "RESILIENCED_MAX_FALLBACKS": "0"}).follow_up
    assert (env.follow_up, env.max_fallbacks) == (False, 0)
    for flags, named in ((["--max-fallbacks", "11"], "--max-fallbacks"),
                         (["--scheduled-bound-seconds", "1"], "--scheduled-bound-seconds")):
        with pytest.raises(ConfigError, match=named):
            Settings.from_args(flags, {}).follow_up.validate()


def test_a_follow_up_notification_says_how_the_run_came_back() -> None:
    from resilienced.ops.notify import render, slack_body

    facts = {"event_id": "ev-1", "kind": "spot_interruption", "run": "ml/job", "outcome": "resumed",
             "stage": "training", "capacity": "on-demand", "checkpoint_step": 27, "seconds_from_notice": 45}
    assert slack_body(facts)["text"] == ("resilienced: run ml/job trains again (stage training, capacity on-demand, "
                                         "45s after the notice; step 27)")
    assert "fell back" in slack_body({**facts, "outcome": "fell back"})["text"]
    assert render('{"s": "$stage after $seconds_from_notice s"}', {"stage": "training", "seconds_from_notice": "45"}) == {
        "s": "training after 45 s"}


async def test_a_new_move_replaces_the_open_follow_up_and_a_redelivery_keeps_it() -> None:
    from prometheus_client import CollectorRegistry

    from resilienced.doubles import MemoryFollowUps
    from resilienced.model import Capacity, Event, Kind, RequeueResult
    from resilienced.followup.follower import Follower, FollowUpMetrics

    registry = CollectorRegistry()
    follower = Follower(store=MemoryFollowUps(), cluster=None, progress=None,  # type: ignore[arg-type]
                        mover=None, objects=None, metrics=FollowUpMetrics(registry),  # type: ignore[arg-type]
                        clock=lambda: T0)

    def moved(capacity: Capacity, *, changes: tuple[str, ...] = ("patched",), **details) -> RequeueResult:
        return RequeueResult(run_key="ml/job", kind="kuberay", capacity=capacity, reason="r", changes=changes,
                             reservation_id="cr-1" if capacity is Capacity.CAPACITY_BLOCK else None, details=details)

    first = await follower.open(TARGET, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", time=T0),
                                result=moved(Capacity.CAPACITY_BLOCK),
                                steps=StepResults(durable=DurableStep(outcome="durable", step=9, world_size=2)))
    assert (first.stages, first.durable_step, first.durable_world_size) == (("scheduled", "training"), 9, 2)
    again = await follower.open(TARGET, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", time=T0),
                                result=moved(Capacity.CAPACITY_BLOCK, changes=()))
    assert again == first  # a redelivery keeps it
    second = await follower.open(TARGET, event=Event(kind=Kind.STATE_CHANGE, event_id="ev-2", time=T0),
                                 result=moved(Capacity.ON_DEMAND))
    assert (second.event_id, second.capacity) == ("ev-2", "on-demand") and (await follower.read("ml/job")) == second
    assert registry.get_sample_value("resilienced_recoveries_total", {"outcome": "superseded"}) == 1
    elastic = await follower.open(TARGET, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-3", time=T0),
                                  result=moved(Capacity.SPOT, elastic=True, lost=["i-0aaa"]))
    assert elastic.elastic and elastic.stages == ("training",)
    assert await follower.open(TARGET, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-4", time=T0),
                               result=moved(Capacity.WAIT, changes=())) is None  # nothing placed: nothing followed
