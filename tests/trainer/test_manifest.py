"""``trainer.manifest``: the one reader of the checkpoint manifest, which both the trainer's resume
and the daemon's durable check use (the trainer's writer against the daemon's reader, end to end:
tests/recovery/durable/test_contract.py)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import pytest

from trainer.manifest import FORMAT, FileEntry, Manifest, ManifestError

pytestmark = pytest.mark.unit

SAVED = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=timezone.utc)


def written() -> Manifest:
    return Manifest(step=3, world_size=2, time=SAVED, saved_at_unix=SAVED.timestamp(), reason="preemption",
                    files=(FileEntry("__0_0.distcp", 64, "a" * 64), FileEntry(".metadata", 12, "b" * 64)))


def test_what_is_written_parses_back_to_the_same_manifest() -> None:
    text = written().to_json()
    data = json.loads(text)
    assert data["format"] == FORMAT and data["time"] == "2026-11-30T12:00:00.123456Z"
    assert Manifest.parse(text) == Manifest.parse(text.encode()) == written()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.update(format="other/1"), "format is 'other/1'"),
        (lambda m: m.pop("step"), "'step' is missing"),
        (lambda m: m.update(step=True), "'step' is missing or not a int"),
        (lambda m: m.update(time="yesterday"), "not ISO-8601 UTC"),
        (lambda m: m.update(time="2026-11-30T12:00:00"), "not ISO-8601 UTC"),
        (lambda m: m.update(saved_at_unix="1"), "saved_at_unix"),
        (lambda m: m.update(reason=""), "'reason' is empty"),
        (lambda m: m.update(files=[]), "lists no files"),
        (lambda m: m["files"].append(dict(m["files"][0])), "twice"),
        (lambda m: m["files"][0].update(path="../escape"), "bad path"),
        (lambda m: m["files"][0].update(path="/abs"), "bad path"),
        (lambda m: m["files"][0].update(path="manifest.json"), "bad path"),
        (lambda m: m["files"][0].update(size=-1), "negative size"),
        (lambda m: m["files"][0].update(size="1"), "is not {path, size, sha256}"),
        (lambda m: m["files"][0].update(sha256="xyz"), "64 hex digits"),
        (lambda m: m["files"][0].pop("size"), "is not {path, size, sha256}"),
        (lambda m: m.update(world_size=0), "out of range"),
    ],
    ids=["format", "no-step", "bool-step", "bad-time", "naive-time", "saved-at", "no-reason", "no-files",
         "duplicate", "dotdot", "absolute", "manifest-listed", "negative", "size-not-int", "bad-hash",
         "no-size", "world-size"],
)
def test_each_broken_field_is_refused_naming_it(mutate: Any, message: str) -> None:
    data = json.loads(written().to_json())
    mutate(data)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace("{", r"\{")) as caught:
        Manifest.parse(json.dumps(data), where="s3://b/step-3/manifest.json")
    assert caught.value.where == "s3://b/step-3/manifest.json"


@pytest.mark.parametrize(("raw", "message"), [(b"\xff\xfe", "not UTF-8"), (b"{\"step\": ", "not valid JSON"),
                                              (b"[1]", "not a JSON object")],
                         ids=["bytes", "torn", "array"])
def test_what_is_not_a_json_object_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.parse(raw)
