"""The margin kept before a preemption deadline, and the single-rank agreement."""

from __future__ import annotations

import pytest

from trainer.preemption import Agreement, DeadlinePlan

pytestmark = pytest.mark.unit


def plan(saves=(), steps=(), factor=1.5, margin=2.0) -> DeadlinePlan:
    p = DeadlinePlan(margin_factor=factor, margin_s=margin)
    for s in saves:
        p.record_save(s)
    for s in steps:
        p.record_step(s)
    return p


def test_the_save_budget_is_the_slowest_save_times_the_factor_plus_the_margin() -> None:
    assert plan(saves=[1.0, 3.0, 2.0]).save_budget_s() == pytest.approx(3.0 * 1.5 + 2.0)


def test_the_step_estimate_is_the_slowest_of_the_last_five_steps() -> None:
    assert plan(steps=[9.0, 1.0, 1.0, 1.0, 1.0, 2.0]).step_estimate_s() == 2.0


@pytest.mark.parametrize(
    ("seconds_left", "room"),
    [(100.0, True), (0.5 + 4.0 + 2.0, True), (0.5 + 4.0 + 2.0 - 0.01, False), (1.0, False)],
    ids=["far", "exactly-enough", "just-short", "too-late"],
)
def test_another_step_is_trained_only_if_it_and_a_save_fit(seconds_left: float, room: bool) -> None:
    p = plan(saves=[2.0], steps=[0.5], factor=2.0, margin=2.0)  # budget 6.0, step 0.5
    now = 1_000.0
    assert p.room_for_another_step(now=now, deadline_ms=int((now + seconds_left) * 1000)) is room


def test_without_a_deadline_there_is_always_room() -> None:
    assert plan(saves=[100.0]).room_for_another_step(now=0.0, deadline_ms=None)


def test_a_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="margin_factor"):
        DeadlinePlan(margin_factor=0.9, margin_s=1.0)


def test_one_rank_agrees_with_itself() -> None:
    agreed = Agreement(group=None, world_size=1).agree(
        ray_notice=False, sigterm=True, deadline_ms=1_700_000_000_123.0, stop=False, async_writing=True, step=7
    )
    assert (agreed.step_min, agreed.step_max) == (7, 7)
    assert agreed.notice and agreed.source == "sigterm" and agreed.deadline_ms == 1_700_000_000_123
    assert agreed.async_writing and not agreed.stop
    quiet = Agreement(group=None, world_size=1).agree(ray_notice=False, sigterm=False, deadline_ms=None)
    assert quiet.deadline_ms is None and not quiet.notice
