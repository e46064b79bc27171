"""The framework callbacks on a real local multi-node Ray cluster: a run preempted, then resumed
(make test-long); and, in make test, the Hugging Face train function evicted on local ranks (last test).

``examples/hf_trainer_train.py`` (``transformers.Trainer``, ``trainer.integrations.transformers``)
and ``examples/lightning_train.py`` (``lightning.Trainer.fit`` with ``RayDDPStrategy``,
``trainer.integrations.lightning``) run as they are on two 1-CPU nodes: tiny causal LMs built from
a config (two layers, a few thousand parameters), synthetic tokens, a fixed seed, DDP on gloo.
During the run one node is preempted, one of the two ways a node is, and replaced (both ways
reach the ranks as the same Ray Train preemption, so each framework takes one of them here;
``python -m trainer`` plays the SIGTERM in ``test_ray_preemption.py``, the drain in the drill):

- ``hf``: drained through the GCS with reason PREEMPTION and a deadline (what the daemon does),
  killed at the deadline;
- ``lightning``: the node's ``ray start`` gets SIGTERM (what a pod eviction sends: Ray drains the
  node itself), and goes when its drain window ends.

Every rank must save the step it is on before the deadline (a checkpoint the daemon's
own check, ``resilienced.recovery.durable``, finds durable in moto S3 after the FSx stand-in
exported it), train nothing that would be lost, and resume on the replacement at the saved step
+ 1.  The whole run must train each step once and give, bit for bit, the per-step losses of an
uninterrupted run of the same train function at the same world size (local gloo ranks, no Ray):
DDP on CPU with one thread per rank is deterministic, and both frameworks resume the model,
optimizer, LR scheduler, RNG and data position exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from aiobotocore.session import get_session

import framework_ranks
from conftest import DRAIN_TIMEOUT_S, alive_workers, node_labels
from resilienced.aws.s3 import S3Store
from resilienced.local.aws import MotoServer
from resilienced.local.fsx import LocalExporter
from resilienced.local.raycluster import LocalRayCluster
from resilienced.recovery.durable import wait_durable
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.e2e

#: Enough that the run is still training when its node goes: the notice comes after 3 steps and the
#: ranks train on at most until its deadline (DRAIN_TIMEOUT_S: ~20 steps of 0.4 s).
STEPS = 32
#: How each framework's node is preempted (module docstring).
PREEMPTIONS = {"hf": "drain", "lightning": "sigterm"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {"hf": EXAMPLES / "hf_trainer_train.py", "lightning": EXAMPLES / "lightning_train.py"}
BUCKET, REGION = "ckpt", "us-east-1"
_serial = itertools.count(300)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def trained(path: Path) -> list[dict]:
    return [x for x in lines(path) if "step" in x]


def preemption_saves(root: Path) -> dict[int, dict]:
    out = {}
    for manifest in root.glob("step-*/manifest.json"):
        data = json.loads(manifest.read_text())
        if data["reason"] == "preemption":
            out[data["step"]] = data
    return out


class Script:
    """The example script as a process on the Ray cluster, and the files it writes."""

    def __init__(self, framework: str, cluster: LocalRayCluster, out: Path) -> None:
        self.root, self.losses, self.log = out / "ck", out / "losses.jsonl", out / "script.log"
        env = {**os.environ, **cluster.env, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "HF_HUB_OFFLINE": "1"}
        args = [sys.executable, str(SCRIPTS[framework]), "--ray-address", cluster.address,
                "--checkpoint-dir", str(self.root), "--steps", str(STEPS), "--keep", "100",
                "--step-seconds", "0.4", "--losses-out", str(self.losses)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, predicate, *, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                pytest.fail(f"the script exited ({self.proc.returncode}) before {what}\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.tail()}")
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def durable_in_s3(aws: MotoServer, root: Path, *, prefix: str, notice: datetime):
    """Export ``root`` with the FSx stand-in, then run the daemon's check for a post-notice checkpoint."""

    async def check():
        async with get_session().create_client("s3", region_name=REGION, endpoint_url=aws.endpoint_url) as s3:
            if BUCKET not in [b["Name"] for b in (await s3.list_buckets())["Buckets"]]:
                await s3.create_bucket(Bucket=BUCKET)
            exporter = LocalExporter(root=root, bucket=BUCKET, prefix=prefix, endpoint_url=aws.endpoint_url,
                                     region=REGION, poll_interval=0.05)
            async with exporter:
                await exporter.wait_idle(timeout=60)
            assert not exporter.errors, exporter.errors
            return await wait_durable(store=S3Store(client=s3), uri=f"s3://{BUCKET}/{prefix}", notice_time=notice,
                                      deadline=datetime.now(timezone.utc), poll_interval=0.05)

    return asyncio.run(asyncio.wait_for(check(), timeout=120))


