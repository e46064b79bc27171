"""Save before a resize: the request Ray Train's controller leaves under the checkpoint root, and the answer.

Ray Train 2.60 grows an elastic run by tearing its worker group down and starting a larger one
(``TrainController._execute_resize_decision``: ``_shutdown_worker_group`` then
``_start_worker_group``, ray/train/v2/_internal/execution/controller/controller.py); the workers
are not told.  Steps trained since the last checkpoint would be trained again.  So before that
teardown ``trainer.elastic.ElasticCallback`` (in the controller) writes a request here, the ranks
see it at their next step boundary (``Checkpointer.after_step``; rank 0 looks, the agreement
tells the others), save the step they are on (reason ``resize``), answer with that step and
train nothing more; the controller then restarts them at the new size and they resume from it.

The files, under the checkpoint root (storage every rank and the controller share):

* ``.resize-request``: ``{"id": "<hex>", "workers": N, "at": <unix seconds>}``
* ``.resize-saved``: ``{"id": "<the request's id>", "step": S, "at": <unix seconds>}``

Both are written to a temporary name and renamed (a reader never sees half a file).  This module
imports neither Ray nor torch: the checkpointer and the controller callback both use it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

REQUEST = ".resize-request"
SAVED = ".resize-saved"


def write_json_file(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON in one rename: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def read_json_file(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is none (missing, torn, or not an object)."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def request(root: str | os.PathLike[str], *, request_id: str, workers: int) -> None:
    """Ask the ranks of the run under ``root`` to save the step they are on (the controller)."""
    root = Path(root)
    (root / SAVED).unlink(missing_ok=True)
    write_json_file(root / REQUEST, {"id": request_id, "workers": workers, "at": time.time()})


def pending(root: str | os.PathLike[str]) -> str | None:
    """The id of the request waiting for an answer, or None (rank 0, at a step boundary)."""
    root = Path(root)
    if not (root / REQUEST).exists():  # the usual case: one stat
        return None
    data = read_json_file(root / REQUEST)
    if data is None or not isinstance(data.get("id"), str):
        return None
    answer = read_json_file(root / SAVED)
    if answer is not None and answer.get("id") == data["id"]:
        return None
    return data["id"]


def answer(root: str | os.PathLike[str], *, request_id: str, step: int) -> None:
    """Say that the step is saved (rank 0, after the commit)."""
    write_json_file(Path(root) / SAVED, {"id": request_id, "step": step, "at": time.time()})


def answered(root: str | os.PathLike[str], request_id: str) -> int | None:
    """The step saved for the request, or None while there is no answer (the controller)."""
    data = read_json_file(Path(root) / SAVED)
    if data is None or data.get("id") != request_id or not isinstance(data.get("step"), int):
        return None
    return data["step"]


def clear(root: str | os.PathLike[str]) -> None:
    """Remove the request and its answer (the controller, before the larger group starts)."""
    for name in (REQUEST, SAVED):
        (Path(root) / name).unlink(missing_ok=True)
