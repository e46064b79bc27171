"""The quick form of ``bench/mass.py`` (issue #45): a mass Spot interruption of a few Kueue runs on
the real control plane, through the real daemon's requeue and follow-up, one replica and two
(Leases as claims), and the baseline without the follow-up (tests/cluster/mass.py has the wave).

3 runs x 2 workers; the Capacity Block's quota fits one run, On-Demand the other two.  A run's
notices reach the daemon together and the runs are decided at about the same time: a run decided
before Kueue reserved the block for another is sent to the block too, waits for quota, and its
follow-up moves it to On-Demand once the admitted bound passes (a run decided after goes to
On-Demand at once: the quota check read the reservation).  Without the follow-up such a run stays
pending and the daemon says nothing: what the follow-up is for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.controlplane import ControlPlane
from tests.support.controlplane.world import World

from .mass import Wave, report, run_wave
from .stage import Aws

pytestmark = pytest.mark.cluster

QUICK = dict(runs=3, workers=2, block_runs=1, admitted_bound_s=10, scheduled_bound_s=30, training_bound_s=60,
             timeout_s=240, settle_s=25)


@pytest.fixture
def sqs_s3(aws: Any) -> Aws:
    return Aws(aws.endpoint_url).open()


def check_followed(result: Any) -> None:
    """Every run trains again, each requeued once (a gang's two notices are one move) and moved
    again only by its own follow-up's fallback, at most once; the block holds one run, On-Demand
    the others; no notice left in SQS."""
    j = result.as_json()
    why = report([result]) + "\n" + json.dumps(j["per_run"], indent=1)
    assert j["ends"] == {"resumed": 3}, why
    assert j["stages_s"]["training"]["n"] == 3, why
    assert j["capacity"] == {"block": 1, "on-demand": 2}, why
    assert not j["moved_twice"] and j["requeues"] == 3, why
    assert all(r["fallbacks"] <= 1 for r in j["per_run"].values()), why
    assert j["sqs_in_flight_at_end"] == 0, why


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_wave_of_runs_all_train_again_with_the_follow_up(daemon_identity: ControlPlane, world: World,
                                                            sqs_s3: Aws, tmp_path: Path, replicas: int) -> None:
    result = run_wave(daemon_identity, world, sqs_s3, Wave(replicas=replicas, **QUICK), tmp_path)
    print(report([result]))
    check_followed(result)


def test_without_the_follow_up_each_run_is_moved_once_and_what_the_block_cannot_hold_is_left_pending(
        daemon_identity: ControlPlane, world: World, sqs_s3: Aws, tmp_path: Path) -> None:
    """The baseline: one move per run (before the fix of the move claim without a follower, each
    notice of a gang moved it: two ``Requeued`` per run); a run sent to the full block stays
    pending for quota and nothing says so (no follow-up, no fallback)."""
    result = run_wave(daemon_identity, world, sqs_s3, Wave(replicas=1, follow_up=False, **QUICK), tmp_path)
    print(report([result]))
    j = result.as_json()
    why = report([result]) + "\n" + json.dumps(j["per_run"], indent=1)
    assert j["requeues"] == 3 and j["fallbacks"] == 0 and not j["moved_twice"], why
    assert j["capacity"].get("block") == 1 and j["capacity"].get("spot", 0) == 0, why
    for run in j["per_run"].values():
        if run["capacity"] == "pending":
            assert "capacity-block" in run["requeued"][0] and "training" not in run["stages_s"], why
    assert j["ends"] == {"no follow-up": 3}, why
