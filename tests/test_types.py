"""The type check make test runs (issue #41): mypy, as pinned in the test extra, at zero errors on the
modules ``[tool.mypy] files`` of pyproject.toml names; the named core is among them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # it runs mypy in a process of its own

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
#: What issue #41 names: the model, the ports, the recovery, the follow-up, the consumer, intake and
#: the pure capacity decision.
CORE = ("resilienced/model.py", "resilienced/ports.py", "resilienced/recovery", "resilienced/followup",
        "resilienced/consumer", "resilienced/intake", "resilienced/capacity/decision.py")


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_named_core_is_checked() -> None:
    files = tomllib.loads(PYPROJECT.read_text())["tool"]["mypy"]["files"]
    assert set(CORE) <= set(files), f"not type-checked: {sorted(set(CORE) - set(files))}"
    assert all((ROOT / f).exists() for f in files), [f for f in files if not (ROOT / f).exists()]


def test_the_checked_modules_have_no_type_error() -> None:
    done = mypy()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_the_check_fails_on_a_type_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from resilienced.model import Capacity\n\nwhere: Capacity = 'spot'\n")
    done = mypy(str(bad))
    assert done.returncode == 1 and 'Incompatible types in assignment (expression has type "str", variable has ' \
        'type "Capacity")' in done.stdout, done.stdout + done.stderr
