"""docs/your-trainer.md's example script, run as it is on a real local multi-node Ray cluster.

``python examples/resilient_train.py --ray-address <cluster>`` (a residual MLP classifier with
AdamW and a ``LambdaLR``, not trainer/'s model; FSDP2) trains on two 1-CPU nodes; the node of one rank
is drained through the GCS with reason PREEMPTION and a deadline, as the daemon does, then
killed at the deadline and replaced.  The run must save before the deadline, train nothing that
would be lost, resume at the saved step + 1 on the replacement, and give, bit for bit, the losses
of an uninterrupted run of the same train function at the same world size (computed on local
gloo ranks, without Ray).  Ray Train must have seen the committed checkpoints.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import example_ranks
from conftest import DRAIN_TIMEOUT_S, alive_workers, node_labels
from resilienced.local.raycluster import LocalRayCluster
from tests.support.ranks import run_ranks
from trainer.resilience import verify

#: make test-long (docs/development.md, "Long stories"); make test makes its claims with these, at
#: less cost: the example's train function stopped and resumed on local gloo ranks, bit for bit,
#: and a run drained through the GCS on Ray that saves its step and resumes exactly.
pytestmark = [pytest.mark.e2e, pytest.mark.long(
    "tests/trainer/test_resilience_api.py::test_a_resumed_run_trains_each_step_once_and_reproduces_every_loss_bit_for_bit",
    "tests/trainer/test_resilience_api.py::test_a_checkpoint_torn_mid_save_or_damaged_after_it_is_never_restored",
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
)]

STEPS = 40
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resilient_train.py"
_serial = itertools.count(200)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, *, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the script exited ({proc.returncode}) before {what}\n{log.read_text()[-6000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{log.read_text()[-6000:]}")
        time.sleep(0.1)


def preemption_saves(root: Path) -> dict[int, dict]:
    out = {}
    for manifest in root.glob("step-*/manifest.json"):
        data = json.loads(manifest.read_text())
        if data["reason"] == "preemption":
            out[data["step"]] = data
    return out


@pytest.mark.parametrize("wrap", ["fsdp2"])  # DDP and a plain module: test_resilience_api.py (local ranks)
def test_the_example_script_drained_on_ray_resumes_exactly_on_a_replacement(
    ray_cluster: LocalRayCluster, tmp_path: Path, wrap: str
) -> None:
    reference = example_ranks.config(tmp_path / "ref", tmp_path / "ref.jsonl", steps=STEPS, wrap=wrap)
    for result in run_ranks(example_ranks.train, 2, reference):
        result.unwrap()
    expected = [x for x in lines(tmp_path / "ref.jsonl") if "step" in x]

    root, losses, log = tmp_path / "ck", tmp_path / "losses.jsonl", tmp_path / "script.log"
    env = {**os.environ, **ray_cluster.env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    args = [sys.executable, str(EXAMPLE), "--ray-address", ray_cluster.address, "--checkpoint-dir", str(root),
            "--steps", str(STEPS), "--every", "10", "--keep", "100", "--step-seconds", "0.2", "--wrap", wrap,
            "--losses-out", str(losses), "--result-out", str(tmp_path / "result.json")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: sum("step" in x for x in lines(losses)) >= 3, timeout=240, what="3 steps on Ray",
                 proc=proc, log=log)
        victim = alive_workers(ray_cluster)[0]
        deadline = time.time() + DRAIN_TIMEOUT_S
        assert ray_cluster.drain_node(victim, deadline_ms=int(deadline * 1000))
        wait_for(lambda: preemption_saves(root), timeout=DRAIN_TIMEOUT_S + 30, what="a preemption save",
                 proc=proc, log=log)
        while time.time() < deadline:  # the instance is reclaimed at the deadline, not before
            time.sleep(0.05)
        trained_before_the_kill = max(x["step"] for x in lines(losses) if "step" in x)
        ray_cluster.kill_node(victim)
        ray_cluster.add_node(labels=node_labels(next(_serial), "on-demand"))
        assert proc.wait(timeout=300) == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    saves = preemption_saves(root)
    last = max(saves)
    restores = [x for x in lines(losses) if "restored" in x]
    trained = [x for x in lines(losses) if "step" in x]
    # saved before the deadline by both ranks, and nothing trained after the last save
    assert saves[last]["saved_at_unix"] < deadline and saves[last]["world_size"] == 2
    assert trained_before_the_kill == last < STEPS
    # resumed on the replacement at the saved step + 1, each step trained once, bit for bit
    assert [r["restored"] for r in restores] == [0, last]
    assert trained[last]["step"] == last + 1
    assert Counter(x["step"] for x in trained) == {s: 1 for s in range(1, STEPS + 1)}
    assert trained == expected
    # Ray Train saw the committed checkpoints: the resumed attempt's get_checkpoint() and the
    # driver's Result name step directories that verify, the Result the last one
    assert restores[0]["ray_checkpoint"] is None and restores[1]["ray_checkpoint"] in saves
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is None and result["pointer"]["step"] == STEPS
    assert verify(result["pointer"]["path"]).reason == "final"
    assert result["metrics"]["step"] == STEPS and result["metrics"]["loss"] == expected[-1]["loss"]
