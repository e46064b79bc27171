"""``trainer.journal``: rank 0's metrics and events files, as the drill and the tests read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.journal import EVENTS, Journal, read_jsonl

pytestmark = pytest.mark.unit


def test_rank_0_appends_one_whole_line_per_metric_and_event_in_the_documented_fields(tmp_path: Path) -> None:
    metrics, events = tmp_path / "out" / "metrics.jsonl", tmp_path / "out" / "events.jsonl"
    journal = Journal(metrics_out=metrics, events_out=events, enabled=True)  # makes out/

    journal.metric(step=1, loss=2.5, world_size=2, attempt=1)
    journal.event("started", world_size=2, resumed_from_step=None, attempt=1)
    # A second attempt's journal appends to the same files; nothing is overwritten.
    again = Journal(metrics_out=metrics, events_out=events, enabled=True)
    again.metric(step=1, loss=2.5, world_size=2, attempt=2)
    again.event("finished", step=1)

    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["attempt"] for line in lines] == [1, 2]
    first = json.loads(lines[0])
    assert set(first) == {"step", "loss", "world_size", "attempt", "time"}
    assert (first["step"], first["loss"], first["world_size"]) == (1, 2.5, 2)
    assert [(e["event"], e.get("step")) for e in read_jsonl(events)] == [("started", None), ("finished", 1)]
    assert all(isinstance(e["time"], float) for e in read_jsonl(events))


def test_other_ranks_write_nothing_and_create_no_file(tmp_path: Path) -> None:
    journal = Journal(metrics_out=tmp_path / "m" / "metrics.jsonl", events_out=tmp_path / "e" / "events.jsonl",
                      enabled=False)
    journal.metric(step=1, loss=1.0, world_size=2, attempt=1)
    journal.event("finished", step=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("enabled", [True, False], ids=["rank-0", "other-rank"])
def test_an_event_name_outside_the_documented_set_is_refused_on_every_rank(tmp_path: Path, enabled: bool) -> None:
    journal = Journal(metrics_out=None, events_out=tmp_path / "events.jsonl", enabled=enabled)
    with pytest.raises(ValueError, match=r"unknown event 'checkpoint_saved'.*'checkpoint_committed'"):
        journal.event("checkpoint_saved", step=3)
    assert read_jsonl(tmp_path / "events.jsonl") == []


def test_every_documented_event_is_accepted(tmp_path: Path) -> None:
    journal = Journal(metrics_out=None, events_out=tmp_path / "events.jsonl", enabled=True)
    for name in EVENTS:
        journal.event(name)
    assert [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")] == list(EVENTS)


def test_a_reader_skips_a_torn_last_line_and_a_missing_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_jsonl(path) == []
    Journal(metrics_out=None, events_out=path, enabled=True).event("finished", step=7)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"event":"fini')  # a writer killed in the middle of its line
    assert [(e["event"], e["step"]) for e in read_jsonl(path)] == [("finished", 7)]
