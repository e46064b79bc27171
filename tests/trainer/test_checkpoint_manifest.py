"""The checkpoint manifest and the choice of the checkpoint to resume (no training needed)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from trainer.checkpoint import find_resume_point, hash_file, prune, verify
from trainer.errors import CorruptCheckpoint
from trainer.manifest import FORMAT, MANIFEST, FileEntry, Manifest, ManifestError

pytestmark = pytest.mark.unit


def make_checkpoint(root: Path, step: int, *, committed: bool = True, world_size: int = 2,
                    with_manifest: bool = True) -> Path:
    """A checkpoint directory with two data files and a correct manifest."""
    path = root / (f"step-{step}" if committed else f"step-{step}.partial")
    path.mkdir(parents=True)
    entries = []
    for name, content in (("__0_0.distcp", b"rank0" * step), (".metadata", b"meta%d" % step)):
        (path / name).write_bytes(content)
        size, digest = hash_file(path / name)
        entries.append(FileEntry(name, size, digest))
    if with_manifest:
        manifest = Manifest(step=step, world_size=world_size, time=datetime.fromtimestamp(1.5, tz=timezone.utc), saved_at_unix=1.5,
                            reason="periodic", files=tuple(entries))
        (path / MANIFEST).write_text(manifest.to_json())
    return path


def test_manifest_has_the_contract_fields(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 7)
    data = json.loads((path / MANIFEST).read_text())
    assert data["format"] == FORMAT == "resilienced-checkpoint/1"
    assert data["step"] == 7 and data["world_size"] == 2 and data["reason"] == "periodic"
    assert data["time"] == "1970-01-01T00:00:01.500000Z" and data["saved_at_unix"] == 1.5
    assert {f["path"] for f in data["files"]} == {"__0_0.distcp", ".metadata"}
    assert all(set(f) == {"path", "size", "sha256"} for f in data["files"])
    assert verify(path).step == 7


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: (p / MANIFEST).unlink(), "manifest.json is missing"),
        (lambda p: (p / MANIFEST).write_text((p / MANIFEST).read_text()[:40]), "not valid JSON"),
        (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is listed but missing"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"x"), "has 1 bytes, manifest says"),
        (lambda p: (p / ".metadata").write_bytes(b"META7"), "sha256"),
        (lambda p: (p / MANIFEST).write_text((p / MANIFEST).read_text().replace('"step": 7', '"step": 8')),
         "manifest says step 8, directory says 7"),
        (lambda p: (p / MANIFEST).write_text(
            (p / MANIFEST).read_text().replace(FORMAT, "something-else/9")), "manifest format"),
    ],
    ids=["no-manifest", "torn-manifest", "missing-file", "wrong-size", "wrong-checksum", "wrong-step",
         "wrong-format"],
)
def test_a_damaged_checkpoint_is_rejected_with_the_reason(tmp_path: Path, damage, why: str) -> None:
    path = make_checkpoint(tmp_path, 7)
    damage(path)
    with pytest.raises(CorruptCheckpoint, match=why):
        verify(path)


def test_resume_takes_the_newest_complete_checkpoint_and_cleans_up_the_rest(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 8)
    corrupt = make_checkpoint(tmp_path, 12)
    (corrupt / "__0_0.distcp").write_bytes(b"torn")
    make_checkpoint(tmp_path, 16, committed=False, with_manifest=False)
    make_checkpoint(tmp_path, 20, committed=False, with_manifest=True)

    point, rejected = find_resume_point(tmp_path)

    assert point is not None and point.manifest.step == 8 and point.path == tmp_path / "step-8"
    why = {r.path.name: r.why for r in rejected}
    assert set(why) == {"step-12", "step-16.partial", "step-20.partial"}
    assert why["step-12"] == "__0_0.distcp has 4 bytes, manifest says 60"
    assert why["step-16.partial"].startswith("incomplete: the save did not finish")
    assert why["step-20.partial"].startswith("incomplete: manifest.json written but")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-8"]


def test_a_root_with_only_partial_checkpoints_starts_from_scratch(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 3, committed=False, with_manifest=True)
    point, rejected = find_resume_point(tmp_path)
    assert point is None
    assert [r.path.name for r in rejected] == ["step-3.partial"]
    assert "never committed" in rejected[0].why
    assert list(tmp_path.iterdir()) == []


def test_a_missing_root_has_nothing_to_resume(tmp_path: Path) -> None:
    assert find_resume_point(tmp_path / "absent") == (None, [])


def test_prune_keeps_the_newest_k_committed_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 10, 11):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 12, committed=False)
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-11", "step-12.partial"]


@pytest.mark.parametrize(
    "files",
    [[], [{"path": "../escape", "size": 1, "sha256": "0"}], [{"path": "a", "size": "1", "sha256": "0"}],
     [{"path": MANIFEST, "size": 1, "sha256": "0"}]],
    ids=["no-files", "path-escapes", "size-not-int", "lists-itself"],
)
def test_a_manifest_with_bad_files_is_refused(files: list) -> None:
    text = json.dumps({"format": FORMAT, "step": 1, "world_size": 1, "time": "2026-11-30T00:00:00Z",
                       "saved_at_unix": 0.0, "reason": "final", "files": files})
    with pytest.raises(ManifestError):
        Manifest.parse(text, where="x")
