"""Scenario 4: coverage-guided fuzzing of ``intake.read`` with atheris for a fixed time budget.

The corpus is seeded with every payload shape of tests/intake/payloads.py (each kind, SNS-wrapped
and not); libFuzzer mutates from there, guided by the coverage of ``resilienced`` and ``handlers``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.chaos.scenarios import Tally
from tests.intake import payloads as p

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path(__file__).with_name("fuzz_intake.py")


def seeds() -> list[bytes]:
    events = [p.spot(), p.reservation_interruption(), p.block_expiry(), p.health(), p.state_change(),
              p.rebalance(), p.asg(), p.asg_direct(), p.asg(transition="autoscaling:TEST_NOTIFICATION")]
    return [json.dumps(e).encode() for e in events] + [json.dumps(p.sns(e)).encode() for e in events]


def scenario_fuzz(*, seconds: int) -> Tally:
    tally = Tally("fuzz", f"atheris on intake.read, {seconds} s")
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for k, seed in enumerate(seeds()):
            (corpus / f"seed-{k}").write_bytes(seed)
        proc = subprocess.run(
            [sys.executable, str(TARGET), str(corpus), f"-max_total_time={seconds}", "-print_final_stats=1",
             "-max_len=4096", "-timeout=10", "-rss_limit_mb=2048"],
            cwd=tmp, capture_output=True, text=True, timeout=seconds + 300,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        out = proc.stdout + proc.stderr
        runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
        cov = re.findall(r"cov: (\d+) ft: (\d+)", out)
        tally.injected = int(runs.group(1)) if runs else 0
        tally.extra.update(returncode=proc.returncode, corpus=len(list(corpus.iterdir())),
                           coverage_edges=int(cov[-1][0]) if cov else 0, features=int(cov[-1][1]) if cov else 0)
        crashes = sorted(Path(tmp).glob("crash-*")) + sorted(Path(tmp).glob("timeout-*"))
        if proc.returncode != 0 or crashes:
            tally.violations.append(f"fuzzer stopped (exit {proc.returncode}); inputs: "
                                    f"{[c.read_bytes()[:200] for c in crashes]}; tail: {out[-2000:]}")
        else:
            tally.survived = tally.injected
    return tally
