"""The checkpoint manifest: the one definition of the format the trainer writes and the daemon reads.

This module is the contract between the two sides (decision 2 of the design: S3 is the source
of truth for "durable"), so the daemon imports it (``resilienced/recovery/durable.py``); the one
other module of ``trainer/`` it imports is ``trainer/resume.py`` (the resume record, for the
follow-up).  It imports only the standard library: the daemon's image
has no torch, the training image has no daemon.

``<root>/step-<N>/manifest.json``, written last, after every file it lists::

    {"format": "resilienced-checkpoint/1", "step": N, "world_size": W,
     "time": "2026-11-30T00:00:00.123456Z", "saved_at_unix": 1796083200.123456,
     "reason": "preemption" | "periodic" | "final" | "resize", "save_seconds": 0.14,
     "files": [{"path": "__0_0.distcp", "size": 123, "sha256": "<hex>"}, ...]}

``save_seconds`` (optional: older trainers do not write it, a reader takes it as unknown): from the
start of the save to its manifest, what the daemon's ledger counts as the save's pause
(``resilienced.ops.ledger``; an asynchronous save paused training for less: its staging only).

``files`` lists every file of the step directory except ``manifest.json`` itself, by posix path
relative to the step directory; nothing outside that list is needed to resume.  ``step-<N>``
holds the state after N optimizer steps.  :meth:`Manifest.parse` is the one reader: it refuses
anything else with a :class:`ManifestError` that names the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

FORMAT = "resilienced-checkpoint/1"
MANIFEST = "manifest.json"
#: Why a checkpoint was saved (what the trainer writes; a reader accepts any non-empty reason).
REASONS = ("preemption", "periodic", "final", "resize")
#: A committed step directory's name; its number is the manifest's step.
STEP_DIR = re.compile(r"^step-(0|[1-9][0-9]*)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest that is not this format; never trusted.  ``why`` names what is wrong."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where
        self.why = why


@dataclass(frozen=True)
class FileEntry:
    path: str  # posix, relative to the step directory
    size: int
    sha256: str  # hex, lower case


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    time: datetime  # tz-aware UTC: when the save was committed
    saved_at_unix: float
    reason: str
    files: tuple[FileEntry, ...]
    save_seconds: float | None = None  # start of the save -> its manifest (None: not written)

    def to_json(self) -> str:
        extra = {} if self.save_seconds is None else {"save_seconds": round(self.save_seconds, 6)}
        return json.dumps({
            "format": FORMAT, "step": self.step, "world_size": self.world_size,
            "time": utc_iso(self.time), "saved_at_unix": self.saved_at_unix, "reason": self.reason,
            **extra, "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }, indent=1)

    @classmethod
    def parse(cls, raw: bytes | str, *, where: str = MANIFEST) -> Manifest:
        """Parse and check a manifest; :class:`ManifestError` names what is wrong."""
        data = _json_object(raw, where=where)
        if data.get("format") != FORMAT:
            raise ManifestError(where, f"format is {data.get('format')!r}, expected {FORMAT!r}")
        for key, kind in (("step", int), ("world_size", int), ("time", str), ("reason", str),
                          ("files", list)):
            value = data.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ManifestError(where, f"field {key!r} is missing or not a {kind.__name__}")
        saved = data.get("saved_at_unix")
        if not isinstance(saved, (int, float)) or isinstance(saved, bool):
            raise ManifestError(where, "field 'saved_at_unix' is missing or not a number")
        if data["step"] < 0 or data["world_size"] < 1:
            raise ManifestError(where, f"step {data['step']} / world_size {data['world_size']} out of range")
        if not data["reason"]:
            raise ManifestError(where, "field 'reason' is empty")
        when = parse_utc(data["time"])
        if when is None:
            raise ManifestError(where, f"time {data['time']!r} is not ISO-8601 UTC")
        took = data.get("save_seconds")
        if took is not None and (not isinstance(took, (int, float)) or isinstance(took, bool) or took < 0):
            raise ManifestError(where, f"field 'save_seconds' is not a number >= 0: {took!r}")
        return cls(step=data["step"], world_size=data["world_size"], time=when,
                   saved_at_unix=float(saved), reason=data["reason"],
                   files=_files(data["files"], where=where),
                   save_seconds=None if took is None else float(took))


def _json_object(raw: bytes | str, *, where: str) -> dict:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ManifestError(where, f"not UTF-8 ({e.reason})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(where, f"not valid JSON ({e.msg} at char {e.pos})") from e
    if not isinstance(data, dict):
        raise ManifestError(where, "not a JSON object")
    return data


def _files(entries: list, *, where: str) -> tuple[FileEntry, ...]:
    files: list[FileEntry] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)
                and isinstance(entry.get("size"), int) and not isinstance(entry.get("size"), bool)
                and isinstance(entry.get("sha256"), str)):
            raise ManifestError(where, f"files[{i}] is not {{path, size, sha256}}")
        path, size, digest = entry["path"], entry["size"], entry["sha256"].lower()
        parts = path.split("/")
        if (not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts)
                or path == MANIFEST or "\\" in path):
            raise ManifestError(where, f"files[{i}] has a bad path {path!r}")
        if size < 0:
            raise ManifestError(where, f"files[{i}] ({path}) has a negative size")
        if not _HEX64.match(digest):
            raise ManifestError(where, f"files[{i}] ({path}) sha256 is not 64 hex digits")
        if path in seen:
            raise ManifestError(where, f"files[{i}] lists {path} twice")
        seen.add(path)
        files.append(FileEntry(path, size, digest))
    if not files:
        raise ManifestError(where, "lists no files")
    return tuple(files)


def utc_iso(when: datetime | float) -> str:
    """ISO-8601 UTC with microseconds and a Z, e.g. ``2026-11-30T00:00:00.123456Z``."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when, tz=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_utc(text: str) -> datetime | None:
    """A tz-aware ISO-8601 time (``Z`` or an offset) in UTC; None for anything else."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return when.astimezone(timezone.utc)


__all__ = ["FORMAT", "MANIFEST", "REASONS", "STEP_DIR", "FileEntry", "Manifest", "ManifestError",
           "parse_utc", "utc_iso"]
