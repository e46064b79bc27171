"""``trainer.warmup``: a worker's imports started in the background once its train context exists."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from trainer.warmup import WarmupCallback

pytestmark = pytest.mark.unit


def test_the_modules_are_imported_in_the_background_and_a_broken_one_is_left_to_the_train_function(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "warm_probe_ok.py").write_text("LOADED = True\n")
    (tmp_path / "warm_probe_broken.py").write_text("raise ImportError('not in this image')\n")
    (tmp_path / "warm_probe_after.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.WARNING, logger="trainer.warmup")
    WarmupCallback(("warm_probe_ok", "warm_probe_broken", "warm_probe_after")).after_init_train_context()
    end = time.monotonic() + 60
    while not any("warm_probe_broken" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < end, "the warm-up thread did not get to the broken module"
        time.sleep(0.01)
    assert sys.modules["warm_probe_ok"].LOADED
    assert "warm_probe_after" not in sys.modules  # it stops at the first failure: the train function says why
