"""``make coverage``'s runner (tests/run_coverage.py): every Python process of the test command is
measured, also one that ends with ``os._exit``, and the test command's exit status is kept."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import coverage
import pytest

from tests import run_coverage

pytestmark = pytest.mark.integration  # it starts Python processes

RUNNER = Path(__file__).resolve().parent / "run_coverage.py"
ROOT = RUNNER.parent.parent

#: A parent that imports one module and starts two children: one calls a function of another
#: module and returns, one calls a third and ends with os._exit (as a Ray worker can).
PARENT = """
import subprocess, sys
import trainer.errors
subprocess.run([sys.executable, "-c", "from resilienced.clock import utcnow; utcnow()"], check=True)
subprocess.run([sys.executable, "-c", "import os; from resilienced.clock import parse_time; "
                "parse_time('2026-12-02T00:00:00Z'); os._exit(0)"], check=True)
sys.exit(EXIT)
"""


#: A process named as Ray's workers are, ended as Ray ends them: below Python (here SIGKILL, once
#: its periodic save holds the line it ran; 240 s at most, then it fails: a guard against a hang,
#: far above the one-second save, for a machine at load average 25).
RAY_WORKER = """
import glob, os, signal, sys, time
import coverage
from resilienced.clock import utcnow
utcnow()
out = os.path.dirname(os.environ["COVERAGE_PROCESS_START"])
line = int(sys.argv[1])
end = time.monotonic() + 240
while time.monotonic() < end:
    for name in glob.glob(os.path.join(out, f".coverage.*pid{os.getpid()}.*")):
        data = coverage.CoverageData(basename=name)
        try:
            data.read()
        except Exception:  # the hook's thread is writing that file (its schema, its rows): next poll
            continue
        if any(line in (data.lines(f) or []) for f in data.measured_files() if f.endswith("clock.py")):
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.1)
sys.exit("the worker's line was not saved in 240 s")
"""


def run(tmp_path: Path, *, exit_code: int = 0,
        command: list[str] | None = None) -> tuple[subprocess.CompletedProcess[str], coverage.CoverageData]:
    out = tmp_path / "out"
    command = command or [sys.executable, "-c", PARENT.replace("EXIT", str(exit_code))]
    done = subprocess.run([sys.executable, str(RUNNER), "--out", str(out), "--", *command],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    data = coverage.CoverageData(basename=str(out / ".coverage"))
    data.read()
    return done, data


def body_line(path: Path, name: str) -> int:
    """The line of the first statement of function ``name`` in ``path``, after its docstring."""
    function = next(node for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.FunctionDef) and node.name == name)
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    return body[0].lineno


def test_the_parent_and_every_child_are_measured_and_the_commands_exit_status_is_kept(tmp_path: Path) -> None:
    done, data = run(tmp_path, exit_code=3)
    assert done.returncode == 3, done.stdout + done.stderr
    clock = ROOT / "resilienced" / "clock.py"
    assert str(ROOT / "trainer" / "errors.py") in data.measured_files()  # the parent
    lines = data.lines(str(clock)) or []
    assert body_line(clock, "utcnow") in lines  # the child that returned
    assert body_line(clock, "parse_time") in lines  # the child that ended with os._exit
    report = (tmp_path / "out" / "coverage.txt").read_text()
    for package in run_coverage.PACKAGES:  # one total per package, after the per-file report
        assert f"\n{package}/" in report
    assert "line coverage (" in done.stdout


def test_a_ray_worker_ended_below_python_keeps_what_it_saved(tmp_path: Path) -> None:
    worker = tmp_path / "default_worker.py"  # the name of Ray's worker processes' script
    worker.write_text(RAY_WORKER)
    clock = ROOT / "resilienced" / "clock.py"
    done, data = run(tmp_path, command=[sys.executable, str(worker), str(body_line(clock, "utcnow"))])
    assert done.returncode == 128 + 9, done.stdout + done.stderr  # SIGKILLed once its line was saved
    assert body_line(clock, "utcnow") in (data.lines(str(clock)) or [])
