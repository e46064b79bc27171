"""resilienced.clock: the daemon's one clock and its one reader of ISO-8601 times."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from resilienced.clock import parse_time, utcnow

pytestmark = pytest.mark.unit


def test_utcnow_is_aware_utc_and_moves_forward() -> None:
    first = utcnow()
    assert first.tzinfo is not None and first.utcoffset() == timedelta(0)
    assert utcnow() >= first


@pytest.mark.parametrize("text, expected", [
    ("2024-05-01T11:30:00Z", datetime(2024, 5, 1, 11, 30, tzinfo=timezone.utc)),
    ("2024-05-01T11:30:00+00:00", datetime(2024, 5, 1, 11, 30, tzinfo=timezone.utc)),
    ("2024-05-01T11:30:00.123456Z", datetime(2024, 5, 1, 11, 30, 0, 123456, tzinfo=timezone.utc)),
    ("2024-05-01T13:30:00+02:00", datetime(2024, 5, 1, 11, 30, tzinfo=timezone.utc)),
])
def test_parse_time_reads_z_offsets_and_fractions(text: str, expected: datetime) -> None:
    parsed = parse_time(text)
    assert parsed == expected and parsed.tzinfo is not None


def test_a_kubernetes_micro_time_round_trips() -> None:
    """The Lease store writes ``...%fZ`` (kube/leases.py) and reads it back with parse_time."""
    moment = datetime(2024, 5, 1, 11, 30, 0, 5, tzinfo=timezone.utc)
    assert parse_time(moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")) == moment


def test_a_time_without_an_offset_comes_back_naive() -> None:
    assert parse_time("2024-05-01T11:30:00").tzinfo is None


@pytest.mark.parametrize("text", ["", "yesterday", "2024-13-01T00:00:00Z", "05/01/2024 11:30"])
def test_parse_time_refuses_what_is_not_a_time(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time(text)
