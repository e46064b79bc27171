"""``bench/settings.py`` runs end to end, and its pydantic-settings model reads what ours reads.

No wall-clock assertion: the figures are for docs/benchmarks.md, not for a test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("pydantic_settings")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_settings", ROOT / "bench" / "settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compared_model_has_our_fields_and_reads_the_same_flags_and_env(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from resilienced.settings import Settings, documented_options

    bench = load_bench()
    (tmp_path / "bench_settings_model.py").write_text(bench.pydantic_model())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, value in bench.ENVIRON.items():
        monkeypatch.setenv(name, value)
    import bench_settings_model

    theirs = bench_settings_model.Settings(_cli_parse_args=bench.ARGV)
    ours = Settings.from_args(bench.ARGV, bench.ENVIRON).validate()
    assert len(type(theirs).model_fields) == len(documented_options())
    assert theirs.queue_url == ours.queue.queue_url and theirs.concurrency == ours.queue.concurrency == 20
    assert theirs.mode == ours.mode.mode and theirs.claims_namespace == ours.mode.claims_namespace == "ml"
    assert theirs.log_level == ours.log.log_level == "info"


def test_the_bench_prints_both_rows_and_the_ratio() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "settings.py"), "--runs", "1"], cwd=ROOT,
                         check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = {line.split()[0] for line in run.stdout.splitlines() if line.strip()}
    assert {"ours", "pydantic", "daemon", "ratio", "image:"} <= rows, run.stdout
