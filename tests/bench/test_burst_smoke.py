"""``bench/burst.py --quick`` runs end to end: every notice of the burst ends in a drain.

No wall-clock assertion: the figures are for docs/benchmarks.md, not for a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_quick_burst_drains_every_notice_and_reports_json() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "burst.py"), "--quick"], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.stdout[-2000:]
    report = json.loads(lines[-1])

    assert report["drains"] == report["events"] > 0
    assert set(report["runs"]) == {"memory", "lease"}
    for claims, burst in report["runs"].items():
        assert burst["drains"] == burst["events"] == report["events"], claims
        assert burst["results"] == {"done": report["events"]}, claims
        assert burst["api_errors"].keys() <= {"create events 409"}, claims  # concurrent Event creates only
    assert report["locate"]["cached"]["api_calls"] == 0
    assert report["locate"]["naive_by_name"]["api_calls_per_event"] == 2
