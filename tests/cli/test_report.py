"""``resilienced report RUN``: a run's ledgers one per line, --json, --plot, from a follow-up record."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from resilienced.app import cli
from resilienced.app.report import COLUMNS, ledgers_of, render
from resilienced.ops.ledger import Gpus, Known, Price, Recovery, capacity_spans, compute
from resilienced.ops.plot import png_size

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 5, 8, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ledger(notice: float, *, spot: Price) -> dict:
    r = Recovery(notice_at=at(notice), gpus=Gpus(2, 8), steps_trained_twice=Known(0, "caught"),
                 step_seconds=Known(2, "m"), save_seconds=Known(9, "manifest"), training_stopped_at=at(notice + 60),
                 requeued_at=at(notice + 60), placed_at=at(notice + 240), training_again_at=at(notice + 420))
    prices = {"spot": spot, "on-demand": Price(10.0, "file")}
    uses = capacity_spans([("spot", at(notice - 3600)), ("on-demand", at(notice + 60))], until=at(notice + 3660),
                          instances=2, prices=prices)
    return compute(r, run="ml/llm", event_id=f"e-{int(notice)}", at=at(notice + 3660), capacity=uses, prices=prices,
                   productive_gpu_seconds=Known(16 * 7200.0, "steps x step time")).as_json()


RECORD = {"run": "ml/llm", "ledgers": [ledger(0, spot=Price(4.0, "moto")),
                                       ledger(7200, spot=Price.unknown("ec2", "UnauthorizedOperation"))]}


def test_one_line_per_interruption_in_gpu_hours() -> None:
    text = render(ledgers_of(RECORD))
    lines = text.splitlines()
    assert lines[0].split("  ")[0] == "NOTICE" and "GOODPUT" in lines[0] and len(COLUMNS) == 10
    # save 9 s + idle (360 - 180) 180 s + wait 180 s = 369 s x 16 GPUs = 5904 GPU-s = 1.640 GPU-h
    assert "1.640" in lines[1] and "$12.00" in lines[1]  # 2 instance-hours on On-Demand x (10 - 4)
    assert "e-7200" in lines[2] and lines[2].split()[-2] == "-"  # premium unknown: Spot's price unknown
    assert lines[3].startswith("2 interruption(s): lost 3.280 GPU-hours, premium over Spot -")
    assert any("UnauthorizedOperation" in x for x in lines[4:])


def test_the_command_reads_a_file_prints_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "record.json"
    path.write_text(json.dumps(RECORD))
    assert cli.main(["report", "ml/llm", "--file", str(path), "--json", "--plot", str(tmp_path / "run.png")]) == 0
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["event_id"] for x in out] == ["e-0", "e-7200"] and out[0]["premium_usd"] == 12.0
    assert png_size(tmp_path / "run.png") == (1200, 600)
    path.write_text(json.dumps({"run": "ml/llm", "ledgers": []}))
    assert cli.main(["report", "ml/llm", "--file", str(path)]) == 1
