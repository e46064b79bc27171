"""The reliability campaign's quick form (``python -m tests.chaos.campaign --quick``) as tests.

Each scenario runs the real daemon processes against moto and the emulated API server (see
tests/chaos/world.py) and lists every invariant it saw broken; a test fails naming them.
``make chaos`` runs the full form and docs/reliability.md tabulates its figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from resilienced.local.aws import MotoServer
from tests.chaos import campaign

pytestmark = pytest.mark.e2e


def _run(name: str, tmp_path: Path, moto: MotoServer | None = None) -> campaign.scenarios.Tally:
    tally = campaign.run(name, quick=True, workdir=tmp_path, moto=moto)
    assert not tally.violations, "\n".join(tally.violations)
    return tally


def test_flood_with_bad_input_and_a_replica_killed_halfway(moto_server: MotoServer, tmp_path: Path) -> None:
    tally = _run("flood", tmp_path, moto_server)
    assert tally.events_lost == 0 and tally.duplicate_drains == 0 and tally.duplicate_requeues == 0
    assert tally.extra["dead_lettered"] == tally.extra["bad"]


def test_replica_killed_at_each_phase_of_a_recovery(moto_server: MotoServer, tmp_path: Path) -> None:
    tally = _run("kill", tmp_path, moto_server)
    assert tally.survived == tally.injected == len(campaign.scenarios.PHASES)


def test_fuzzing_intake_finds_nothing(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    tally = _run("fuzz", tmp_path)
    assert tally.injected > 0 and tally.survived == tally.injected


def test_backends_failing_then_recovering(moto_server: MotoServer, tmp_path: Path) -> None:
    tally = _run("backends", tmp_path, moto_server)
    assert tally.survived == tally.injected == len(tally.extra["faults"])
    # the EC2 fault: DescribeCapacityReservations throttled while a block has room; the run went onto it
    assert tally.extra["ec2"]["ec2-reservations-503"]["purchases"] == 0


def test_trainer_killed_at_each_phase_of_a_save(moto_server: MotoServer, tmp_path: Path) -> None:
    tally = _run("checkpoint", tmp_path, moto_server)
    assert tally.survived == tally.injected == len(campaign.checkpoint_crash.ckpt_ranks.PHASES)


def test_ray_gcs_stopped_then_resumed(moto_server: MotoServer, tmp_path: Path) -> None:
    tally = _run("gcs", tmp_path, moto_server)
    assert tally.survived == tally.injected == len(tally.extra["faults"]) == 1
    trial = tally.extra["trials"]["gcs-stop"]
    assert trial["drain_requests"] == 1 and trial["checkpoint_verified"] and trial["requeue_steps"] == 1