def reference_losses(framework: str, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    cfg = {"checkpoint_dir": str(out / "ck"), "losses_out": str(out / "losses.jsonl"), "steps": STEPS,
           "every": 0, "keep": 100, "seed": 0, "step_seconds": 0.0}
    for result in run_ranks(getattr(framework_ranks, framework), 2, cfg, timeout=300):
        result.unwrap()
    return trained(out / "losses.jsonl")


def preempt_and_replace(cluster: LocalRayCluster, script: Script, aws: MotoServer, *, how: str,
                        known: set[int]) -> dict:
    """Preempt a node that runs a rank, wait until it is gone, replace it; the last save it made.

    The ranks save at the notice, train on while the deadline plan allows, save the step they
    are on and hold: the newest preemption save is the one the run resumes from, and the one the
    daemon's check must find durable.
    """
    victim = alive_workers(cluster)[0]
    noticed_at = datetime.now(timezone.utc) - timedelta(milliseconds=1)
    if how == "drain":
        deadline = time.time() + DRAIN_TIMEOUT_S
        assert cluster.drain_node(victim, deadline_ms=int(deadline * 1000))
    else:
        cluster.sigterm_node(victim)  # Ray drains the node itself (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S)
        deadline = time.time() + DRAIN_TIMEOUT_S
    script.wait_for(lambda: set(preemption_saves(script.root)) - known, timeout=DRAIN_TIMEOUT_S + 30,
                    what="a preemption save")
    if how == "drain":
        while time.time() < deadline:  # the instance is reclaimed at the deadline, not before
            time.sleep(0.05)
        cluster.kill_node(victim)
    else:
        script.wait_for(lambda: not victim.running(), timeout=DRAIN_TIMEOUT_S + 60, what="the SIGTERMed node to go")
    saves = {step: m for step, m in preemption_saves(script.root).items() if step not in known}
    last = saves[max(saves)]
    last["trained_before_the_node_went"] = max(x["step"] for x in trained(script.losses))
    last["deadline"] = deadline
    # the daemon's check: the newest checkpoint saved after the notice is durable in S3
    waited = durable_in_s3(aws, script.root, prefix=f"{how}-{last['step']}", notice=noticed_at)
    assert waited.durable and waited.step == last["step"] and waited.manifest.reason == "preemption", waited
    cluster.add_node(labels=node_labels(next(_serial), "on-demand"))
    return last


#: Both frameworks' runs on Ray are in make test-long (docs/development.md, "Long stories"; about
#: 100 CPU-seconds each). make test plays: the guard's save at a SIGTERM and Hugging Face's exact
#: resume on local gloo ranks (the test below); a Ray drain saving every rank's step and the run
#: resuming exactly on the replacement, with python -m trainer (the drill's spot story, which
#: shares the guard's Ray runtime, trainer/runtime.py); what Lightning's resume restores (RNG
#: states, the data position) in its units; and the guard's decisions in its units.
ON_RAY_QUICK = (
    "tests/trainer/test_framework_callbacks.py::test_an_hf_run_evicted_outside_ray_saves_its_step_and_resumes_exactly",
    "tests/local/drill/test_drill.py::test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block",
    "tests/trainer/test_local_resume.py::test_sigterm_saves_the_step_it_is_on_and_the_resumed_run_is_exact",
    "tests/trainer/test_framework_units.py::test_lightning_s_rng_states_come_back_only_at_the_same_world_size",
    "tests/trainer/test_framework_units.py::test_the_resumable_loader_goes_on_where_the_epoch_was_without_loading_the_skipped_rows",
    "tests/trainer/test_framework_units.py::test_after_a_notice_the_guard_trains_on_while_the_deadline_leaves_room",
)


@pytest.mark.long(*ON_RAY_QUICK)
@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_a_preempted_framework_run_saves_its_step_and_resumes_exactly(
    ray_cluster: LocalRayCluster, aws: MotoServer, tmp_path: Path, framework: str
) -> None:
    expected = reference_losses(framework, tmp_path / "reference")
    script = Script(framework, ray_cluster, tmp_path)
    try:
        script.wait_for(lambda: len(trained(script.losses)) >= 3, timeout=240, what="3 steps on Ray")
        save = preempt_and_replace(ray_cluster, script, aws, how=PREEMPTIONS[framework], known=set())
        assert script.proc.wait(timeout=300) == 0, script.tail()
    finally:
        script.kill()

    restores = [x["restored"] for x in lines(script.losses) if "restored" in x]
    steps = trained(script.losses)
    # saved by both ranks before the deadline, and nothing trained after it
    assert save["world_size"] == 2 and save["saved_at_unix"] < save["deadline"]
    assert save["trained_before_the_node_went"] == save["step"] < STEPS
    # resumed at the saved step + 1, every step trained once, bit for bit the uninterrupted run
    assert restores == [0, save["step"]]
    assert Counter(x["step"] for x in steps) == {s: 1 for s in range(1, STEPS + 1)}
    assert steps == expected


def test_an_hf_run_evicted_outside_ray_saves_its_step_and_resumes_exactly(aws: MotoServer, tmp_path: Path) -> None:
    """``examples/hf_trainer_train.py``'s train function on two local gloo ranks (no Ray), one rank
    SIGTERMed after step 5 as a pod eviction sends it, with 1 s of grace: every rank saves the
    step they agree on, trains nothing it would lose, and fails with ``PreemptedError`` at the
    deadline; the daemon's own check finds that save durable in moto S3 once the FSx stand-in
    exported it; run again, the run resumes at the saved step + 1 and gives, bit for bit, the
    losses of the uninterrupted run, each step trained once.  The same on Ray: the test above
    (make test-long)."""
    expected = reference_losses("hf", tmp_path / "reference")
    root, losses = tmp_path / "ck", tmp_path / "losses.jsonl"
    cfg = {"checkpoint_dir": str(root), "losses_out": str(losses), "steps": STEPS, "every": 0, "keep": 100,
           "seed": 0, "step_seconds": 0.2}

    started = datetime.now(timezone.utc) - timedelta(milliseconds=1)
    evicted = run_ranks(framework_ranks.hf_evicted, 2,
                        {**cfg, "evict_rank": 1, "evict_after": 5, "sigterm_grace_s": 1.0}, timeout=300)
    assert [(r.error or "").split(":")[0] for r in evicted] == ["PreemptedError"] * 2, evicted
    saves = preemption_saves(root)
    save = saves[max(saves)]
    assert save["world_size"] == 2 and 5 <= save["step"] < STEPS
    assert max(x["step"] for x in trained(losses)) == save["step"]  # nothing trained after the save
    waited = durable_in_s3(aws, root, prefix="evicted", notice=started)  # no periodic save: only the notice's
    assert waited.durable and waited.step == save["step"] and waited.manifest.reason == "preemption", waited

    for result in run_ranks(framework_ranks.hf, 2, cfg, timeout=300):
        result.unwrap()
    steps = trained(losses)
    assert [x["restored"] for x in lines(losses) if "restored" in x] == [0, save["step"]]
    assert Counter(x["step"] for x in steps) == {s: 1 for s in range(1, STEPS + 1)}
    assert steps == expected
