"""``save_seconds`` of the checkpoint manifest (issue #43: the save's pause in the daemon's ledger):
optional, written by the trainer's commit, read back; an older manifest without it parses to None."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.checkpoint import build_manifest
from trainer.manifest import Manifest, ManifestError

from tests.trainer.test_manifest import written

pytestmark = pytest.mark.unit


def test_save_seconds_round_trips_and_is_optional() -> None:
    with_it = Manifest(**{**written().__dict__, "save_seconds": 0.25})
    assert json.loads(with_it.to_json())["save_seconds"] == 0.25
    assert Manifest.parse(with_it.to_json()).save_seconds == 0.25
    old = written().to_json()  # what an older trainer wrote
    assert "save_seconds" not in json.loads(old) and Manifest.parse(old).save_seconds is None


@pytest.mark.parametrize("bad", [-1, "0.1", True])
def test_a_bad_save_seconds_is_refused_naming_it(bad: object) -> None:
    data = json.loads(written().to_json())
    data["save_seconds"] = bad
    with pytest.raises(ManifestError, match="save_seconds"):
        Manifest.parse(json.dumps(data))


def test_the_commit_writes_how_long_the_save_took(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 10)
    manifest = build_manifest(tmp_path, 7, world_size=1, reason="preemption", save_seconds=1.5)
    assert Manifest.parse(manifest.to_json()).save_seconds == 1.5
