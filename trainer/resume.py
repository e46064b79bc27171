"""The resume record: what an attempt of the run trained first, written where the daemon reads it.

When an attempt of the run trains its first step, rank 0 writes one small JSON file under the
checkpoint root (``Checkpointer.after_step`` does it); FSx exports it to S3 with the
checkpoints, and the daemon reads it back from S3 as it reads manifests, to see that the run it
requeued **trains again**, at what world size and from which step (docs/requeue.md, "Following
the run after the requeue").  The trainer never talks to the daemon: the record is a file, like
the manifest (design decision 2).

Layout, under the checkpoint root::

    resume/<first step's time, unix ms, 13 digits>-<attempt id>.json

one file per attempt (the newest ``KEEP`` are kept), so the daemon finds the first attempt that
started after a notice even when a later one (an elastic run growing back) followed it.  Each::

    {"format": "resilienced-resume/1", "attempt_id": "<32 hex>", "resumed_from_step": N | null,
     "first_step": S, "world_size": W, "min_world_size": M, "started_at_unix": T}

``resumed_from_step``: the step the attempt restored (null: it started from scratch);
``first_step``: the step its first ``after_step`` was called with (N + 1 after a restore);
``world_size``: the attempt's ranks; ``min_world_size``: the smallest world size the run trains
at (an elastic run's minimum; a fixed run's world size); ``started_at_unix``: when that first
step was trained (the trainer's clock).

This module is the one definition of the format: the trainer writes it with :func:`write`, the
daemon (``resilienced.followup.follower``) parses it with :func:`parse`.  It imports only the
standard library, so the daemon may import it without torch or Ray; it imports nothing of the
daemon (trainer/ never does).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "resilienced-resume/1"
#: The folder under the checkpoint root (and under the run's S3 prefix) holding the records.
FOLDER = "resume"
#: Records kept per run (older ones are deleted by the writer).
KEEP = 20
_NAME = re.compile(r"^(\d{13})-([0-9a-f]{32})\.json$")


@dataclass(frozen=True)
class ResumeRecord:
    """One attempt's first trained step (see the module docstring for the fields)."""

    attempt_id: str
    resumed_from_step: int | None
    first_step: int
    world_size: int
    min_world_size: int
    started_at_unix: float

    @property
    def name(self) -> str:
        """The file name of the record under :data:`FOLDER`."""
        return f"{int(self.started_at_unix * 1000):013d}-{self.attempt_id}.json"

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "attempt_id": self.attempt_id, "resumed_from_step": self.resumed_from_step,
                "first_step": self.first_step, "world_size": self.world_size,
                "min_world_size": self.min_world_size, "started_at_unix": self.started_at_unix}


def new_attempt_id() -> str:
    return uuid.uuid4().hex


def is_record_name(name: str) -> bool:
    """Whether ``name`` (a file name, no folder) is a record's name."""
    return _NAME.fullmatch(name) is not None


def parse(raw: bytes, *, where: str = "resume record") -> ResumeRecord:
    """The record in ``raw``; ValueError naming the field that is wrong."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"{where}: format is {data.get('format')!r}, expected {FORMAT!r}")

    def whole(name: str, *, least: int, optional: bool = False) -> int | None:
        value = data.get(name)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{where}: {name} must be a whole number >= {least}, got {value!r}")
        return value

    attempt = data.get("attempt_id")
    if not isinstance(attempt, str) or not re.fullmatch(r"[0-9a-f]{32}", attempt):
        raise ValueError(f"{where}: attempt_id must be 32 hex digits, got {attempt!r}")
    started = data.get("started_at_unix")
    if isinstance(started, bool) or not isinstance(started, (int, float)) or started <= 0:
        raise ValueError(f"{where}: started_at_unix must be a positive number, got {started!r}")
    record = ResumeRecord(
        attempt_id=attempt, resumed_from_step=whole("resumed_from_step", least=0, optional=True),
        first_step=whole("first_step", least=1), world_size=whole("world_size", least=1),  # type: ignore[arg-type]
        min_world_size=whole("min_world_size", least=1), started_at_unix=float(started))  # type: ignore[arg-type]
    return record


def write(root: str | os.PathLike[str], record: ResumeRecord, *, keep: int = KEEP) -> Path:
    """Write ``record`` under ``root`` (temporary name, fsync, rename), then keep the newest ``keep``."""
    folder = Path(root) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / record.name
    tmp = folder / f".{record.name}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record.as_json(), sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    for old in sorted(p for p in folder.iterdir() if is_record_name(p.name))[:-keep]:
        old.unlink(missing_ok=True)
    return path
