"""An elastic run (``python -m trainer --num-workers 3 --min-workers 2``) on a real local multi-node Ray cluster.

One run checks every point of issue #15's trainer side and both ways an elastic run restarts
after a lost node.  Three 1-CPU worker nodes train; a node is drained through the GCS with reason
PREEMPTION and a deadline (as the daemon does) and goes at the deadline, twice:

1. the daemon's record says its replacement joins right after the deadline, and a restart costs
   the run more than it would gain at 2: the run holds its restart until the replacement joins and
   restarts once, at 3, from the step saved at the notice;
2. no record: the two survivors resume at world size 2 at once from the step saved at the notice
   (no step lost); a node joins and the run grows back to 3, saving the step it is on before Ray
   Train restarts it (``trainer.elastic``).

Every step is trained exactly once, so the samples trained are those of an uninterrupted run, and
the losses are, bit for bit, those of an uninterrupted run (without Ray) with the same world sizes
at the same steps (3, then 2, then 3: DCP reshards its checkpoints as in the run).  Each new worker
group measures what its (re)start cost and says why it chose its size (``trainer.restarts``).
One run plays both stories: a Ray Train run's start costs ~25 CPU-seconds here (docs/development.md).

The global batch is 12: 4 rows per rank at world size 3, 6 at 2 (an uneven share, weighted, is
checked exactly in test_elastic_units.py).  A fixed-size run is unchanged: test_ray_preemption.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import DRAIN_TIMEOUT_S, SMALL, TrainerRun, alive_workers, exactly_workers, node_labels
from resilienced.local.raycluster import LocalRayCluster
from resilienced.ray.cluster import INSTANCE_ID_LABEL
from trainer import replacement, restarts

#: make test-long (docs/development.md, "Long stories"): a three-worker Ray Train run with two
#: restarts, the suite's costliest test; make test makes its claims with these, at less cost.
pytestmark = [pytest.mark.e2e, pytest.mark.long(
    # a resize saves the step the ranks are on; a world of another size resumes it, exactly
    "tests/trainer/test_elastic_units.py::test_a_resize_request_saves_the_step_the_ranks_are_on_and_a_larger_world_resumes_it",
    "tests/trainer/test_elastic_units.py::test_a_world_size_change_is_exact_up_to_float_rounding",
    # when the run waits for a replacement and when it shrinks at once
    "tests/trainer/test_replacement_decision.py::test_the_run_waits_when_the_replacement_comes_before_shrinking_pays",
    "tests/trainer/test_replacement_decision.py::test_the_wait_ends_when_the_replacement_joins",
    # the daemon's side of an elastic run on a real Ray cluster
    "tests/ray/test_requeue.py::test_elastic_keeps_what_it_got_and_waits_for_the_rest",
    "tests/ray/test_requeue.py::test_elastic_second_notice_adds_nothing_for_the_same_worker_and_one_for_another",
    # a drain through the GCS that a fixed-size run saves at and resumes from on Ray
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
)]

#: Room for both notices' windows (~30 steps each), the hold, and the time the run takes at 2
#: before the joined node lets it grow.
STEPS = 180
MODEL = [*SMALL, "--dropout", "0", "--batch-size", "12", "--checkpoint-every", "20"]
_serial = itertools.count(300)


def forget_the_autoscaling_coordinator(cluster: LocalRayCluster) -> None:
    """Ray Train sizes an elastic run from the AutoscalingCoordinator, a detached actor that reads
    the cluster's nodes when it starts and then every 20 s (``TICK_INTERVAL_S`` in
    ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py, Ray 2.60).  On the
    shared cluster one left by an earlier run may not yet know the worker added for this test, and
    the run would start at 2.  Ended here, the run starts a new one, which reads the nodes as they are."""
    code = ("import ray, sys\nray.init(address=sys.argv[1])\n"
            "try:\n    actor = ray.get_actor('AutoscalingCoordinator', namespace='AutoscalingCoordinator')\n"
            "except ValueError:\n    sys.exit(0)\nray.kill(actor, no_restart=True)\n")
    done = subprocess.run([sys.executable, "-c", code, cluster.address], env={**os.environ, **cluster.env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def three_workers(ray_cluster: LocalRayCluster) -> Iterator[LocalRayCluster]:
    """Three alive worker nodes for the run's max, known to the run's sizing; the session's two
    given back afterwards."""
    exactly_workers(ray_cluster, 3)
    forget_the_autoscaling_coordinator(ray_cluster)
    try:
        yield ray_cluster
    finally:
        exactly_workers(ray_cluster, 2)


def attempts(run: TrainerRun) -> list[tuple[int, int | None]]:
    return [(e["world_size"], e["resumed_from_step"]) for e in run.events_named("started")]


def drain_at_a_deadline(cluster: LocalRayCluster, run: TrainerRun, victim, *, holds: int) -> None:
    """Drain ``victim`` through the GCS with reason PREEMPTION and a deadline, as the daemon does;
    return once the ranks have saved for it (their ``holds``-th hold) and the deadline has passed."""
    deadline = time.time() + DRAIN_TIMEOUT_S
    assert cluster.drain_node(victim, deadline_ms=int(deadline * 1000))
    run.wait_until(lambda r: len(r.events_named("waiting_for_teardown")) >= holds, timeout=DRAIN_TIMEOUT_S + 30,
                   what="the ranks to save and wait for teardown")
    while time.time() < deadline:  # the instance is reclaimed at the deadline
        time.sleep(0.05)


def test_an_elastic_run_waits_for_a_replacement_due_soon_shrinks_when_none_is_due_and_grows_back(
    three_workers: LocalRayCluster, trainer_runs
) -> None:
    """Two notices on one run, the two ways an elastic run restarts after a lost node.

    First, the daemon's record (``trainer.replacement``, as ``resilienced.ray.replacement`` writes
    it) says the replacement joins right after the deadline, and the run measured that a restart
    costs it 120 s (its ``.restart-cost``, written here in its place: the real one is a few
    seconds, too close to the time a node takes to start on a busy machine).  Shrinking cannot
    pay, so the run holds its restart until the replacement joins and restarts once, at 3, as a
    gang would.  Then a second node goes with no record: the run goes on at 2 at once, and grows
    back to 3 when a node joins, saving the step it is on before Ray Train restarts it."""
    ray_cluster = three_workers
    env = {**ray_cluster.env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    pace = trainer_runs.out / "step-seconds"
    run = trainer_runs.start(["--ray-address", ray_cluster.address, "--num-workers", "3", "--min-workers", "2",
                              "--resize-interval-s", "2", "--min-step-seconds", "0.2", "--steps", str(STEPS), *MODEL,
                              "--step-seconds-file", str(pace)], env=env)
    run.wait_until(lambda r: r.events_named("restarted"), timeout=240, what="the first step (its start measured)")
    cost = run.checkpoint_dir / restarts.COST
    cost.write_text(json.dumps({**json.loads(cost.read_text()), "seconds": 120.0}))

    # 1. a replacement is due right after the deadline: the run waits for it
    victim = alive_workers(ray_cluster)[-1]
    record = {"lost_instance_id": victim.labels[INSTANCE_ID_LABEL], "capacity": "on-demand", "asked_at": time.time(),
              "expected_join_s": DRAIN_TIMEOUT_S + 1.0, "basis": "test", "replacements": [], "joined_s": None}
    with ray_cluster._gcs() as raw:
        raw.internal_kv_put(replacement.key(victim.node_id).encode(), json.dumps(record).encode(), True,
                            namespace=replacement.NAMESPACE.encode(), timeout=10)
    drain_at_a_deadline(ray_cluster, run, victim, holds=1)
    ray_cluster.terminate_node(victim)
    ray_cluster.add_node(labels=node_labels(next(_serial), "on-demand"))  # the replacement joins
    run.wait_until(lambda r: len(r.events_named("started")) == 2 and r.metrics[-1]["attempt"] == r.events_named(
        "started")[-1]["attempt"], timeout=240, what="the run training again after the replacement joined")

    # 2. no replacement is due: the run goes on at 2 at once, then grows back when a node joins
    victim = alive_workers(ray_cluster)[-1]
    drain_at_a_deadline(ray_cluster, run, victim, holds=2)
    ray_cluster.kill_node(victim)
    run.wait_until(lambda r: any(m["world_size"] == 2 for m in r.metrics), timeout=120,
                   what="the survivors training at world size 2")
    # The run at 2 must not end before it grows: the node's start and Ray Train's sight of it (its
    # AutoscalingCoordinator reads the nodes every 20 s) take a minute on a loaded machine, longer
    # than the steps left at 0.2 s.  Steps of 2 s (the run's test hook) until it has grown back.
    slow = pace.with_suffix(".new")
    slow.write_text("2")
    slow.rename(pace)
    ray_cluster.add_node(labels=node_labels(next(_serial), "on-demand"))  # a node joins
    run.wait_until(lambda r: len(r.events_named("started")) == 4, timeout=240, what="the run grown back to 3")
    pace.unlink()
    assert run.wait(300) == 0, run.log

    notices = run.events_named("preemption_notice")
    held = [e["step"] for e in run.events_named("waiting_for_teardown")]
    resize_saves = [e for e in run.events_named("checkpoint_committed") if e["reason"] == "resize"]
    assert len(notices) == 2 and len(held) == 3 and len(resize_saves) == 1, run.log
    assert [n["source"] for n in notices] == ["ray", "ray"]
    # 3 -> 3 once the replacement joined (never at 2), 3 -> 2 right after the second node went,
    # each from the step saved for its notice; 2 -> 3 from the step saved for the resize
    assert attempts(run) == [(3, None), (3, held[0]), (2, held[1]), (3, resize_saves[0]["step"])]
    assert held[2] == resize_saves[0]["step"]
    by_attempt: dict[int, list[int]] = {}
    for m in run.metrics:
        by_attempt.setdefault(m["attempt"], []).append(m["step"])
    first, second, third, fourth = sorted(by_attempt)
    assert max(by_attempt[first]) == held[0]  # nothing trained after the save: 0 steps lost
    assert min(by_attempt[second]) == held[0] + 1 and max(by_attempt[second]) == held[1]
    assert min(by_attempt[third]) == held[1] + 1 and max(by_attempt[third]) == held[2]
    assert min(by_attempt[fourth]) == held[2] + 1
    assert {m["world_size"] for m in run.metrics if m["attempt"] == third} == {2}
    assert run.step_counts() == {step: 1 for step in range(1, STEPS + 1)}  # the uninterrupted run's samples, once

    # every group measured its (re)start, from the size decision to its first step, and said why
    measured = run.events_named("restarted")
    assert [(e["kind"], e["world_size"]) for e in measured] == [
        ("start", 3), ("restart", 3), ("restart", 2), ("resize", 3)], measured
    assert all(e["seconds"] > 0 and 0 < sum(e["phases"].values()) <= e["seconds"] + 0.01 for e in measured)
    assert measured[1]["decision"]["choice"] == "wait" and measured[1]["decision"]["outcome"] == "joined", measured[1]
    assert measured[2]["decision"]["choice"] == "shrink" and "no record from the daemon" in measured[2]["decision"]["reason"]

    reference = TrainerRun(run.out.parent / "reference")
    for world_size, last in ((3, held[1]), (2, held[2]), (3, STEPS)):  # the run's world sizes, one after the other
        reference.start(["--ray-address", "local", "--num-workers", str(world_size), "--steps", str(last), *MODEL])
        assert reference.wait(240) == 0, reference.log
    assert run.losses() == reference.losses()  # bit for bit
