"""The drill's report, computed from what the trainer wrote (its metrics and events lines)."""

from __future__ import annotations

import asyncio
import dataclasses
import io

import pytest

from resilienced.local.drill import SAME_LOSSES, DrillOptions, report_from, restart_facts, world_size_schedule

pytestmark = pytest.mark.unit

NOTICE = 1000.0


def metrics(steps: range, *, attempt: int, t0: float, loss=lambda s: 10.0 / s, world_size: int = 2) -> list[dict]:
    return [{"step": s, "loss": loss(s), "world_size": world_size, "attempt": attempt, "time": t0 + i}
            for i, s in enumerate(steps)]


def reference(steps: int) -> dict[int, float]:
    return {s: 10.0 / s for s in range(1, steps + 1)}


def spot_run() -> tuple[list[dict], list[dict]]:
    """Notice at step 16 (saved at once), trained to 30 and saved, resumed at 31 on attempt 2."""
    m = metrics(range(1, 31), attempt=1, t0=NOTICE - 15) + metrics(range(31, 41), attempt=2, t0=NOTICE + 40)
    e = [{"event": "started", "time": NOTICE - 16, "attempt": 1, "resumed_from_step": None, "world_size": 2},
         {"event": "checkpoint_committed", "time": NOTICE - 6, "step": 10, "reason": "periodic"},
         {"event": "preemption_notice", "time": NOTICE + 0.7, "step": 16, "deadline_ms": 0, "source": "ray"},
         {"event": "checkpoint_committed", "time": NOTICE + 0.9, "step": 16, "reason": "preemption"},
         {"event": "checkpoint_committed", "time": NOTICE + 14, "step": 30, "reason": "preemption"},
         {"event": "started", "time": NOTICE + 39, "attempt": 2, "resumed_from_step": 30, "world_size": 2},
         {"event": "finished", "time": NOTICE + 50, "step": 40}]
    return m, e


def test_a_clean_spot_story_reports_no_step_lost() -> None:
    m, e = spot_run()
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=NOTICE + 1.5,
                         capacity="capacity-block", trainer_exit=0)
    assert report["ok"], report["checks"]
    assert (report["interrupted_at_step"], report["checkpoint_step"], report["resumed_at_step"],
            report["steps_lost"], report["steps_trained_twice"]) == (30, 30, 31, 0, 0)
    assert (report["notice_to_trainer_s"], report["notice_to_checkpoint_s"], report["notice_to_durable_s"],
            report["notice_to_resumed_s"]) == (0.7, 0.9, 1.5, 40.0)


@pytest.mark.parametrize(("change", "failed_check"), [
    (lambda m, e: m.append({**m[-1], "step": 25, "attempt": 2}), "losses match the uninterrupted run"),
    (lambda m, e: e.pop(), "run finished"),
    (lambda m, e: e.__setitem__(5, {**e[5], "resumed_from_step": 28}), "no step lost"),
], ids=["a-step-trained-twice-with-another-loss", "never-finished", "resumed-from-an-older-step"])
def test_a_broken_story_is_not_ok_and_says_which_check_failed(change, failed_check) -> None:
    m, e = spot_run()
    change(m, e)
    if failed_check == "losses match the uninterrupted run":
        m[-1]["loss"] = 1.0  # the repeated step 25 came out different
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=NOTICE + 1.5,
                         capacity="capacity-block", trainer_exit=0)
    assert not report["ok"] and report["checks"][failed_check] is False


def test_a_periodic_save_of_the_step_the_notice_arrived_at_is_the_notices_checkpoint() -> None:
    m, e = spot_run()
    e[3] = {"event": "checkpoint_committed", "time": NOTICE + 2.7, "step": 16, "reason": "periodic"}
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=None, capacity=None, trainer_exit=0)
    assert report["notice_to_checkpoint_s"] == 2.7


