"""The drill's ledger (resilienced.local.drill_ledger) against a run whose cost is known by
construction: the drill report's scripted Spot story (tests/local/drill/test_report.py), with a
follow-up record and node spans on the same clock; every part agrees to the second."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from resilienced.local.drill import DrillOptions, report_from
from resilienced.local.drill_ledger import drill_ledger, node_balance, report_ledger
from resilienced.ops.ledger import Price

from .test_report import NOTICE, reference, spot_run

pytestmark = pytest.mark.unit


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


# The requeue at +5 s moved the lost worker to the block; it stalled, and at +20 s the follow-up fell
# back to On-Demand, whose node joined at +30 s; the run trained again at +39 s (attempt 2).
FOLLOW_UP = {"opened_at": iso(NOTICE + 5), "capacity": "on-demand",
             "fallbacks": [{"from": "capacity-block cr-1", "to": "on-demand", "at": iso(NOTICE + 20)}],
             "reached": {"joined": iso(NOTICE + 30), "training": iso(NOTICE + 39)}}
NODES = [(900.0, None), (900.0, NOTICE + 25), (NOTICE + 30, None)]
PRICES = {"spot": Price(1.0, "moto"), "capacity-block": Price(2.0, "file"), "on-demand": Price(3.0, "file")}


def ledger(**change):  # type: ignore[no-untyped-def]
    m, e = spot_run()
    e[3] = {**e[3], "save_seconds": 0.25}  # the notice's save (step 16) paused training 0.25 s
    kwargs = dict(run="drill/run", event_id="e-1", workers=2, metrics=m, events=e, notice=NOTICE,
                  steps_trained_twice=0, follow_up=FOLLOW_UP, prices=PRICES, node_spans=NODES)
    return drill_ledger(**{**kwargs, **change}), m, e


def test_each_part_to_the_second() -> None:
    led, _, _ = ledger()
    parts = {p.part: p for p in led.lost}
    # attempt 1 trained until its last line at 1014; attempt 2 from 1039 (a step before its first line)
    # the capacity: asked at 1005, placed (joined) at 1030 -> within [1014, 1039]: 16 s; idle 25 - 16 = 9 s
    assert (parts["capacity_wait"].seconds, parts["idle"].seconds) == (16.0, 9.0)
    assert (parts["capacity_wait"].gpu_seconds, parts["idle"].gpu_seconds) == (32.0, 18.0)
    assert (parts["save_pause"].seconds, parts["steps_repeated"].seconds) == (0.25, 0.0)
    assert "step 16 committed (preemption)" in parts["save_pause"].source
    assert led.lost_gpu_seconds == 50.5


def test_steps_trained_twice_cost_the_measured_step_time() -> None:
    led, _, _ = ledger(steps_trained_twice=7)
    assert led.part("steps_repeated").seconds == 7.0 and led.part("steps_repeated").gpu_seconds == 14.0


def test_the_capacity_spans_and_their_cost() -> None:
    led, _, _ = ledger()
    spans = [(u.capacity, u.start.timestamp(), u.end.timestamp(), u.instances) for u in led.capacity]
    # the run trained from 984 to 1049 (its last line); the survivor on Spot throughout, the lost
    # instance on Spot until its node went (1025); its replacement on the block 1005-1020, On-Demand after
    assert spans == [("spot", 984.0, 1049.0, 1), ("spot", 984.0, 1025.0, 1),
                     ("capacity-block", 1005.0, 1020.0, 1), ("on-demand", 1020.0, 1049.0, 1)]
    # premium: block 15 s x (2 - 1) + On-Demand 29 s x (3 - 1) $/h
    assert led.premium.value == round((15 * 1 + 29 * 2) / 3600, 6)


def test_the_report_carries_the_ledger_and_says_how_idle_differs_from_worker_seconds_idle() -> None:
    led, m, e = ledger()
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=NOTICE + 1.5,
                         capacity="on-demand", trainer_exit=0, node_spans=NODES)
    out = report_ledger(led, worker_seconds_idle=report["worker_seconds_idle"], node_spans=NODES, workers=2)
    assert out["lost_gpu_seconds"] == 50.5 and out["parts"]["capacity_wait"] == 32.0
    assert out["cost"]["currency"] == "USD" and out["cost"]["prices"] == {"spot": 1.0, "capacity-block": 2.0,
                                                                          "on-demand": 3.0}
    diff = out["idle_vs_worker_seconds_idle"]
    # the machines up and not training: 45 node-seconds; the ranks short: 2 x 25 = 50; the 5 s
    # between the lost node's end (1025) and the replacement's join (1030) no node held its rank
    assert (diff["worker_seconds_idle"], diff["ledger_idle_and_wait"], diff["unheld_rank_seconds"],
            diff["surplus_node_seconds"]) == (45.0, 50.0, 5.0, 0.0)
    assert diff["ledger_less_unheld_plus_surplus"] == diff["worker_seconds_idle"]


def test_a_replacement_up_before_the_lost_node_went_is_surplus_in_worker_seconds_idle() -> None:
    """The notice caught: the replacement joined at 1010, before the lost node went (1020) and before
    training stopped (1014): worker_seconds_idle counts its 4 s up beside two training ranks too."""
    nodes = [(900.0, None), (900.0, NOTICE + 20), (NOTICE + 10, None)]
    led, m, e = ledger(node_spans=nodes)
    report = report_from(options=DrillOptions(steps=40, interrupt_at_step=15), metrics=m, events=e,
                         reference=reference(40), notice=NOTICE, durable_at=NOTICE + 1.5,
                         capacity="on-demand", trainer_exit=0, node_spans=nodes)
    diff = report_ledger(led, worker_seconds_idle=report["worker_seconds_idle"], node_spans=nodes,
                         workers=2)["idle_vs_worker_seconds_idle"]
    assert (diff["surplus_node_seconds"], diff["unheld_rank_seconds"]) == (10.0, 0.0)
    assert diff["ledger_less_unheld_plus_surplus"] == diff["worker_seconds_idle"] == 60.0
    assert node_balance([(0.0, None), (0.0, None)], ranks=2, window=(10.0, 20.0)) == (0.0, 0.0)


def test_unknowns_stay_null_with_their_reason() -> None:
    led, _, _ = ledger(follow_up=None, prices={"spot": Price.unknown("moto", "refused")})
    assert led.part("capacity_wait").seconds is None and "requeue not recorded" in led.part("capacity_wait").source
    assert led.part("idle").seconds == 25.0  # the whole downtime, said so by its source
    assert led.premium.value == 0.0  # nothing off Spot was recorded
    assert led.savings.value is None and "On-Demand price is unknown" in (led.savings.reason or "")
