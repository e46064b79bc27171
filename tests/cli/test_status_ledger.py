"""``resilienced status``'s ledger columns: LOST (GPU-hours), PREMIUM (USD over Spot), GOODPUT, and
``--json``'s ``ledger``, read from the follow-up record's ledgers for the row's event."""

from __future__ import annotations

import pytest

from resilienced.app.replay import table
from resilienced.app.status import COLUMNS, rows
from resilienced.ops.ledger import Price
from resilienced.ops.run_record import FIELDS

from .test_report import ledger

pytestmark = pytest.mark.unit

EVENT = "7e9d2f6c-0000-4000-8000-000000000001"
CLAIM = {"run": "ml/llm", "instances": ["i-1"], "event_id": EVENT, "kind": "spot_interruption",
         "done_at": "2026-12-05T08:01:00+00:00", "requeue": {"capacity": "on-demand", "reason": "no Spot"}}


def follow_up(*ledgers: dict) -> dict:
    return {"run": "ml/llm", "event_id": EVENT, "state": "resumed", "stage": "training",
            "notice_at": "2026-12-05T08:00:00+00:00", "reached": {}, "fallbacks": [], "ledgers": list(ledgers)}


def test_the_ledger_columns_of_the_rows_event() -> None:
    other = {**ledger(-7200, spot=Price(4.0, "x")), "event_id": "earlier"}
    mine = {**ledger(0, spot=Price(4.0, "x")), "event_id": EVENT}
    (row,) = rows([(f"run/{EVENT}/ml/llm", CLAIM)], follow_ups=[follow_up(other, mine)])
    assert set(row) == set(FIELDS)
    assert (row["lost_gpu_hours"], row["premium_usd"], row["goodput"]) == (1.64, 12.0, mine["goodput"])
    assert row["ledger"] == mine
    titles = [title for title, _ in COLUMNS]
    assert titles[titles.index("STEPS_LOST"):titles.index("CAPACITY")] == ["STEPS_LOST", "LOST", "PREMIUM", "GOODPUT"]
    header, line = table([row], COLUMNS).splitlines()
    cells = dict(zip(header.split(), line.split()))
    assert (cells["LOST"], cells["PREMIUM"], cells["GOODPUT"]) == ("1.64", "12.0", str(mine["goodput"]))


def test_no_ledger_yet_or_an_unknown_premium_shows_a_dash() -> None:
    (row,) = rows([(f"run/{EVENT}/ml/llm", CLAIM)], follow_ups=[follow_up()])
    assert (row["lost_gpu_hours"], row["premium_usd"], row["goodput"], row["ledger"]) == (None, None, None, None)
    unknown = {**ledger(0, spot=Price.unknown("ec2", "refused")), "event_id": EVENT}
    (row,) = rows([(f"run/{EVENT}/ml/llm", CLAIM)], follow_ups=[follow_up(unknown)])
    assert row["premium_usd"] is None and row["lost_gpu_hours"] == 1.64
    header, line = table([row], COLUMNS).splitlines()
    assert dict(zip(header.split(), line.split()))["PREMIUM"] == "-"
