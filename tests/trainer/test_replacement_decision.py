"""Shrink now or wait for the replacement (``trainer.replacement``), and the restart clock it weighs
(``trainer.restarts``): pure code, a virtual clock, files in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import replacement, restarts
from trainer.replacement import Expected, decide, wait_for_replacement

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
NODE = "ab" * 28


def record(*, asked_at: float = NOW - 20, join: float | None = 60.0, basis: str = "prior") -> bytes:
    return json.dumps({"lost_instance_id": "i-0123456789abcdef0", "capacity": "capacity-block",
                       "asked_at": asked_at, "expected_join_s": join, "basis": basis}).encode()


def expected(join: float | None, **kwargs) -> list[Expected]:
    return [Expected.parse(NODE, record(join=join, **kwargs))]


@pytest.mark.parametrize(("join", "restart_s", "wait"), [
    (40.0, 30.0, True),    # expected in 20 s, a restart costs 30: shrinking gains nothing
    (50.0, 30.0, True),    # in 30 s: before the break-even, 30 + 2 / (2 * 2) = 30.5
    (51.0, 30.0, False),   # in 31 s: past it
    (200.0, 30.0, False),  # in 180 s: the survivors train 150 s at 2 for one more restart
    (20.0, 30.0, True),    # the node is already due (expected in 0 s)
], ids=["soon", "just-before-break-even", "just-past-break-even", "late", "due-now"])
def test_the_run_waits_when_the_replacement_comes_before_shrinking_pays(join, restart_s, wait) -> None:
    d = decide(now=NOW, expected=expected(join), restart_s=restart_s, survivors=2, resize_interval_s=2.0)
    w = NOW - 20 + join - NOW
    assert d.wait is (w <= restart_s + 2.0 / 4) is wait, d.reason
    assert d.expected_at == NOW - 20 + join
    if wait:  # at most until the expected join plus one restart
        assert d.wait_until == d.expected_at + restart_s
        assert d.reason.startswith("wait for the replacement")
    else:
        assert d.wait_until is None and d.reason.startswith("shrink now")


def test_the_break_even_counts_the_resize_interval_over_the_survivors() -> None:
    """W > R + d / (2 n): with Ray's default 60 s interval and 2 survivors, 15 s more than R."""
    at = lambda w: decide(now=NOW, expected=expected(20.0 + w), restart_s=30.0, survivors=2,  # noqa: E731
                          resize_interval_s=60.0)
    assert at(45.0).wait and not at(45.5).wait
    assert decide(now=NOW, expected=expected(20.0 + 45.5), restart_s=30.0, survivors=1,
                  resize_interval_s=60.0).wait  # one survivor: the interval weighs twice as much


@pytest.mark.parametrize(("raw", "why"), [
    (None, "no record from the daemon"),
    (record(join=None, basis="no capacity: wait"), "no capacity: wait"),
    (b"{not json", "unreadable record"),
    (json.dumps({"asked_at": "yesterday", "expected_join_s": 5}).encode(), "unreadable record"),
], ids=["no-record", "no-capacity", "not-json", "bad-time"])
def test_without_an_estimate_the_run_shrinks_at_once(raw, why) -> None:
    d = decide(now=NOW, expected=[Expected.parse(NODE, raw)], restart_s=30.0, survivors=2, resize_interval_s=2.0)
    assert d.wait_until is None and why in d.reason


def test_without_a_measured_restart_the_run_shrinks_at_once() -> None:
    d = decide(now=NOW, expected=expected(40.0), restart_s=None, survivors=2, resize_interval_s=2.0)
    assert d.wait_until is None and "no restart" in d.reason


def test_two_lost_nodes_wait_for_the_later_replacement_and_none_if_one_is_not_coming() -> None:
    soon, later = Expected(NODE, NOW + 5), Expected("cd" * 28, NOW + 25)
    d = decide(now=NOW, expected=[soon, later], restart_s=30.0, survivors=1, resize_interval_s=2.0)
    assert d.expected_at == NOW + 25 and d.wait_until == NOW + 55
    assert not decide(now=NOW, expected=[soon, Expected("cd" * 28, None, "no capacity")], restart_s=30.0,
                      survivors=1, resize_interval_s=2.0).wait


