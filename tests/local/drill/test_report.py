"""The drill's report, computed from what the trainer wrote (its metrics and events lines)."""

from __future__ import annotations

import dataclasses
import io

import pytest

from resilienced.local.drill import DrillOptions, report_from

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
    assert report["ok"] and report["losses_within_tolerance"]


def elastic_run(loss=lambda s: 10.0 / s * (1 + 1e-6)) -> tuple[list[dict], list[dict]]:
    """3 ranks to step 30 (notice at 16), 2 ranks from 31 to 60, saved for the resize, 3 from 61."""
    m = (metrics(range(1, 31), attempt=1, t0=NOTICE - 15, loss=loss, world_size=3)
         + metrics(range(31, 61), attempt=2, t0=NOTICE + 30, loss=loss, world_size=2)
         + metrics(range(61, 81), attempt=3, t0=NOTICE + 75, loss=loss, world_size=3))
    e = [{"event": "started", "time": NOTICE - 16, "attempt": 1, "resumed_from_step": None, "world_size": 3},
         {"event": "preemption_notice", "time": NOTICE + 0.7, "step": 16, "deadline_ms": 0, "source": "ray"},
         {"event": "checkpoint_committed", "time": NOTICE + 0.9, "step": 16, "reason": "preemption"},
         {"event": "checkpoint_committed", "time": NOTICE + 14, "step": 30, "reason": "preemption"},
         {"event": "started", "time": NOTICE + 29, "attempt": 2, "resumed_from_step": 30, "world_size": 2},
         {"event": "checkpoint_committed", "time": NOTICE + 60, "step": 60, "reason": "resize"},
         {"event": "started", "time": NOTICE + 74, "attempt": 3, "resumed_from_step": 60, "world_size": 3},
         {"event": "finished", "time": NOTICE + 95, "step": 80}]
    return m, e


ELASTIC = DrillOptions(scenario="elastic", workers=3, steps=80, interrupt_at_step=15)
ELASTIC_NODES = [(900.0, None), (900.0, None), (900.0, NOTICE + 25), (NOTICE + 60, None)]


def test_an_elastic_story_reports_the_smaller_size_the_way_back_and_the_idle_worker_seconds() -> None:
    m, e = elastic_run()
    report = report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                         durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0, node_spans=ELASTIC_NODES)
    assert report["ok"], report["checks"]
    assert (report["steps_lost"], report["steps_trained_twice"], report["resumed_world_size"]) == (0, 0, 2)
    # up: 74 + 74 + 25 + 14 in [notice, 1074]; training: 3 ranks x 14 s + 2 ranks x 30 s
    assert (report["back_to_full_s"], report["worker_seconds_idle"]) == (74.0, 85.0)
    assert report["losses_within_tolerance"] and not report["losses_match_uninterrupted"]


@pytest.mark.parametrize(("change", "failed_check"), [
    (lambda m, e: m.__setitem__(40, {**m[40], "loss": m[40]["loss"] * 1.001}), "losses within rel 0.0001 of the uninterrupted run"),
    (lambda m, e: [x.__setitem__("world_size", 3) for x in m if x["attempt"] == 2], "resumed at world size 2"),
    (lambda m, e: [x.__setitem__("world_size", 2) for x in m if x["attempt"] == 3], "back at world size 3"),
    (lambda m, e: m.append({**m[-1], "step": 70}), "no step trained twice"),
], ids=["a-loss-off-by-1e-3", "never-smaller", "never-back-to-full", "a-step-trained-twice"])
def test_a_broken_elastic_story_says_which_check_failed(change, failed_check) -> None:
    m, e = elastic_run()
    change(m, e)
    report = report_from(options=ELASTIC, metrics=m, events=e, reference=reference(80), notice=NOTICE,
                         durable_at=NOTICE + 1.5, capacity="capacity-block", trainer_exit=0, node_spans=ELASTIC_NODES)
    assert not report["ok"] and report["checks"][failed_check] is False


@pytest.mark.parametrize(("options", "flag"), [
    (DrillOptions(scenario="elastic", workers=3, steps=80, node_boot_seconds=60), "--steps"),  # ends before it grows
    (DrillOptions(scenario="elastic", workers=1, steps=300), "--workers"),  # nobody left to go on
    (DrillOptions(scenario="spot", node_boot_seconds=-1), "--node-boot-seconds"),
], ids=["elastic-too-short", "elastic-one-worker", "negative-boot"])
def test_a_drill_that_cannot_tell_its_story_is_refused_naming_the_flag(options: DrillOptions, flag: str) -> None:
    from resilienced.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        options.validate()
    assert info.value.setting == flag


def test_the_elastic_scenario_runs_the_trainer_elastic_and_its_reference_on_one_process(tmp_path) -> None:
    from resilienced.local.drill import Drill

    options = DrillOptions(scenario="elastic", workers=3, steps=300, node_boot_seconds=60).validate()
    drill = Drill(dataclasses.replace(options, workdir=str(tmp_path / "w")), out=io.StringIO())
    args = drill._trainer_args(ray_address="127.0.0.1:1", checkpoint_dir=tmp_path, metrics=tmp_path / "m",
                               events=None, pad=True)
    ref = drill._trainer_args(ray_address="local", checkpoint_dir=tmp_path, metrics=tmp_path / "r",
                              events=None, pad=False)
    flag = lambda argv, name: argv[argv.index(name) + 1]  # noqa: E731
    assert (flag(args, "--num-workers"), flag(args, "--min-workers"), flag(args, "--batch-size")) == ("3", "2", "12")
    assert (flag(ref, "--num-workers"), flag(ref, "--batch-size"), "--min-workers" in ref) == ("1", "12", False)
    assert flag(args, "--dropout") == flag(ref, "--dropout") == "0"
    spot = Drill(DrillOptions(workdir=str(tmp_path / "w")), out=io.StringIO())
    plain = spot._trainer_args(ray_address="local", checkpoint_dir=tmp_path, metrics=tmp_path / "m", events=None, pad=False)
    assert flag(plain, "--batch-size") == "8" and "--min-workers" not in plain and "--dropout" not in plain
