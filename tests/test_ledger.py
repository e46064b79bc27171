"""resilienced.ops.ledger: each part and figure of a recovery's ledger, against a run whose cost is
known by construction (every time a whole second on a scripted timeline)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from resilienced.ops.ledger import (
    PARTS,
    CapacityUse,
    Gpus,
    Known,
    Ledger,
    Price,
    Recovery,
    block_price,
    capacity_spans,
    compute,
    lost_parts,
    premium_by_capacity,
    summary,
)

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 5, 8, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# The run: 2 ranks x 8 GPUs = 16 GPUs.  Notice at 0; the save at the notice pauses 3 s; training
# stops on the lost node at 100 (the teardown); the requeue asks for capacity at 110 and it is
# placed at 400; the run trains again at 460; 4 steps trained twice at 2.5 s each.
RUN = Recovery(
    notice_at=at(0), gpus=Gpus(2, 8, "pods' requests: nvidia.com/gpu 8"),
    steps_trained_twice=Known(4, "resumed from step 16, trained up to 20"),
    step_seconds=Known(2.5, "manifests step-10 and step-15"),
    save_seconds=Known(3, "manifest step-16"),
    training_stopped_at=at(100), requeued_at=at(110), placed_at=at(400), training_again_at=at(460),
    stopped_source="the node's termination", placed_source="stage scheduled", again_source="resume record")


def test_each_part_to_the_second() -> None:
    parts = {p.part: p for p in lost_parts(RUN)}
    assert tuple(parts) == PARTS
    assert (parts["steps_repeated"].seconds, parts["steps_repeated"].gpu_seconds) == (10.0, 160.0)
    assert (parts["save_pause"].seconds, parts["save_pause"].gpu_seconds) == (3.0, 48.0)
    # stopped 100 -> again 460 is 360 s, of which 110 -> 400 (290 s) waited for capacity
    assert (parts["capacity_wait"].seconds, parts["capacity_wait"].gpu_seconds) == (290.0, 4640.0)
    assert (parts["idle"].seconds, parts["idle"].gpu_seconds) == (70.0, 1120.0)
    assert "manifests step-10 and step-15" in parts["steps_repeated"].source
    assert "resume record" in parts["idle"].source and "stage scheduled" in parts["capacity_wait"].source


def test_no_second_counted_twice_the_wait_clipped_to_the_downtime() -> None:
    # capacity asked before training stopped (a gang requeue at the notice): only the wait after the stop counts
    early = Recovery(**{**RUN.__dict__, "requeued_at": at(50)})
    parts = {p.part: p.seconds for p in lost_parts(early)}
    assert parts["capacity_wait"] == 300.0 and parts["idle"] == 60.0
    assert parts["capacity_wait"] + parts["idle"] == 360.0  # stopped -> again, exactly


def test_an_unknown_input_leaves_its_part_null_with_the_reason() -> None:
    r = Recovery(**{**RUN.__dict__, "step_seconds": Known.unknown("fewer than two manifests before the notice"),
                    "placed_at": None})
    parts = {p.part: p for p in lost_parts(r)}
    assert parts["steps_repeated"].seconds is None and parts["steps_repeated"].gpu_seconds is None
    assert "fewer than two manifests" in parts["steps_repeated"].source
    assert parts["capacity_wait"].seconds is None and "placement stage not reached" in parts["capacity_wait"].source
    assert parts["idle"].seconds == 360.0  # no wait known: the whole downtime is idle, said so by its source
    assert "less the capacity wait" not in parts["idle"].source


SPOT = Price(4.0, "DescribeSpotPriceHistory p5.48xlarge us-east-1a")
OD = Price(10.0, "Pricing GetProducts")
BLOCK = block_price(upfront_fee=1440.0, hours=24, instances=2, source="offering cbo-1")


def test_block_price_is_the_fee_over_hours_and_instances() -> None:
    assert BLOCK.usd_per_hour == 30.0
    assert block_price(upfront_fee=10, hours=0, instances=1, source="x").usd_per_hour is None


def ledger(prices: dict[str, Price]) -> Ledger:
    # on Spot 1 h before the notice and until it; a block from 110 s to 1 h 110 s... in whole instance-hours:
    uses = capacity_spans([("spot", at(-3600)), ("capacity-block", at(0)), ("on-demand", at(1800))],
                          until=at(3600), instances=2, prices=prices)
    return compute(RUN, run="ns/job", event_id="e-1", at=at(3600), capacity=uses, prices=prices,
                   productive_gpu_seconds=Known(16 * 3600.0, "1 h of 16 GPUs trained before the notice"))


def test_capacity_premium_savings_and_goodput() -> None:
    led = ledger({"spot": SPOT, "capacity-block": BLOCK, "on-demand": OD})
    assert [(u.capacity, u.hours) for u in led.capacity] == [("spot", 2.0), ("capacity-block", 1.0), ("on-demand", 1.0)]
    # block 1 instance-hour x (30 - 4) + on-demand 1 x (10 - 4)
    assert led.premium.value == 32.0
    # against On-Demand: spot 2 x (10 - 4) + block 1 x (10 - 30) + on-demand 0
    assert led.savings.value == -8.0
    assert led.lost_gpu_seconds == 160 + 48 + 1120 + 4640
    assert led.goodput.value == round(57600 / (57600 + 5968), 6)
    assert premium_by_capacity(led.capacity, SPOT) == {"capacity-block": 26.0, "on-demand": 6.0}


def test_an_unknown_price_is_null_with_its_reason_never_a_guess() -> None:
    led = ledger({"spot": Price.unknown("DescribeSpotPriceHistory", "UnauthorizedOperation"),
                  "capacity-block": BLOCK, "on-demand": OD})
    assert led.premium.value is None and "UnauthorizedOperation" in (led.premium.reason or "")
    assert led.savings.value is None
    data = led.as_json()
    assert data["premium_usd"] is None and data["prices"]["spot"]["usd_per_hour"] is None
    assert data["prices"]["spot"]["reason"] == "UnauthorizedOperation"
    assert led.goodput.value is not None  # the time half does not need prices


def test_round_trip_and_summary() -> None:
    led = ledger({"spot": SPOT, "capacity-block": BLOCK, "on-demand": OD})
    again = Ledger.from_json(led.as_json())
    assert again.as_json() == led.as_json()
    s = summary(again)
    assert s["lost_gpu_seconds"] == 5968.0
    assert s["parts"] == {"steps_repeated": 160.0, "save_pause": 48.0, "idle": 1120.0, "capacity_wait": 4640.0}
    assert s["cost"]["currency"] == "USD" and s["cost"]["premium"] == 32.0
    assert s["cost"]["prices"] == {"spot": 4.0, "capacity-block": 30.0, "on-demand": 10.0}
    with pytest.raises(ValueError, match="format"):
        Ledger.from_json({**led.as_json(), "format": "other"})


def test_earlier_recoveries_count_in_the_runs_goodput() -> None:
    led = ledger({"spot": SPOT})
    carried = Ledger(**{**led.__dict__, "earlier_lost_gpu_seconds": 57600 - 5968.0})
    assert carried.goodput.value == 0.5
    assert isinstance(CapacityUse.from_json(led.capacity[0].as_json()), CapacityUse)


def test_the_metrics_count_a_ledger_once_and_keep_the_run_set_bounded() -> None:
    from prometheus_client import CollectorRegistry

    from resilienced.ops.ledger_metrics import LedgerMetrics

    registry = CollectorRegistry()
    m = LedgerMetrics(registry, goodput_floor=0.7)
    led = ledger({"spot": SPOT, "capacity-block": BLOCK, "on-demand": OD})
    m.count(led)
    value = registry.get_sample_value
    assert value("resilienced_lost_gpu_seconds_total", {"part": "capacity_wait"}) == 4640.0
    assert value("resilienced_lost_gpu_seconds_total", {"part": "steps_repeated"}) == 160.0
    assert value("resilienced_capacity_premium_usd_total", {"capacity": "capacity-block"}) == 26.0
    assert value("resilienced_capacity_premium_usd_total", {"capacity": "on-demand"}) == 6.0
    assert value("resilienced_run_goodput_ratio", {"run": "ns/job"}) == led.goodput.value
    assert value("resilienced_goodput_floor_ratio", {}) == 0.7
    m.keep_only(["ns/other"])
    assert value("resilienced_run_goodput_ratio", {"run": "ns/job"}) is None


def test_the_ledger_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from resilienced.errors import ConfigError
    from resilienced.settings import Settings

    assert Settings.from_args([], {}).ledger.goodput_floor == 0.8
    assert Settings.from_args([], {"RESILIENCED_GOODPUT_FLOOR": "0.6"}).ledger.goodput_floor == 0.6
    with pytest.raises(ConfigError, match="--goodput-floor"):
        Settings.from_args(["--goodput-floor", "1.5"], {})
    path = tmp_path / "prices.json"
    path.write_text("not json")
    with pytest.raises(ConfigError, match="--on-demand-prices"):
        Settings.from_args(["--on-demand-prices", str(path)], {}).ledger.validate()
    path.write_text('{"p5.48xlarge": 98.32}')
    Settings.from_args(["--on-demand-prices", str(path)], {}).ledger.validate()