def test_a_wait_is_never_longer_than_max_wait_s() -> None:
    d = decide(now=NOW, expected=[Expected(NODE, NOW + 500)], restart_s=900.0, survivors=2,
               resize_interval_s=2.0, max_wait_s=600.0)
    assert d.wait_until == NOW + 600


class Clock:
    """A virtual clock: ``sleep`` advances it."""

    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 1e-3)


def test_a_wrong_estimate_costs_a_bounded_wait_then_the_run_shrinks() -> None:
    """The daemon expected the node 20 s from now; it never comes.  The run waits until the
    expected join plus one restart (50 s), not a moment longer, then shrinks."""
    clock = Clock()
    d = decide(now=clock(), expected=[Expected(NODE, NOW + 20)], restart_s=30.0, survivors=2, resize_interval_s=2.0)
    assert d.wait
    outcome = wait_for_replacement(until=d.wait_until, room=lambda: False, still_expected=lambda: True,
                                   clock=clock, sleep=clock.sleep)
    assert outcome == "late" and clock() == pytest.approx(NOW + 50, abs=0.01)


def test_the_wait_ends_when_the_replacement_joins() -> None:
    clock = Clock()
    outcome = wait_for_replacement(until=NOW + 50, room=lambda: clock() >= NOW + 12, still_expected=lambda: True,
                                   clock=clock, sleep=clock.sleep)
    assert outcome == "joined" and clock() < NOW + 13


def test_the_wait_ends_when_the_daemon_says_the_replacement_is_not_coming() -> None:
    clock = Clock()
    outcome = wait_for_replacement(until=NOW + 50, room=lambda: False, still_expected=lambda: clock() < NOW + 7,
                                   clock=clock, sleep=clock.sleep, recheck_s=5.0)
    assert outcome == "not coming" and NOW + 7 <= clock() < NOW + 11


def test_the_record_key_and_namespace_are_the_daemons() -> None:
    from resilienced.ray.replacement import KEY_PREFIX
    from resilienced.ray.gcs import KV_NAMESPACE

    assert replacement.key(NODE) == f"replacement/{NODE}" == f"{KEY_PREFIX}{NODE}"
    assert replacement.NAMESPACE == KV_NAMESPACE


# ---------------------------------------------------------------------- the restart clock
def test_a_restart_is_measured_once_from_the_size_decision_to_the_first_step(tmp_path: Path) -> None:
    restarts.begin(tmp_path, kind="resize", workers=3, decision={"choice": "shrink"}, at=NOW)
    marks = {"checkpointer_init": NOW + 9, "checkpointer_ready": NOW + 10, "restore_start": NOW + 11,
             "restore_end": NOW + 13, "first_step": NOW + 14}
    data = json.loads((tmp_path / restarts.BEGAN).read_text())
    data["marks"] = {"group_start": NOW + 2, "actors_ready": NOW + 5, "group_ready": NOW + 7, "launched": NOW + 7.5}
    (tmp_path / restarts.BEGAN).write_text(json.dumps(data))
    cost = restarts.measure(tmp_path, marks=marks, world_size=3)
    assert cost is not None and cost["seconds"] == 14.0 and cost["kind"] == "resize"
    assert cost["phases"] == {"teardown": 2.0, "actors": 3.0, "process_group": 2.0, "launch": 0.5, "train_fn": 1.5,
                              "checkpointer": 1.0, "model": 1.0, "restore": 2.0, "first_step": 1.0}
    assert sum(cost["phases"].values()) == cost["seconds"]
    assert cost["decision"] == {"choice": "shrink"} and restarts.last_cost(tmp_path) == 14.0
    assert restarts.measure(tmp_path, marks=marks, world_size=3) is None  # once per clock


def test_no_clock_no_measure(tmp_path: Path) -> None:
    assert restarts.measure(tmp_path, marks={"first_step": NOW}, world_size=2) is None
    assert restarts.last_cost(tmp_path) is None
    restarts.begin(tmp_path, kind="restart", workers=2, at=NOW + 100)  # started after this first step
    assert restarts.measure(tmp_path, marks={"first_step": NOW}, world_size=2) is None
