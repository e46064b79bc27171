"""``resilienced replay --strict`` (for CI): exit 3 on an invalid input or a directory with no file."""

from __future__ import annotations

from pathlib import Path

from resilienced.app import cli
from resilienced.app.replay import EXIT_STRICT

from .test_replay import SAMPLES, replay, write
import pytest

pytestmark = pytest.mark.unit

SPOT = SAMPLES / "nth" / "nth-spot-itn.json"


def test_strict_passes_valid_inputs(capsys):
    code, rows, _ = replay("--dry-run", "--json", "--strict", str(SPOT), capsys=capsys)
    assert code == 0 and [r["kind"] for r in rows] == ["spot_interruption"]


def test_strict_fails_on_an_invalid_input_and_names_it(tmp_path: Path, capsys):
    bad = write(tmp_path, "bad.json", '{"source": "custom.app"}')
    code, rows, text = replay("--dry-run", "--json", "--strict", str(SPOT), str(bad), capsys=capsys)
    assert code == EXIT_STRICT == 3
    assert [r["kind"] for r in rows] == ["spot_interruption", "invalid"]  # every row is still written
    assert "1 invalid input(s)" in text and str(bad) in text
    # without --strict the same inputs exit 0
    code, _, _ = replay("--dry-run", "--json", str(SPOT), str(bad), capsys=capsys)
    assert code == 0


def test_an_empty_directory_warns_always_and_fails_only_with_strict(tmp_path: Path, capsys):
    empty = tmp_path / "empty"
    (empty / ".hidden-only").mkdir(parents=True)
    (empty / ".hidden-only" / "x.json").write_text("{}")  # hidden: replay does not read it
    code = cli.main(["replay", "--dry-run", str(SPOT), str(empty)])
    out, err = capsys.readouterr()
    assert code == 0 and f"warning: {empty}: the directory holds no file" in err
    code = cli.main(["replay", "--dry-run", "--strict", str(SPOT), str(empty)])
    _, err = capsys.readouterr()
    assert code == EXIT_STRICT
    assert "holds no file" in err and "1 directory(ies) without a file" in err
