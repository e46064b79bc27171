"""A preempted node of a real local multi-node Ray cluster, as Kubernetes causes it.

Two 1-CPU worker nodes each run one rank of ``python -m trainer --ray-address <cluster>``.  One
node is sent SIGTERM on its ``ray start --block`` (what Kubernetes does to an evicted pod; Ray
drains the node itself, with a deadline).  Every rank must save the same step, train nothing that
would be lost, and the run must resume on a replacement node and produce, bit for bit, the losses
of an uninterrupted run with the same seed and world size computed without Ray; then a new driver
(a RayJob retry) goes on from where the run ended.

A drain through the GCS with a deadline (what the daemon does) is played end to end by the drill
(tests/local/drill), and on Ray by the example script (test_your_trainer.py), the framework
callbacks (test_framework_callbacks.py) and the elastic run (test_elastic_ray.py).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from conftest import DRAIN_TIMEOUT_S, TrainerRun, alive_workers, node_labels
from resilienced.local.raycluster import LocalRayCluster

#: make test-long (docs/development.md, "Long stories"); make test makes its claims with these, at
#: less cost: python -m trainer drained on Ray (Ray Train's preemption on a drain), every rank
#: saving the step before the deadline and resuming exactly (the drill); a SIGTERM saving the step
#: and a new driver resuming where the run ended (local ranks).
pytestmark = [pytest.mark.e2e, pytest.mark.long(
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
    "tests/trainer/test_local_resume.py::test_sigterm_saves_the_step_it_is_on_and_the_resumed_run_is_exact",
    "tests/trainer/test_checkpoint_manifest.py::test_prune_keeps_the_newest_k_committed_checkpoints",
)]

STEPS = 60  # one preemption: the deadline plan trains up to ~30 steps of 0.2 s in the 8 s window
ARGS = ["--steps", str(STEPS), "--min-step-seconds", "0.2"]
_serial = itertools.count(100)


def ray_env(cluster: LocalRayCluster) -> dict[str, str]:
    """The cluster's env, and Ray Train's controller polling its workers every 0.5 s (not 2 s):
    it sees the deadline pass sooner, so the test waits less for the restart."""
    return {**cluster.env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


def start_training(cluster: LocalRayCluster, trainer_runs) -> TrainerRun:
    run = trainer_runs.start(["--ray-address", cluster.address, *ARGS], env=ray_env(cluster))
    run.wait_until(lambda r: len(r.metrics) >= 3, timeout=240, what="3 steps trained on Ray")
    return run


def wait_for_the_last_save(run: TrainerRun, *, preemptions: int) -> dict:
    """Wait until the ranks saved for the ``preemptions``-th notice and wait for teardown; the
    manifest of that save."""
    run.wait_until(lambda r: len(r.events_named("waiting_for_teardown")) == preemptions,
                   timeout=DRAIN_TIMEOUT_S + 30, what="the ranks to save and wait for teardown")
    waiting = run.events_named("waiting_for_teardown")[-1]
    saves = [e for e in run.events_named("checkpoint_committed") if e["reason"] == "preemption"]
    assert saves and saves[-1]["step"] == waiting["step"]
    return json.loads((Path(saves[-1]["path"]) / "manifest.json").read_text())


def expect_saved_then_resumed_exactly(run: TrainerRun, reference, manifests: list[dict]) -> list[dict]:
    """What each preemption must lead to; returns the preemption notices, in order."""
    notices = run.events_named("preemption_notice")
    waiting = run.events_named("waiting_for_teardown")
    started = run.events_named("started")
    assert len(notices) == len(waiting) == len(manifests)
    for notice, held, manifest in zip(notices, waiting, manifests):
        assert notice["source"] == "ray"
        assert manifest["step"] == held["step"] and manifest["reason"] == "preemption"
        # every rank saved that step: the manifest lists the files of both ranks
        files = {f["path"] for f in manifest["files"]}
        assert manifest["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp", "rng-rank0.pt", "rng-rank1.pt"} <= files
        assert notice["deadline_ms"] is not None
        assert manifest["saved_at_unix"] < notice["deadline_ms"] / 1000  # committed before the deadline
    # nothing was trained after each save, and each restart resumed right there
    for attempt, held in zip(started, waiting):
        assert max(m["step"] for m in run.metrics if m["attempt"] == attempt["attempt"]) == held["step"]
    assert [(e["world_size"], e["resumed_from_step"]) for e in started] == [
        (2, None), *((2, held["step"]) for held in waiting)]
    assert run.step_counts() == {step: 1 for step in range(1, STEPS + 1)}  # no step trained twice
    # bit for bit the losses of an uninterrupted run, computed without Ray
    assert run.losses() == {step: loss for step, loss in reference([]).items() if step <= STEPS}
    return notices


def test_a_run_sigterm_ed_saves_its_step_and_resumes_exactly_and_a_new_driver_goes_on(
    ray_cluster: LocalRayCluster, trainer_runs, reference
) -> None:
    """SIGTERM to a node's ``ray start`` (a pod eviction: Ray drains the node itself, with a
    deadline); the node replaced.  Then a new driver on the same run (a RayJob retry) resumes
    where the run ended."""
    run = start_training(ray_cluster, trainer_runs)
    victim = alive_workers(ray_cluster)[0]
    signalled = time.time()
    ray_cluster.sigterm_node(victim)  # Ray drains the node itself (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)
    evicted = wait_for_the_last_save(run, preemptions=1)
    gone_by = time.monotonic() + DRAIN_TIMEOUT_S + 60
    while victim.running():  # the node goes by itself once its drain window is over
        assert time.monotonic() < gone_by, "the SIGTERMed node did not go away"
        time.sleep(0.1)
    gone_at = time.time()
    ray_cluster.add_node(labels=node_labels(next(_serial), "on-demand"))

    assert run.wait(300) == 0, run.log
    notice, = expect_saved_then_resumed_exactly(run, reference, [evicted])
    # Ray's PreemptionInfo carries the deadline of the drain Ray began on the SIGTERM
    assert signalled * 1000 < notice["deadline_ms"] <= (gone_at + 1) * 1000

    # A new driver on the same run (a RayJob retry) resumes where the run ended, although the
    # trainer pruned checkpoints that Ray Train had been told about.
    again = trainer_runs.run(["--ray-address", ray_cluster.address, *ARGS[2:], "--steps", str(STEPS + 2)],
                             env=ray_env(ray_cluster), timeout=300)
    assert again.events_named("started")[-1]["resumed_from_step"] == STEPS
    assert again.step_counts() == {step: 1 for step in range(1, STEPS + 3)}
    assert again.losses() == {step: loss for step, loss in reference([]).items() if step <= STEPS + 2}
