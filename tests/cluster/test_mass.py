"""The quick form of ``bench/mass.py`` (issue #45): a mass Spot interruption of a few Kueue runs on
the real control plane, through the real daemon's requeue and follow-up, one replica and two
(Leases as claims), and the baseline without the follow-up (tests/cluster/mass.py has the wave).

3 runs x 2 workers; the Capacity Block's quota fits one run, On-Demand the other two.  A run's
notices reach the daemon together and the runs are decided at about the same time: a run decided
before Kueue reserved the block for another is sent to the block too, waits for quota, and its
follow-up moves it to On-Demand once the admitted bound passes (a run decided after goes to
On-Demand at once: the quota check read the reservation).  Without the follow-up such a run stays
pending and the daemon says nothing: what the follow-up is for.

API writes (the daemon's, from the audit log) are bounded by the floor plus the named bookkeeping
(``tests/cluster/mass.py``: ``BOOKKEEPING_PER_RUN``...).  The floor is counted as docs/benchmarks.md
counts it: per lost instance the Node's cordon, per move (the requeue, each fallback) 3 writes
(Workload deactivated, RayJob steered, Workload reactivated with its PodSets steered, one write
since issue #45): here 2 + 3 = **5 per run**, 3 more per fallback.  2x that is out of reach at 2
workers: a run's bookkeeping is fixed, not per instance (the move claim, held from the handling's
start, created and let go; the leading notice's run claim, which stands for its event claim,
written once, done, the move claim standing for it meanwhile; one Event per step on the RayJob:
``Draining``, ``CheckpointDurable``, ``Requeued``, ``TrainingResumed``; the follow-up record,
opened, a wait in each stage a look waits in (admitted, scheduled, training), the end with its
ledger: 12 writes), so the bound held here is ``writes <= floor + bookkeeping`` (12 per run, 9 per
fallback: its move claim, ``RecoveryStalled`` and ``Requeued``, the record's move decided and made
and a wait in each stage again; 7 per run without the follow-up, whose run claim is created and
completed).  A notice that joins its
run's handling, or comes after its run moved (its Node's cordon decides it), writes nothing
beyond its cordon.  At 10 workers (``bench/mass.py``: floor 13) the same allowance is 25 writes
per run, x1.92 (the full wave measured x1.74 with one replica idle, x1.91 under heavy load:
docs/benchmarks.md).  Writes answered 409 Conflict are allowed
besides (each is contention: a claim another holds, an object changed since it was read,
retried), and so are claim renewals (``mass.claim_renewals``, from the audit log by Lease: a held
claim is renewed every third of its TTL, so a loaded machine's longer handlings renew more; run 92
in docs/development.md failed for want of them).  With two replicas a gang's notices split between
their receives: a handling takes the run's move claim first, so the other replica's notice finds it
held and joins that handling from its replica (a create answered 409, then nothing of its own), or
takes it once that handling let it go and, the run moved after its notice, is done with that move.
The bound still allows what a second handling of a run would write (a second run claim, a move
claim, its own ``Draining`` and ``CheckpointDurable``: 8 per run), from before the move claim was
taken first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.controlplane import ControlPlane
from tests.support.controlplane.world import World

from .mass import Wave, claim_renewals, report, run_wave
from .stage import Aws

pytestmark = pytest.mark.cluster

QUICK = dict(runs=3, workers=2, block_runs=1, admitted_bound_s=10, scheduled_bound_s=30, training_bound_s=60,
             timeout_s=240, settle_s=25)


@pytest.fixture
def sqs_s3(aws: Any) -> Aws:
    return Aws(aws.endpoint_url).open()


#: Per run, the writes a second replica's wave of the same run may add (see the module docstring).
SECOND_REPLICA = 8


def check_writes(result: Any) -> None:
    """The daemon's writes within the floor plus the named bookkeeping (module docstring)."""
    j = result.as_json()
    writes, floor, conflicts = sum(j["api"]["writes"].values()), result.floor(), sum(result.conflicts.values())
    allowed = (floor + sum(result.bookkeeping().values()) + conflicts + result.renewals
               + SECOND_REPLICA * result.wave.runs * (result.wave.replicas - 1))
    assert writes <= allowed, (f"{writes} writes ({writes / result.wave.runs:.1f} per run), floor {floor}, allowed "
                               f"{allowed} ({conflicts} answered 409, {result.renewals} claim renewals): "
                               f"{j['api']['writes']}; bookkeeping {result.bookkeeping()}")


def check_followed(result: Any) -> None:
    """Every run trains again, each requeued once (a gang's two notices are one move) and moved
    again only by its own follow-up's fallback, at most once; the block holds one run, On-Demand
    the others; no notice left in SQS; the writes within the floor plus the bookkeeping."""
    j = result.as_json()
    why = report([result]) + "\n" + json.dumps(j["per_run"], indent=1)
    assert j["ends"] == {"resumed": 3}, why
    assert j["stages_s"]["training"]["n"] == 3, why
    assert j["capacity"] == {"block": 1, "on-demand": 2}, why
    assert not j["moved_twice"] and j["requeues"] == 3, why
    assert all(r["fallbacks"] <= 1 for r in j["per_run"].values()), why
    assert j["sqs_in_flight_at_end"] == 0, why
    check_writes(result)


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
    check_writes(result)


def test_claim_renewals_are_the_updates_beyond_each_kept_claims_completion() -> None:
    """The renewals the bound allows: every update of a claim Lease that was let go (deleted), all
    but the completing one of a Lease kept; not a 409, not a follow-up record's write."""
    calls = [(0.0, "update", "leases", 200, "run-a"), (1.0, "update", "leases", 200, "run-a"),
             (2.0, "update", "leases", 200, "move-a"), (3.0, "delete", "leases", 200, "move-a"),
             (4.0, "update", "leases", 409, "run-a"), (5.0, "update", "leases", 200, "run-b"),
             (6.0, "patch", "leases (follow-up records)", 200, "fu-a")]
    assert claim_renewals(calls) == 2  # run-a: 1 renewal + its completion; move-a: 1; run-b: its completion
