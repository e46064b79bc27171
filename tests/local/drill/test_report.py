"""The drill's report, computed from what the trainer wrote (its metrics and events lines)."""

from __future__ import annotations

import pytest

from resilienced.local.drill import DrillOptions, report_from

NOTICE = 1000.0


def metrics(steps: range, *, attempt: int, t0: float, loss=lambda s: 10.0 / s) -> list[dict]:
    return [{"step": s, "loss": loss(s), "world_size": 2, "attempt": attempt, "time": t0 + i}
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
