"""Saving and resuming without Ray (``--ray-address local``: FSDP2 on gloo, one process per rank).

Crash safety, the SIGTERM path, async saves and resharding, each checked against the losses of
an uninterrupted run with the same seed: a resumed run must reproduce them bit for bit.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import same_steps

pytestmark = pytest.mark.e2e

#: A model small enough that a local run is mostly process start-up.
SMALL = ["--d-model", "32", "--n-heads", "4", "--seq-len", "16"]
LOCAL = ["--ray-address", "local", *SMALL]
EXIT_PREEMPTED = 75
EXIT_FAILED = 1


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step}" / "manifest.json").read_text())


#: One phase through ``python -m trainer --crash-at``: the kill at every phase of a save (in a shard,
#: after the data files, a torn manifest, before the rename, an async save in flight) and the
#: reason each partial checkpoint is rejected with are the campaign's scenario 5
#: (tests/chaos/test_campaign.py::test_trainer_killed_at_each_phase_of_a_save). In make test-long
#: (docs/development.md, "Long stories"): make test has that scenario, and ``--crash-at`` with an
#: exact resume in the next test.
@pytest.mark.long(
    "tests/chaos/test_campaign.py::test_trainer_killed_at_each_phase_of_a_save",
    "tests/trainer/test_local_resume.py::test_async_checkpoints_resume_exactly_also_after_a_crash_right_after_the_rename",
    "tests/trainer/test_resilience_api.py::test_a_checkpoint_torn_mid_save_or_damaged_after_it_is_never_restored",
)
@pytest.mark.parametrize(
    ("phase", "rejected"),
    [("manifest-written", "incomplete: manifest.json written but the directory was never committed")],
    ids=["after-manifest-before-rename"],
)
def test_a_crash_during_a_save_never_resumes_a_partial_checkpoint(
    trainer_runs, reference, phase: str, rejected: str
) -> None:
    args = [*LOCAL, "--steps", "8", "--checkpoint-every", "4"]
    crashed = trainer_runs.run([*args, "--crash-at", f"{phase}:8"], expect=EXIT_FAILED)
    assert sorted(p.name for p in crashed.checkpoint_dir.glob("step-*")) == ["step-4", "step-8.partial"]

    resumed = trainer_runs.run(args)

    assert [e["resumed_from_step"] for e in resumed.events_named("started")] == [None, 4]
    why = [(Path(e["path"]).name, e["why"]) for e in resumed.events_named("checkpoint_rejected")]
    assert len(why) == 1 and why[0][0] == "step-8.partial" and why[0][1].startswith(rejected)
    assert sorted(p.name for p in resumed.checkpoint_dir.glob("step-*")) == ["step-4", "step-8"]
    assert resumed.losses() == same_steps(reference(SMALL), resumed.losses())


def test_async_checkpoints_resume_exactly_also_after_a_crash_right_after_the_rename(
    trainer_runs, reference
) -> None:
    args = [*LOCAL, "--steps", "12", "--checkpoint-every", "4", "--async-save"]
    crashed = trainer_runs.run([*args, "--crash-at", "committed:8"], expect=EXIT_FAILED)
    assert [e["step"] for e in crashed.events_named("checkpoint_committed")] == [4]  # 8: crashed at its event

    resumed = trainer_runs.run(args)

    assert resumed.events_named("started")[-1]["resumed_from_step"] == 8
    assert resumed.events_named("checkpoint_rejected") == []
    assert resumed.losses() == same_steps(reference(SMALL), resumed.losses())


def test_sigterm_saves_the_step_it_is_on_and_the_resumed_run_is_exact(trainer_runs, reference) -> None:
    args = [*LOCAL, "--steps", "40"]
    run = trainer_runs.start([*args, "--min-step-seconds", "0.1", "--sigterm-grace-s", "3", "--save-margin-s", "0.5"])
    run.wait_until(lambda r: len(r.metrics) >= 6, timeout=120, what="6 trained steps")
    run.signal(signal.SIGTERM)
    assert run.wait(120) == EXIT_PREEMPTED, run.log

    notice, = run.events_named("preemption_notice")
    waiting, = run.events_named("waiting_for_teardown")
    committed = {e["step"]: e for e in run.events_named("checkpoint_committed")}
    assert notice["source"] == "sigterm" and notice["deadline_ms"] is not None
    assert notice["step"] in committed  # saved at once (or had just saved it)
    assert waiting["step"] in committed and committed[waiting["step"]]["reason"] == "preemption"
    assert max(run.losses()) == waiting["step"] < 40  # nothing trained after the last save
    assert manifest(run.checkpoint_dir, waiting["step"])["saved_at_unix"] <= notice["deadline_ms"] / 1000.0

    resumed = trainer_runs.run(args)

    assert resumed.events_named("started")[-1]["resumed_from_step"] == waiting["step"]
    assert resumed.step_counts() == {step: 1 for step in range(1, 41)}  # no step trained twice
    assert resumed.losses() == same_steps(reference(SMALL), resumed.losses())


@pytest.mark.long(  # make test-long (docs/development.md, "Long stories"); make test reshards with these
    "tests/trainer/test_resilience_api.py::test_a_checkpoint_of_two_ranks_resumes_on_one",
    "tests/trainer/test_elastic_units.py::test_a_world_size_change_is_exact_up_to_float_rounding",
    "tests/trainer/test_elastic_units.py::test_a_resize_request_saves_the_step_the_ranks_are_on_and_a_larger_world_resumes_it",
)
def test_a_checkpoint_loads_into_another_world_size_both_ways(trainer_runs, reference) -> None:
    common = [*LOCAL, "--dropout", "0", "--checkpoint-every", "0"]
    trainer_runs.run([*common, "--num-workers", "2", "--steps", "4"])
    trainer_runs.run([*common, "--num-workers", "1", "--steps", "8"])
    resumed = trainer_runs.run([*common, "--num-workers", "2", "--steps", "12"])

    started = [(e["world_size"], e["resumed_from_step"]) for e in resumed.events_named("started")]
    assert started == [(2, None), (1, 4), (2, 8)]
    assert [manifest(resumed.checkpoint_dir, s)["world_size"] for s in (8, 12)] == [1, 2]
    # The same weights and optimizer state in another layout: equal to float32 rounding (the
    # reduction order differs).  Lost optimizer state would show at once (Adam's first steps
    # differ in size).
    expected = reference([*SMALL, "--dropout", "0"])
    for step, loss in resumed.losses().items():
        assert loss == pytest.approx(expected[step], abs=2e-5), step
