"""``trainer.resume``: the record an attempt leaves when it trains its first step, and the
Checkpointer writing it (one process, no process group; the Ray runs are the drill's)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from trainer import resume
from trainer.errors import UsageError
from trainer.resilience import Checkpointer

pytestmark = pytest.mark.unit


def small_state() -> dict:
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1)}


def records(root: Path) -> list[resume.ResumeRecord]:
    return [resume.parse(p.read_bytes(), where=str(p)) for p in sorted((root / resume.FOLDER).glob("*.json"))]


def test_each_attempt_leaves_one_record_at_its_first_step(tmp_path: Path, own_sigterm) -> None:
    state = small_state()
    first = Checkpointer(tmp_path, every=2)
    before = time.time()
    first.restore(state)
    assert records(tmp_path) == []  # nothing until a step is trained
    for step in (1, 2, 3):
        first.after_step(step, state)
    (one,) = records(tmp_path)
    assert (one.resumed_from_step, one.first_step, one.world_size, one.min_world_size) == (None, 1, 1, 1)
    assert before <= one.started_at_unix <= time.time()

    again = Checkpointer(tmp_path, min_world_size=1)
    assert again.restore(small_state()) == 2
    again.after_step(3, state)
    again.after_step(4, state)
    first_attempt, second = records(tmp_path)
    assert first_attempt == one and (second.resumed_from_step, second.first_step) == (2, 3)
    assert second.attempt_id != one.attempt_id and second.name > one.name  # named in time order


def test_only_the_newest_records_are_kept(tmp_path: Path) -> None:
    for n in range(resume.KEEP + 3):
        resume.write(tmp_path, resume.ResumeRecord(resume.new_attempt_id(), n, n + 1, 2, 2, 1_800_000_000.0 + n))
    kept = records(tmp_path)
    assert len(kept) == resume.KEEP and [r.resumed_from_step for r in kept] == list(range(3, resume.KEEP + 3))


@pytest.mark.parametrize("change, field", [
    ({"format": "other/1"}, "format"), ({"world_size": 0}, "world_size"), ({"first_step": "1"}, "first_step"),
    ({"attempt_id": "x"}, "attempt_id"), ({"started_at_unix": None}, "started_at_unix"),
    ({"resumed_from_step": -1}, "resumed_from_step"), ({"min_world_size": True}, "min_world_size"),
])
def test_a_malformed_record_is_refused_naming_the_field(change: dict, field: str) -> None:
    good = resume.ResumeRecord(resume.new_attempt_id(), 4, 5, 2, 1, 1_800_000_000.5).as_json()
    assert resume.parse(json.dumps(good).encode()).first_step == 5
    with pytest.raises(ValueError, match=field):
        resume.parse(json.dumps({**good, **change}).encode())
    with pytest.raises(ValueError, match="not JSON"):
        resume.parse(b"{half")


def test_a_bad_minimum_is_refused(tmp_path: Path, own_sigterm) -> None:
    with pytest.raises(UsageError, match="min_world_size"):
        Checkpointer(tmp_path, min_world_size=0)