def test_an_abrupt_loss_counts_the_steps_since_the_last_periodic_checkpoint() -> None:
    m = metrics(range(1, 18), attempt=1, t0=NOTICE - 17) + metrics(range(11, 41), attempt=2, t0=NOTICE + 20)
    e = [{"event": "started", "time": NOTICE - 18, "attempt": 1, "resumed_from_step": None, "world_size": 2},
         {"event": "checkpoint_committed", "time": NOTICE - 8, "step": 10, "reason": "periodic"},
         {"event": "started", "time": NOTICE + 19, "attempt": 2, "resumed_from_step": 10, "world_size": 2},
         {"event": "finished", "time": NOTICE + 50, "step": 40}]
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15, scenario="abrupt"), metrics=m,
                         events=e, reference=reference(40), notice=NOTICE, durable_at=None,
                         capacity="capacity-block", trainer_exit=0)
    assert report["ok"], report["checks"]
    assert (report["steps_lost"], report["steps_trained_twice"], report["notice_to_checkpoint_s"]) == (7, 7, None)


def test_the_idle_worker_seconds_of_a_gang_restart() -> None:
    """Survivor and victim up from before the notice (the victim until 1025), the replacement from
    1030; the ranks (2) trained until 1014 and again from 1039 (one step before the first line)."""
    m, e = spot_run()
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=NOTICE + 1.5,
                         capacity="capacity-block", trainer_exit=0,
                         node_spans=[(900.0, None), (900.0, NOTICE + 25), (NOTICE + 30, None)])
    # up: 39 + 25 + 9 node-seconds in [notice, 1039]; training: 2 ranks x 14 s
    assert (report["back_to_full_s"], report["resumed_world_size"], report["worker_seconds_idle"]) == (39.0, 2, 45.0)
    assert report["ok"] and report["losses_match_uninterrupted"]
    # the gang waited for the replacement (joined at 1030): its restart counts from there
    assert report["restarts"] == [{"attempt": 2, "world_size": 2, "after": "node joined", "seconds": 10.0}]


def elastic_run(loss=lambda s: 10.0 / s) -> tuple[list[dict], list[dict]]:
    """3 ranks to step 30 (notice at 16), 2 ranks from 31 to 60, saved for the resize, 3 from 61."""
    m = (metrics(range(1, 31), attempt=1, t0=NOTICE - 15, loss=loss, world_size=3)
         + metrics(range(31, 61), attempt=2, t0=NOTICE + 30, loss=loss, world_size=2)
         + metrics(range(61, 81), attempt=3, t0=NOTICE + 75, loss=loss, world_size=3))
    e = [{"event": "started", "time": NOTICE - 16, "attempt": 1, "resumed_from_step": None, "world_size": 3},
         {"event": "preemption_notice", "time": NOTICE + 0.7, "step": 16, "deadline_ms": 0, "source": "ray"},
         {"event": "checkpoint_committed", "time": NOTICE + 0.9, "step": 16, "reason": "preemption"},
         {"event": "checkpoint_committed", "time": NOTICE + 14, "step": 30, "reason": "preemption"},
         {"event": "started", "time": NOTICE + 29, "attempt": 2, "resumed_from_step": 30, "world_size": 2},
         {"event": "resize_requested", "time": NOTICE + 60.5, "step": 60},
         {"event": "checkpoint_committed", "time": NOTICE + 61, "step": 60, "reason": "resize"},
         {"event": "started", "time": NOTICE + 74, "attempt": 3, "resumed_from_step": 60, "world_size": 3},
         {"event": "finished", "time": NOTICE + 95, "step": 80}]
    return m, e


ELASTIC = DrillOptions(scenario="elastic", workers=3, steps=80, interrupt_at_step=15)
ELASTIC_NODES = [(900.0, None), (900.0, None), (900.0, NOTICE + 25), (NOTICE + 60, None)]


def fixed_size(steps: int) -> dict[int, float]:
    """The fixed-size run: world size 3 throughout, so from step 31 (world size 2) on its float32
    rounding differs from the elastic run's (here by rel 1e-5)."""
    return {s: 10.0 / s * (1 + (1e-5 if s > 30 else 0.0)) for s in range(1, steps + 1)}


