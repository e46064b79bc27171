"""The drill on EC2's API (``--provider ec2``): the daemon's Ec2NodeProvider launches the
replacements on the drill's moto over HTTP, a hook plays the user-data script, and the report lists
every RunInstances the daemon made (``ec2_launches``) and every TerminateInstances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilienced.local.drill import BLOCK_ID, DrillOptions, ec2_checks

from .test_drill import drill

pytestmark = pytest.mark.e2e


def test_on_ec2_the_spot_story_launches_into_the_block_after_spot_runs_out(tmp_path: Path) -> None:
    report = drill(tmp_path, "--provider", "ec2", "--scenario", "spot", "--spot-capacity", "0")
    assert report["ok"], json.dumps(report, indent=2)
    assert report["capacity"] == "capacity-block" and report["steps_lost"] == 0
    spot, block = report["ec2_launches"]  # Spot refused by EC2 (moto has none), then the block
    assert (spot["market"], spot["error"], spot["instance_id"]) == ("spot", "InsufficientInstanceCapacity", None)
    assert (block["market"], block["reservation_id"]) == ("capacity-block", BLOCK_ID)
    assert block["instance_id"].startswith("i-") and block["client_token"].startswith("rsd-")
    assert "error" not in block and report["ec2_terminations"] == []


@pytest.mark.long(  # make test-long (docs/development.md, "Long stories"); in make test at less cost:
    # the same chain on EC2's API (the block launch), and the stalled story on the local provider's
    "tests/local/drill/test_drill_ec2.py::test_on_ec2_the_spot_story_launches_into_the_block_after_spot_runs_out",
    # release terminates what the provider launched, the next capacity launches
    "tests/aws/test_ec2nodes.py::test_release_terminates_only_its_own_instances",
    "tests/aws/test_ec2nodes.py::test_insufficient_capacity_is_no_capacity_and_the_next_capacity_launches",
    "tests/ray/test_progress.py::test_withdraw_gives_back_only_the_stalled_capacity_replacing_the_lost_instance",
)
def test_on_ec2_a_block_instance_that_never_joins_is_terminated_and_on_demand_launched(tmp_path: Path) -> None:
    report = drill(tmp_path, "--provider", "ec2", "--scenario", "stalled")
    assert report["ok"], json.dumps(report, indent=2)
    launched = [(launch["market"], launch.get("error")) for launch in report["ec2_launches"]]
    assert launched == [("spot", "InsufficientInstanceCapacity"), ("capacity-block", None), ("on-demand", None)]
    block = report["ec2_launches"][1]
    assert block["reservation_id"] == BLOCK_ID and report["ec2_terminations"] == [block["instance_id"]]
    assert report["capacity"] == "on-demand" and report["steps_lost"] == 0


# --------------------------------------------------------------------------- the report's checks
def _launch(market: str, instance_id: str | None, reservation_id: str | None = None, error: str | None = None) -> dict:
    out = {"instance_id": instance_id, "market": market, "reservation_id": reservation_id, "client_token": "rsd-x"}
    return {**out, "error": error} if error else out


@pytest.mark.unit
def test_the_checks_need_the_block_launch_to_name_the_block() -> None:
    options = DrillOptions(scenario="spot", provider="ec2")
    good = {"ec2_launches": [_launch("spot", None, error="InsufficientInstanceCapacity"),
                             _launch("capacity-block", "i-1", BLOCK_ID)], "ec2_terminations": []}
    assert all(ec2_checks(options, good).values())
    wrong = {**good, "ec2_launches": [_launch("capacity-block", "i-1", "cr-0ther")]}
    assert not ec2_checks(options, wrong)["the Capacity Block launch names the block's reservation id"]
    assert not ec2_checks(options, {"ec2_launches": [], "ec2_terminations": []})[
        "the replacement was launched through EC2's API"]


@pytest.mark.unit
def test_the_stalled_check_needs_the_block_terminated_before_on_demand() -> None:
    options = DrillOptions(scenario="stalled", provider="ec2")
    launches = [_launch("capacity-block", "i-1", BLOCK_ID), _launch("on-demand", "i-2")]
    name = "the stalled block's instance was terminated, then On-Demand launched"
    assert ec2_checks(options, {"ec2_launches": launches, "ec2_terminations": ["i-1"]})[name]
    assert not ec2_checks(options, {"ec2_launches": launches, "ec2_terminations": []})[name]
    assert not ec2_checks(options, {"ec2_launches": launches[::-1], "ec2_terminations": ["i-1"]})[name]
