"""The drill, as CI runs it: the whole chain on this machine, checked through its JSON report.

Each test runs ``resilienced drill`` as a subprocess (moto, a real multi-node Ray cluster, the
trainer with FSDP2 on gloo, the FSx stand-in, the daemon in ray mode) with small sizes, then
checks the report and that nothing the drill started is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SMALL = ["--workers", "2", "--steps", "50", "--interrupt-at-step", "10", "--checkpoint-every", "5",
         "--notice-seconds", "10", "--step-seconds", "0.4", "--timeout", "240"]


def drill(tmp_path: Path, *args: str) -> dict:
    short = Path(tempfile.mkdtemp(prefix="dt-", dir="/tmp"))  # Ray's unix sockets need a short path
    try:
        return _drill(tmp_path, short / "w", *args)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _drill(tmp_path: Path, workdir: Path, *args: str) -> dict:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "resilienced", "drill", *SMALL, *args, "--workdir", str(workdir),
         "--json-report", str(report)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert report.exists(), f"no report; exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # nothing is left behind without --keep: the work dir (ray temp dir, checkpoints, logs) is gone
    assert not workdir.exists(), f"the drill left {workdir} behind"
    leftovers = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes of the drill still running: {leftovers}"
    data = json.loads(report.read_text())
    assert proc.returncode == (0 if data["ok"] else 1), proc.stderr[-2000:]
    return data


def test_a_spot_notice_costs_no_step_and_the_run_lands_on_the_capacity_block(tmp_path: Path) -> None:
    report = drill(tmp_path, "--scenario", "spot", "--spot-capacity", "0")
    assert report["ok"], json.dumps(report, indent=2)
    assert report["steps_lost"] == 0 and report["steps_trained_twice"] == 0
    assert report["resumed_at_step"] == report["checkpoint_step"] + 1
    assert report["capacity"] == "capacity-block"
    assert report["losses_match_uninterrupted"] is True
    # causal order: saved after the notice, then verified in S3 (no wall-clock bound here)
    assert 0 <= report["notice_to_checkpoint_s"] <= report["notice_to_durable_s"]


def test_an_abrupt_loss_resumes_from_the_last_periodic_checkpoint_and_says_what_it_cost(tmp_path: Path) -> None:
    report = drill(tmp_path, "--scenario", "abrupt")
    assert report["ok"], json.dumps(report, indent=2)
    # no notice: the run resumes from the newest periodic checkpoint (every 5 steps)
    assert report["checkpoint_step"] % 5 == 0 and report["checkpoint_step"] <= report["interrupted_at_step"]
    assert report["steps_lost"] == report["interrupted_at_step"] - report["checkpoint_step"]
    assert report["steps_lost"] == report["steps_trained_twice"]
    assert report["notice_to_checkpoint_s"] is None
    assert report["losses_match_uninterrupted"] is True