def test_an_elastic_story_reports_the_smaller_size_the_way_back_and_the_idle_worker_seconds() -> None:
    m, e = elastic_run()
    report = report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                         durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0, node_spans=ELASTIC_NODES,
                         fixed_reference=fixed_size(80))
    assert report["ok"], report["checks"]
    assert (report["steps_lost"], report["steps_trained_twice"], report["resumed_world_size"]) == (0, 0, 2)
    # up: 74 + 74 + 25 + 14 in [notice, 1074]; training: 3 ranks x 14 s + 2 ranks x 30 s
    assert (report["back_to_full_s"], report["worker_seconds_idle"]) == (74.0, 85.0)
    assert report["losses_match_uninterrupted"] and report["checks"][SAME_LOSSES]
    assert report["world_size_schedule"] == [(3, 30), (2, 60), (3, 80)]
    assert report["loss_diff_from_step"] == 31 and report["loss_max_rel_diff"] == pytest.approx(1e-5, rel=1e-3)
    # 3 -> 2: from the lost node's termination (1025) to the first step at 2 (1030); 2 -> 3: from
    # the resize request (1060.5, once the replacement joined at 1060) to the first step at 3 (1075)
    assert report["restarts"] == [{"attempt": 2, "world_size": 2, "after": "node gone", "seconds": 5.0},
                                  {"attempt": 3, "world_size": 3, "after": "resize", "seconds": 14.5}]


def test_a_schedule_is_the_world_size_of_each_step_as_last_trained() -> None:
    m, _ = elastic_run()
    m.append({**m[45], "step": 70, "world_size": 2, "attempt": 4, "time": NOTICE + 200})  # 70 again, at 2
    assert world_size_schedule(m) == [(3, 30), (2, 60), (3, 69), (2, 70), (3, 80)]
    assert world_size_schedule([]) == []


def test_a_restart_with_nothing_to_wait_for_counts_from_the_last_step() -> None:
    m = metrics(range(1, 11), attempt=1, t0=NOTICE) + metrics(range(11, 21), attempt=2, t0=NOTICE + 30)
    assert restart_facts(metrics=m, events=[], node_spans=[(900.0, None)]) == [
        {"attempt": 2, "world_size": 2, "after": "last step", "seconds": 21.0}]


@pytest.mark.parametrize(("change", "failed_check"), [
    (lambda m, e: m.__setitem__(40, {**m[40], "loss": m[40]["loss"] * 1.001}), SAME_LOSSES),
    (lambda m, e: m.__setitem__(40, {**m[40], "loss": m[40]["loss"] * (1 + 1e-9)}), SAME_LOSSES),
    (lambda m, e: [x.__setitem__("world_size", 3) for x in m if x["attempt"] == 2], "resumed at world size 2"),
    (lambda m, e: [x.__setitem__("world_size", 2) for x in m if x["attempt"] == 3], "back at world size 3"),
    (lambda m, e: m.append({**m[-1], "step": 70}), "no step trained twice"),
], ids=["a-loss-off-by-1e-3", "a-loss-off-by-1e-9", "never-smaller", "never-back-to-full", "a-step-trained-twice"])
def test_a_broken_elastic_story_says_which_check_failed(change, failed_check) -> None:
    m, e = elastic_run()
    change(m, e)
    report = report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                         durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0, node_spans=ELASTIC_NODES)
    assert not report["ok"] and report["checks"][failed_check] is False


@pytest.mark.parametrize(("options", "flag"), [
    (DrillOptions(scenario="elastic", workers=3, steps=80, node_boot_seconds=60), "--steps"),  # ends before it grows
    (DrillOptions(scenario="elastic", workers=1, steps=300), "--workers"),  # nobody left to go on
    (DrillOptions(scenario="elastic", workers=4, steps=300), "--workers"),  # 16 rows do not split over 3
    (DrillOptions(scenario="spot", node_boot_seconds=-1), "--node-boot-seconds"),
], ids=["elastic-too-short", "elastic-one-worker", "elastic-batch-uneven-at-min", "negative-boot"])
def test_a_drill_that_cannot_tell_its_story_is_refused_naming_the_flag(options: DrillOptions, flag: str) -> None:
    from resilienced.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        options.validate()
    assert info.value.setting == flag


