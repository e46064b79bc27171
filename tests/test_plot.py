"""resilienced.ops.plot: a run's timeline rendered from fixed ledgers (matplotlib, the plot extra: make installs it; without it the test fails):
a PNG of the size asked for, with every notice, stage and lost part drawn."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from resilienced.ops.ledger import Gpus, Known, Price, Recovery, capacity_spans, compute
from resilienced.ops.plot import WorldSize, png_size, render, save

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 5, 8, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def one(notice: float) -> object:
    r = Recovery(notice_at=at(notice), gpus=Gpus(2), steps_trained_twice=Known(2, "x"), step_seconds=Known(5, "y"),
                 save_seconds=Known(4, "z"), training_stopped_at=at(notice + 30), requeued_at=at(notice + 40),
                 placed_at=at(notice + 200), training_again_at=at(notice + 260))
    prices = {"spot": Price(4.0, "moto"), "on-demand": Price(10.0, "file")}
    uses = capacity_spans([("spot", at(0)), ("on-demand", at(notice + 40))], until=at(notice + 900), instances=2,
                          prices=prices)
    return compute(r, run="ns/job", event_id=f"e-{notice}", at=at(notice + 900), capacity=uses, prices=prices,
                   productive_gpu_seconds=Known(3600.0, "w"))


def test_the_plot_is_a_png_of_the_size_asked_with_every_notice_drawn(tmp_path: Path) -> None:
    ledgers = [one(600), one(2400)]
    sizes = [WorldSize(at(0), 2), WorldSize(at(630), 0), WorldSize(at(860), 2), WorldSize(at(2430), 0),
             WorldSize(at(2660), 2)]
    fig = render(ledgers, world_size=sizes, width=1000, height=500)
    gids = [a.get_gid() for a in fig.axes[0].get_children()]
    assert gids.count("notice") == 2
    assert gids.count("stage-again") == 2 and gids.count("stage-placed") == 2
    assert gids.count("lost-capacity_wait") == 2 and gids.count("lost-idle") == 4  # before and after each wait
    assert gids.count("lost-save_pause") == 2 and gids.count("lost-steps_repeated") == 2
    bottom = [a.get_gid() for a in fig.axes[1].get_children()]
    assert bottom.count("capacity-spot") == 2 and bottom.count("capacity-on-demand") == 2
    path = save(fig, tmp_path / "run.png")
    assert png_size(path) == (1000, 500)
    assert path.stat().st_size > 10_000  # drawn, not blank


def test_png_size_refuses_what_is_not_a_png(tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(b"GIF89a" + bytes(30))
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(tmp_path / "x.png")
