"""The recovery's typed step results (``resilienced.recovery.steps``): the JSON each writes is the
one the run's record, the log line and the notification have always carried (the literal shapes
below), it reads back to the same value through ``StepResults.from_json``, and a record of the wrong
form is an error naming the field.  Tables, no I/O."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import structlog

from resilienced.app.status import rows
from resilienced.errors import RecordError
from resilienced.model import Capacity, CapacityDecision, RequeueResult
from resilienced.ops.run_record import RunRecord
from resilienced.recovery.steps import (
    DurableStep,
    FollowUpStep,
    NotifyStep,
    RequeueStep,
    ResumeStep,
    SignalStep,
    StepResults,
)

pytestmark = pytest.mark.unit

DEADLINE = datetime(2026, 8, 20, 12, 2, tzinfo=timezone.utc)
EVENT = "7e9d2f6c-0000-4000-8000-000000000001"

#: Each step as the responder wrote it before the steps were typed (its keys and values, in order).
WRITTEN = {
    "notify": (NotifyStep("RebalanceRecommendation"), "RebalanceRecommendation"),
    "signal": (SignalStep(deadline=DEADLINE, drained={"01" * 28: "accepted", "02" * 28: "already_draining"}),
               {"deadline": "2026-08-20T12:02:00+00:00", "drained": {"01" * 28: "accepted",
                                                                    "02" * 28: "already_draining"}}),
    "durable verified": (DurableStep(outcome="durable", step=37, world_size=2, notice_to_durable_s=4.125,
                                     export_tasks=("task-1",)),
                         {"verified": True, "step": 37, "world_size": 2, "notice_to_durable_s": 4.125,
                          "export_tasks": ["task-1"]}),
    "durable not durable": (DurableStep(outcome="not_durable", reason="deadline passed", resume_step=30,
                                        steps_lost=7, rejected=("step 36: a file is missing",)),
                            {"verified": False, "reason": "deadline passed", "resume_step": 30, "steps_lost": 7,
                             "rejected": ["step 36: a file is missing"]}),
    "durable nothing at all": (DurableStep(outcome="not_durable", reason="no checkpoint"),
                               {"verified": False, "reason": "no checkpoint", "resume_step": None,
                                "steps_lost": None, "rejected": []}),
    "durable unchecked": (DurableStep(outcome="unchecked", reason="no object store configured"),
                          {"verified": False, "reason": "no object store configured"}),
    "resume": (ResumeStep(resume_step=30, checkpoint_age_s=31.5), {"resume_step": 30, "checkpoint_age_s": 31.5}),
    "resume from scratch": (ResumeStep(resume_step=None, reason="no durable checkpoint: the run starts over"),
                            {"resume_step": None, "reason": "no durable checkpoint: the run starts over"}),
    "requeue unconfigured": (RequeueStep.unconfigured("no capacity planner or requeuer configured"),
                             {"capacity": None, "reason": "no capacity planner or requeuer configured"}),
    "follow_up": (FollowUpStep(event_id=EVENT, stage="admitted", stages=("admitted", "scheduled", "training"),
                               capacity="capacity-block cr-1"),
                  {"event_id": EVENT, "stage": "admitted", "stages": ["admitted", "scheduled", "training"],
                   "capacity": "capacity-block cr-1"}),
}


@pytest.mark.parametrize("name", WRITTEN)
def test_each_step_writes_the_json_it_always_wrote_and_reads_it_back(name: str) -> None:
    step, written = WRITTEN[name]
    assert json.dumps(step.as_json()) == json.dumps(written)  # keys, order and values
    assert type(step).from_json(written) == step


@pytest.mark.parametrize("result, replacement, written", [
    (RequeueResult(run_key="ml/job", kind="kueue", capacity=Capacity.CAPACITY_BLOCK, reason="no Spot",
                   reservation_id="cr-1", changes=("steered to cr-1",), retry_after=None,
                   decision=CapacityDecision(capacity=Capacity.CAPACITY_BLOCK, reason="no Spot"),
                   details={"elastic": False}), None,
     {"run": "ml/job", "kind": "kueue", "capacity": "capacity-block", "reason": "no Spot", "changes": ["steered to cr-1"],
      "dry_run": False, "reservation_id": "cr-1", "details": {"elastic": False}}),
    (RequeueResult(run_key="ml/job", kind="ray", capacity=Capacity.WAIT, reason="nothing free", dry_run=True,
                   retry_after=timedelta(seconds=90)), None,
     {"run": "ml/job", "kind": "ray", "capacity": "wait", "reason": "nothing free", "changes": [], "dry_run": True,
      "retry_after_seconds": 90.0}),
    (RequeueResult(run_key="ml/job", kind="kuberay", capacity=Capacity.SPOT, reason="refused", refused=True),
     None, {"run": "ml/job", "kind": "kuberay", "capacity": "spot", "reason": "refused", "changes": [],
            "dry_run": False, "refused": True}),
    (RequeueResult(run_key="ml/job", kind="ray", capacity=Capacity.SPOT, reason="spot", changes=("+1 node",),
                   details={"elastic": True, "lost": ["i-0aaa"]}),
     {"expected_at": "2026-08-20T12:05:00+00:00", "capacity": "spot"},
     {"run": "ml/job", "kind": "ray", "capacity": "spot", "reason": "spot", "changes": ["+1 node"], "dry_run": False,
      "details": {"elastic": True, "lost": ["i-0aaa"]},
      "replacement": {"expected_at": "2026-08-20T12:05:00+00:00", "capacity": "spot"}}),
], ids=["kueue block", "ray wait dry run", "refused", "elastic with replacement"])
def test_the_requeue_step_is_the_requeue_result_and_its_replacement(result: RequeueResult,
                                                                    replacement: dict | None, written: dict) -> None:
    """The requeue step writes the keys the recovery wrote before the steps were typed (then
    ``RequeueResult.as_json``, which only the step's JSON used and is gone), in their order."""
    step = RequeueStep.of(result, replacement=replacement)
    assert json.dumps(step.as_json()) == json.dumps(written)
    assert RequeueStep.from_json(written) == step


def test_a_runs_steps_read_back_from_its_record_in_the_order_they_ran() -> None:
    steps = StepResults(signal=WRITTEN["signal"][0], durable=WRITTEN["durable not durable"][0],
                        requeue=RequeueStep.of(RequeueResult(run_key="ml/job", kind="kueue", capacity=Capacity.SPOT,
                                                             reason="spot", changes=("x",))),
                        follow_up=WRITTEN["follow_up"][0])
    record = RunRecord(run="ml/job", instances=("i-1",), steps=steps, event_id=EVENT, kind="spot_interruption",
                       outcome="done")
    written = record.as_json()
    assert list(written) == ["run", "instances", "signal", "durable", "requeue", "follow_up", "event_id", "kind",
                             "event_time", "done_at", "outcome"]
    assert RunRecord.from_json(json.loads(json.dumps(written))) == record
    assert (steps.checkpoint_step, steps.checkpoint_world_size) == (30, None)
    assert StepResults.from_json({"run": "ml/job", "retry": "busy"}) == StepResults()  # no step: none read


@pytest.mark.parametrize("details, field", [
    ({"durable": {"verified": True, "step": "thirty"}}, "durable.step"),
    ({"durable": {"step": 3}}, "durable.verified"),
    ({"durable": ["verified"]}, "durable"),
    ({"durable": {"verified": False, "resume_step": True}}, "durable.resume_step"),
    ({"signal": {"deadline": "soon", "drained": {}}}, "signal.deadline"),
    ({"signal": {"deadline": "2026-08-20T12:02:00+00:00", "drained": {"n1": 1}}}, "signal.drained.n1"),
    ({"requeue": {"capacity": "somewhere", "reason": "x"}}, "requeue.capacity"),
    ({"requeue": {"capacity": "spot", "changes": "patched"}}, "requeue.changes"),
    ({"resume": {"resume_step": 3, "checkpoint_age_s": "old"}}, "resume.checkpoint_age_s"),
    ({"follow_up": {"event_id": EVENT, "stages": []}}, "follow_up.stage"),
    ({"notify": {"reason": "x"}}, "notify"),
])
def test_a_record_of_the_wrong_form_is_an_error_naming_the_field(details: dict, field: str) -> None:
    with pytest.raises(RecordError) as raised:
        StepResults.from_json(details)
    assert raised.value.field == field
    assert str(raised.value).startswith((f"{field}: expected", f"{field}: missing")), str(raised.value)
    with pytest.raises(RecordError, match=f"^{field}: "):
        RunRecord.from_json({"run": "ml/job", **details})


def test_status_leaves_out_a_record_it_cannot_read_and_says_which() -> None:
    good = {"run": "ml/a", "instances": ["i-1"], "event_id": EVENT, "done_at": "2026-12-05T08:01:00+00:00",
            "durable": {"verified": True, "step": 9, "world_size": 2, "notice_to_durable_s": 1.0, "export_tasks": []}}
    bad = {**good, "run": "ml/b", "durable": {"verified": True, "step": "nine"}}
    with structlog.testing.capture_logs() as logs:
        shown = rows([(f"run/{EVENT}/ml/a", good), (f"run/{EVENT}/ml/b", bad)])
    assert [(r["run"], r["checkpoint_step"], r["durable"]) for r in shown] == [("ml/a", 9, True)]
    assert [(e["event"], e["key"], e["error"]) for e in logs if e["log_level"] == "warning"] == [
        ("unreadable run record", f"run/{EVENT}/ml/b", "durable.step: expected an integer or null, got 'nine'")]