def test_the_elastic_scenario_runs_the_trainer_elastic_and_its_reference_at_each_world_size(tmp_path) -> None:
    from resilienced.local.drill import Drill

    options = DrillOptions(scenario="elastic", workers=3, steps=300, node_boot_seconds=60).validate()
    drill = Drill(dataclasses.replace(options, workdir=str(tmp_path / "w")), out=io.StringIO())
    args = drill._trainer_args(ray_address="127.0.0.1:1", checkpoint_dir=tmp_path, metrics=tmp_path / "m",
                               events=None, pad=True)
    ref = drill._trainer_args(ray_address="local", checkpoint_dir=tmp_path, metrics=tmp_path / "r",
                              events=None, pad=False, workers=2, steps=120)  # a segment at world size 2
    flag = lambda argv, name: argv[argv.index(name) + 1]  # noqa: E731
    assert (flag(args, "--num-workers"), flag(args, "--min-workers"), flag(args, "--batch-size")) == ("3", "2", "12")
    assert (flag(ref, "--num-workers"), flag(ref, "--steps"), flag(ref, "--batch-size"), "--min-workers" in ref) \
        == ("2", "120", "12", False)
    assert flag(args, "--dropout") == flag(ref, "--dropout") == "0"
    spot = Drill(DrillOptions(workdir=str(tmp_path / "w")), out=io.StringIO())
    plain = spot._trainer_args(ray_address="local", checkpoint_dir=tmp_path, metrics=tmp_path / "m", events=None, pad=False)
    assert flag(plain, "--batch-size") == "8" and "--min-workers" not in plain and "--dropout" not in plain


def test_an_elastic_run_that_waited_for_its_replacement_resumes_at_full_size_once() -> None:
    """The replacement was due before shrinking would pay: one restart, at 3 (the decision is in
    the new group's ``restarted`` event); a wait that ended late is a shrink like any other."""
    m = (metrics(range(1, 31), attempt=1, t0=NOTICE - 15, world_size=3)
         + metrics(range(31, 81), attempt=2, t0=NOTICE + 40, world_size=3))
    e = [{"event": "started", "time": NOTICE - 16, "attempt": 1, "resumed_from_step": None, "world_size": 3},
         {"event": "preemption_notice", "time": NOTICE + 0.7, "step": 16, "deadline_ms": 0, "source": "ray"},
         {"event": "checkpoint_committed", "time": NOTICE + 0.9, "step": 16, "reason": "preemption"},
         {"event": "checkpoint_committed", "time": NOTICE + 14, "step": 30, "reason": "preemption"},
         {"event": "started", "time": NOTICE + 39, "attempt": 2, "resumed_from_step": 30, "world_size": 3},
         {"event": "restarted", "time": NOTICE + 40.1, "kind": "restart", "world_size": 3, "seconds": 9.0,
          "phases": {}, "decision": {"choice": "wait", "reason": "wait for the replacement until 40s from now: ...",
                                     "waited_s": 6.0, "outcome": "joined"}},
         {"event": "finished", "time": NOTICE + 95, "step": 80}]
    report = report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                         durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0,
                         node_spans=[(900.0, None), (900.0, None), (900.0, NOTICE + 25), (NOTICE + 30, None)])
    assert report["ok"], report["checks"]
    assert report["checks"]["waited for the replacement and resumed at world size 3"]
    assert report["elastic_decision"].startswith("wait for the replacement")
    assert report["restarts"] == [{"attempt": 2, "world_size": 3, "after": "node joined", "seconds": 10.0}]
    e[5]["decision"]["outcome"] = "late"  # it waited in vain, then shrank: yet it resumed at 3
    assert report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                       durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0)["checks"][
        "resumed at world size 2"] is False


