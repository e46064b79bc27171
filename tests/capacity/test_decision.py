"""The capacity decision as a table: inputs -> spot | capacity-block | on-demand | wait."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilienced.capacity.decision import Pool, decide
from resilienced.capacity.policy import CapacityPolicy
from resilienced.model import Capacity, CapacityOffering
from resilienced.errors import ConfigError
from resilienced.capacity.decision import Selectable
from resilienced.ports import CapacityReservation

pytestmark = pytest.mark.unit

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
POOL = Pool("p5.48xlarge", "us-east-1a")
H = timedelta(hours=1)
M = timedelta(minutes=1)


def block(rid: str = "cr-aaa", *, available: int = 4, total: int = 8, end: datetime | None = NOW + 24 * H,
          state: str = "active", rtype: str = "capacity-block", az: str = "us-east-1a",
          instance_type: str = "p5.48xlarge", start: datetime | None = NOW - 24 * H) -> CapacityReservation:
    return CapacityReservation(
        reservation_id=rid, instance_type=instance_type, availability_zone=az, reservation_type=rtype,
        state=state, available_instances=available, total_instances=total, start=start, end=end)


def offering(oid: str = "cb-111", *, fee: str = "1000", start: datetime = NOW + 10 * M,
             hours: int = 24, count: int = 4, az: str = "us-east-1a") -> CapacityOffering:
    return CapacityOffering(offering_id=oid, instance_type="p5.48xlarge", availability_zone=az,
                            instance_count=count, start=start, end=start + hours * H,
                            upfront_fee=Decimal(fee))


@dataclass
class Row:
    expect: Capacity
    reservation: str | None = None
    interruptions: list[datetime] = field(default_factory=list)
    reservations: list[CapacityReservation] = field(default_factory=list)
    unavailable: frozenset[str] = frozenset()
    run_needs: timedelta | None = None
    current: str | None = None
    current_reservation: str | None = None
    last_move: datetime | None = None
    policy: dict = field(default_factory=dict)
    offerings: list[CapacityOffering] = field(default_factory=list)
    pool: Pool = POOL
    count: int = 2
    reason_has: str = ""
    offering: str | None = None


TWO_RECENT = [NOW - 20 * M, NOW - 5 * M]
BUY = {"purchase_blocks": True, "price_cap": Decimal("5000")}

TABLE = {
    "healthy spot -> spot": Row(Capacity.SPOT, reason_has="healthy"),
    "one interruption, threshold 2 -> spot": Row(Capacity.SPOT, interruptions=[NOW - 5 * M]),
    "healthy spot ignores an idle block -> spot": Row(Capacity.SPOT, reservations=[block()]),
    "spot interrupted twice in window -> block with room": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", TWO_RECENT, [block()], reason_has="interrupted 2 times"),
    "threshold 3 tolerates two interruptions -> spot": Row(
        Capacity.SPOT, interruptions=TWO_RECENT, reservations=[block()],
        policy={"interruption_threshold": 3}),
    "interruptions outside the window are ignored -> spot": Row(
        Capacity.SPOT, interruptions=[NOW - 3 * H, NOW - 2 * H], reservations=[block()]),
    "future-dated interruptions are ignored -> spot": Row(
        Capacity.SPOT, interruptions=[NOW + 5 * M, NOW + 6 * M], reservations=[block()]),
    "block full -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(available=1)], reason_has="has 1 free"),
    "block in its last 40 min -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(end=NOW + 30 * M)], reason_has="last 40m"),
    "block with 39 min of use left before its margin, run needs 1h -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(end=NOW + 79 * M)], run_needs=H),
    "block ends within the run's needs -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(end=NOW + 3 * H)], run_needs=3 * H,
        reason_has="within the run's needs"),
    "block outlasts the run's needs plus margin -> block": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", TWO_RECENT, [block(end=NOW + 3 * H + 41 * M)], run_needs=3 * H),
    "unknown needs: block with less than min_block_time -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(end=NOW + 90 * M)], reason_has="minimum block time"),
    "on-demand not allowed -> wait": Row(
        Capacity.WAIT, None, TWO_RECENT, [block(available=0)], policy={"allow_on_demand": False},
        reason_has="On-Demand is not allowed"),
    "on-demand out of capacity -> wait": Row(
        Capacity.WAIT, None, TWO_RECENT, unavailable=frozenset({"on-demand"}), reason_has="On-Demand has no capacity"),
    "cool-down elapsed and pool calm -> back to spot": Row(
        Capacity.SPOT, None, [NOW - 150 * M], [block()], current="capacity-block",
        current_reservation="cr-aaa", last_move=NOW - 3 * H, reason_has="back to Spot"),
    "cool-down not elapsed -> stays on the block": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", [], [block()], current="capacity-block",
        current_reservation="cr-aaa", last_move=NOW - 30 * M, reason_has="cool-down"),
    "cool-down elapsed but pool interrupted within it -> stays on on-demand": Row(
        Capacity.ON_DEMAND, None, [NOW - 90 * M], [], current="on-demand", last_move=NOW - 3 * H,
        reason_has="not calm"),
    "cool-down only, nothing else has room -> spot rather than wait": Row(
        Capacity.SPOT, None, [], [block(available=0)], current="on-demand", last_move=NOW - 10 * M,
        policy={"allow_on_demand": False}, reason_has="rather than waiting"),
    "spot out of capacity (ICE) -> block": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", [], [block()], unavailable=frozenset({"spot"}), reason_has="ICE"),
    "spot out of capacity, no block -> on-demand": Row(
        Capacity.ON_DEMAND, None, [], [], unavailable=frozenset({"spot"})),
    "spot and blocks out of capacity -> on-demand": Row(
        Capacity.ON_DEMAND, None, [], [block()], unavailable=frozenset({"spot", "capacity-block"})),
    "full block by id (ICE) -> the other block": Row(
        Capacity.CAPACITY_BLOCK, "cr-bbb", TWO_RECENT,
        [block("cr-aaa", end=NOW + 48 * H), block("cr-bbb")], unavailable=frozenset({"cr-aaa"})),
    "expiring current block excluded, cool-down -> on-demand": Row(
        Capacity.ON_DEMAND, None, [], [block("cr-old", end=NOW + 40 * M)], current="capacity-block",
        current_reservation="cr-old", last_move=NOW - 30 * M, unavailable=frozenset({"cr-old"})),
    "expiring current block, calm pool, no cool-down left -> spot": Row(
        Capacity.SPOT, None, [], [block("cr-old", end=NOW + 40 * M)], current="capacity-block",
        current_reservation="cr-old", last_move=NOW - 3 * H, unavailable=frozenset({"cr-old"})),
    "default (non-block) reservation is not a block -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(rtype="default")]),
    "block for another instance type -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(instance_type="p4d.24xlarge")]),
    "block in another AZ -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(az="us-east-1b")]),
    "AZ unknown: a block in any AZ -> block": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", TWO_RECENT, [block(az="us-east-1b")],
        pool=Pool("p5.48xlarge")),
    "scheduled (not yet active) block -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [block(state="scheduled", start=NOW + H)]),
    "latest-ending block first": Row(
        Capacity.CAPACITY_BLOCK, "cr-late", TWO_RECENT,
        [block("cr-early", end=NOW + 5 * H), block("cr-late", end=NOW + 50 * H)]),
    "the run's current block first": Row(
        Capacity.CAPACITY_BLOCK, "cr-early", TWO_RECENT,
        [block("cr-early", end=NOW + 5 * H), block("cr-late", end=NOW + 50 * H)],
        current="capacity-block", current_reservation="cr-early", last_move=NOW - 10 * M),
    "prefer_blocks: block before healthy spot": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", [], [block()], policy={"prefer_blocks": True}),
    "purchase on, offering under the cap -> buy a block": Row(
        Capacity.CAPACITY_BLOCK, None, TWO_RECENT, [], policy=BUY, offerings=[offering()],
        offering="cb-111", reason_has="buy offering cb-111"),
    "purchase on, cheapest fitting offering": Row(
        Capacity.CAPACITY_BLOCK, None, TWO_RECENT, [], policy=BUY,
        offerings=[offering("cb-dear", fee="4000"), offering("cb-cheap", fee="2000")], offering="cb-cheap"),
    "purchase on, offering over the cap -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [], policy=BUY, offerings=[offering(fee="9000")],
        reason_has="> cap 5000"),
    "purchase on, offering starts too late -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [], policy=BUY, offerings=[offering(start=NOW + 2 * H)],
        reason_has="later than"),
    "purchase on, offering too small -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [], policy=BUY, offerings=[offering(count=1)]),
    "purchase on, offering too short for the run -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [], policy=BUY, offerings=[offering(hours=24)],
        run_needs=30 * H, reason_has="too soon"),
    "purchase off: offerings are ignored -> on-demand": Row(
        Capacity.ON_DEMAND, None, TWO_RECENT, [], offerings=[offering()]),
    "purchase on, on-demand not allowed -> buy rather than wait": Row(
        Capacity.CAPACITY_BLOCK, None, TWO_RECENT, [], policy={**BUY, "allow_on_demand": False},
        offerings=[offering()], offering="cb-111"),
    "purchase on, an existing block with room wins -> block": Row(
        Capacity.CAPACITY_BLOCK, "cr-aaa", TWO_RECENT, [block()], policy=BUY, offerings=[offering()]),
}


@pytest.mark.parametrize("row", list(TABLE.values()), ids=list(TABLE))
def test_decision_table(row: Row) -> None:
    decision = decide(
        pool=row.pool, instance_count=row.count, interruptions=row.interruptions,
        reservations=row.reservations, unavailable=row.unavailable, now=NOW,
        run_needs=row.run_needs, current_capacity=row.current, last_move=row.last_move,
        policy=CapacityPolicy(**row.policy), current_reservation_id=row.current_reservation,
        offerings=row.offerings)
    assert decision.capacity is row.expect, decision.reason
    assert decision.reservation_id == row.reservation, decision.reason
    assert (decision.offering.offering_id if decision.offering else None) == row.offering
    assert row.reason_has in decision.reason
    assert (decision.retry_after is not None) == (row.expect is Capacity.WAIT)
    assert decision.as_json()["capacity"] == row.expect.value


def test_decision_details_count_the_window() -> None:
    decision = decide(pool=POOL, instance_count=2, interruptions=[NOW - 2 * H, *TWO_RECENT],
                      reservations=[], now=NOW, run_needs=None, current_capacity="spot",
                      last_move=None, policy=CapacityPolicy())
    assert decision.details["interruptions_in_window"] == 2
    assert decision.details["pool"] == "p5.48xlarge/us-east-1a"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"now": datetime(2026, 8, 20, 12)}, "now must be timezone-aware"),
        ({"instance_count": 0}, "instance_count"),
        ({"interruptions": [datetime(2026, 8, 20, 11)]}, "interruptions[0]"),
        ({"last_move": datetime(2026, 8, 20, 11)}, "last_move"),
        ({"run_needs": timedelta(seconds=-1)}, "run_needs"),
        ({"current_capacity": "preemptible"}, "preemptible"),
        ({"unavailable": "spot"}, "unavailable"),
    ],
    ids=["naive now", "zero instances", "naive interruption", "naive last_move", "negative needs",
         "unknown capacity", "unavailable as a string"],
)
def test_bad_input_names_what_was_wrong(kwargs: dict, message: str) -> None:
    args = dict(pool=POOL, instance_count=1, interruptions=[], reservations=[], now=NOW,
                run_needs=None, current_capacity=None, last_move=None, policy=CapacityPolicy())
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError)) as info:
        decide(**args)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"interruption_threshold": 0}, "--interruption-threshold"),
        ({"block_end_margin": timedelta(minutes=10)}, "--block-end-margin"),
        ({"purchase_blocks": True}, "--price-cap"),
        ({"price_cap": Decimal("-1")}, "--price-cap"),
        ({"interruption_window": timedelta(seconds=5)}, "--interruption-window"),
    ],
    ids=["threshold 0", "margin under EC2's 30 min", "buying without a cap", "negative cap", "tiny window"],
)
def test_bad_policy_names_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        CapacityPolicy(**kwargs)
    assert info.value.setting == flag


def test_policy_from_flags_and_environment() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    CapacityPolicy.add_arguments(parser)
    args = parser.parse_args(["--spot-cooldown", "30m", "--purchase-blocks", "true"])
    policy = CapacityPolicy.from_args(args, {"RESILIENCED_PRICE_CAP": "$2500.50",
                                            "RESILIENCED_ALLOW_ON_DEMAND": "false"})
    assert policy.spot_cooldown == timedelta(minutes=30)
    assert policy.purchase_blocks and policy.price_cap == Decimal("2500.50")
    assert policy.allow_on_demand is False
    assert policy.purchase_dry_run is True  # buying for real is opt-in twice
    with pytest.raises(ConfigError) as info:
        CapacityPolicy.from_args(parser.parse_args(["--interruption-window", "soon"]), {})
    assert info.value.setting == "--interruption-window"


# --------------------------------------------------------------------------- invariants
blocks_st = st.lists(
    st.builds(
        block,
        rid=st.sampled_from(["cr-a", "cr-b", "cr-c"]),
        available=st.integers(0, 8),
        end=st.integers(-60, 3000).map(lambda m: NOW + m * M),
        state=st.sampled_from(["active", "scheduled", "expired"]),
        rtype=st.sampled_from(["capacity-block", "default"]),
        az=st.sampled_from(["us-east-1a", "us-east-1b"]),
    ),
    max_size=4,
    unique_by=lambda r: r.reservation_id,
)


@settings(max_examples=300, deadline=None)
@given(
    reservations=blocks_st,
    interruptions=st.lists(st.integers(0, 300).map(lambda m: NOW - m * M), max_size=5),
    count=st.integers(1, 6),
    needs=st.one_of(st.none(), st.integers(0, 2000).map(lambda m: m * M)),
    allow_on_demand=st.booleans(),
    unavailable=st.sets(st.sampled_from(["spot", "on-demand", "cr-a"])),
    current=st.sampled_from([None, "spot", "capacity-block", "on-demand"]),
)
def test_decision_invariants(reservations, interruptions, count, needs, allow_on_demand,
                             unavailable, current) -> None:
    policy = CapacityPolicy(allow_on_demand=allow_on_demand)
    d = decide(pool=POOL, instance_count=count, interruptions=interruptions,
               reservations=reservations, unavailable=unavailable, now=NOW, run_needs=needs,
               current_capacity=current, last_move=NOW - 30 * M if current else None, policy=policy)
    if d.capacity is Capacity.CAPACITY_BLOCK:
        chosen = [r for r in reservations if r.reservation_id == d.reservation_id]
        assert chosen and any(
            r.reservation_type == "capacity-block" and r.state == "active"
            and r.availability_zone == "us-east-1a" and r.available_instances >= count
            and r.end - policy.block_end_margin >= NOW + (needs if needs is not None else policy.min_block_time)
            and r.end - policy.block_end_margin > NOW and r.reservation_id not in unavailable
            for r in chosen)
    if d.capacity is Capacity.ON_DEMAND:
        assert allow_on_demand and "on-demand" not in unavailable
    if d.capacity is Capacity.SPOT:
        assert "spot" not in unavailable
        in_window = [t for t in interruptions if NOW - policy.interruption_window < t <= NOW]
        assert len(in_window) < policy.interruption_threshold
    assert d.reason


# --------------------------------------------------------------------------- Karpenter's EC2NodeClasses
@pytest.mark.parametrize("selectable, expect, reservation", [
    (None, Capacity.CAPACITY_BLOCK, "cr-big"),  # no EC2NodeClass known: any block (the roomiest)
    (Selectable(frozenset({"cr-small"}), ("blocks/block-class",)), Capacity.CAPACITY_BLOCK, "cr-small"),
    (Selectable(frozenset(), ("spot/spot-class",)), Capacity.ON_DEMAND, None),
], ids=["no-ec2nodeclass-known", "one-selected", "none-selected"])
def test_only_a_block_an_ec2nodeclass_selects_is_used_and_the_others_are_named(
        selectable: Selectable | None, expect: Capacity, reservation: str | None) -> None:
    decision = decide(
        pool=POOL, instance_count=1, interruptions=TWO_RECENT,
        reservations=[block("cr-big", available=8), block("cr-small", available=2)], now=NOW,
        run_needs=None, current_capacity=None, last_move=None, policy=CapacityPolicy(),
        selectable=selectable)
    assert (decision.capacity, decision.reservation_id) == (expect, reservation), decision.reason
    if selectable is not None:
        where = ", ".join(selectable.sources)
        assert (f"cr-big is selected by no EC2NodeClass of the run ({where}): Karpenter cannot launch "
                "into it") in decision.reason


@pytest.mark.parametrize("tags, message", [
    (("karpenter.sh/discovery",), "expected KEY=VALUE"),
    (("aws:cloudformation:stack=x",), "is reserved"),
    (("resilienced.io/purchase-key=x",), "is reserved"),
    (("team=a", "team=b"), "a tag key is unique"),
], ids=["no-value", "aws-prefix", "purchase-key", "twice"])
def test_a_malformed_purchase_tag_names_the_flag(tags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        CapacityPolicy(purchase_tags=tags)
    assert info.value.setting == "--purchase-tags" and message in str(info.value)


# --------------------------------------------------------------------------- Kueue quota, Karpenter's window
QUOTA = "Kueue ClusterQueue cq has too little free quota"


@pytest.mark.parametrize("closed, expect, reason_has", [
    ({"capacity-block": QUOTA}, Capacity.ON_DEMAND, QUOTA),
    ({"capacity-block": QUOTA, "on-demand": QUOTA}, Capacity.WAIT, QUOTA),
    ({"spot": QUOTA}, Capacity.CAPACITY_BLOCK, QUOTA),
], ids=["block-closed", "block-and-on-demand-closed", "spot-closed-even-when-healthy"])
def test_a_capacity_closed_to_the_run_is_passed_over_with_its_reason(
        closed: dict[str, str], expect: Capacity, reason_has: str) -> None:
    interruptions = TWO_RECENT if "spot" not in closed else []
    decision = decide(pool=POOL, instance_count=1, interruptions=interruptions, reservations=[block()], now=NOW,
                      run_needs=None, current_capacity=None, last_move=None, policy=CapacityPolicy(), closed=closed)
    assert decision.capacity is expect and reason_has in decision.reason, decision.reason


def test_a_closed_block_flavor_is_not_bought_either() -> None:
    policy = CapacityPolicy(purchase_blocks=True, price_cap=Decimal("5000"), allow_on_demand=False)
    decision = decide(pool=POOL, instance_count=1, interruptions=TWO_RECENT, reservations=[], now=NOW,
                      run_needs=None, current_capacity=None, last_move=None, policy=policy,
                      offerings=[offering()], closed={"capacity-block": QUOTA})
    assert decision.capacity is Capacity.WAIT and decision.offering is None, decision.reason


@pytest.mark.parametrize("drain_lead, expect", [(None, Capacity.CAPACITY_BLOCK), (40 * M, Capacity.ON_DEMAND)],
                         ids=["EC2's 30 min", "Karpenter's 40 min"])
def test_the_margin_is_at_least_the_drain_lead(drain_lead: timedelta | None, expect: Capacity) -> None:
    policy = CapacityPolicy(block_end_margin=30 * M, min_block_time=H)
    decision = decide(pool=POOL, instance_count=1, interruptions=TWO_RECENT, reservations=[block(end=NOW + 95 * M)],
                      now=NOW, run_needs=None, current_capacity=None, last_move=None, policy=policy,
                      drain_lead=drain_lead)
    assert decision.capacity is expect, decision.reason