def test_a_failed_drill_can_say_what_the_trainer_and_the_daemon_last_logged(tmp_path) -> None:
    """A failed drill prints these tails before its work dir, with the logs, is removed."""
    from resilienced.local.drill import FAILURE_TAIL_LINES, Drill

    drill = Drill(dataclasses.replace(DrillOptions(), workdir=str(tmp_path / "w")), out=io.StringIO())
    drill.workdir.mkdir()
    assert drill.logs_tail() == ""  # nothing written yet: nothing to print
    trainer = [f"trainer line {i}" for i in range(FAILURE_TAIL_LINES + 5)]
    (drill.workdir / "trainer.log").write_text("\n".join(trainer) + "\n")
    (drill.workdir / "daemon.log").write_text('{"event": "started"}\n')
    tail = drill.logs_tail().splitlines()
    assert tail[0] == f"--- the last {FAILURE_TAIL_LINES} lines of trainer.log:"
    assert tail[1:FAILURE_TAIL_LINES + 1] == trainer[-FAILURE_TAIL_LINES:]
    assert tail[FAILURE_TAIL_LINES + 1:] == ["--- the last 1 lines of daemon.log:", '{"event": "started"}']


async def test_a_wait_on_the_trainer_s_progress_ends_naming_why_when_nothing_reads_it_any_more(tmp_path) -> None:
    """The drill's waits read the trainer's metrics that its watch task tails: a watch that died
    ends the wait at once with its error, not at the wait's bound as a stalled run."""
    from resilienced.local.drill import Drill, DrillError

    drill = Drill(dataclasses.replace(DrillOptions(), workdir=str(tmp_path / "w")), out=io.StringIO())

    async def watch() -> None:
        raise KeyError("step")

    drill._watcher = asyncio.create_task(watch())
    await asyncio.wait({drill._watcher})
    with pytest.raises(DrillError, match=r"stopped reading the trainer's progress while waiting for step 6: "
                                         r"KeyError: 'step'"):
        await asyncio.wait_for(drill._until(lambda: False, what="step 6", timeout=3600), timeout=60)


def test_the_drill_reads_the_daemons_decision_through_the_typed_steps(tmp_path) -> None:
    """The drill's timeline line, durable time, capacity and elastic replacement come from the run
    reports of the outcome (``StepResults.from_json``), as the responder writes them."""
    from datetime import datetime, timezone

    from resilienced.local.drill import Drill
    from resilienced.model import Capacity, Event, Kind, Outcome, RequeueResult, Result, Verdict
    from resilienced.recovery.responder import RunReport
    from resilienced.recovery.steps import DurableStep, RequeueStep, SignalStep, StepResults

    notice = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
    replacement = {"expected_at": "2026-08-20T12:03:00+00:00", "capacity": "on-demand"}
    report = RunReport(run="ray://drill", instances=["i-1"], steps=StepResults(
        signal=SignalStep(deadline=notice, drained={"n1": "accepted", "n2": "accepted"}),
        durable=DurableStep(outcome="durable", step=16, world_size=2, notice_to_durable_s=3.5),
        requeue=RequeueStep.of(RequeueResult(run_key="ray://drill", kind="ray", capacity=Capacity.ON_DEMAND,
                                             reason="no Spot", changes=("+2 nodes",)), replacement=replacement)))
    out = io.StringIO()
    drill = Drill(DrillOptions(workdir=str(tmp_path)), out=out)
    drill._observe(None, Outcome(result=Result.DONE, event=Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", time=notice),
                                 details={"runs": [report.as_json(), {"run": "other", "retry": "busy"}]}),
                   Verdict.DELETE, 0.1)
    assert (drill.durable_at, drill.capacity, drill.replacement) == (notice.timestamp() + 3.5, "on-demand", replacement)
    assert out.getvalue().rstrip().endswith(
        "daemon   spot_interruption: done (drained 2 node(s); checkpoint step 16 durable in S3; "
        "requeue -> on-demand: no Spot)")
