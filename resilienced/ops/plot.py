"""A run's timeline as a PNG: ``resilienced report RUN --plot FILE.png`` and ``resilienced drill --plot``.

Drawn from the run's ledgers (``resilienced.ops.ledger``, one per interruption) and, where known,
its world size over time (the drill has it from the trainer's metric lines)::

    top:    the world size (ranks training) over time, a step line
    bottom: the capacity the run held (one bar per span: Spot, Capacity Block, On-Demand, coloured)
    both:   each notice (a red vertical line, labelled), the stages (stopped, requeued, placed,
            training again: dotted lines), the lost parts shaded (idle grey, capacity wait orange,
            the save's pause and the steps trained twice as bands after the notice / the resume)

matplotlib is an optional extra (``pip install 'resilienced[plot]'``): imported here, when a plot
is asked for, with the Agg backend (no display).  :func:`render` returns the Figure (a test counts
the notices drawn: artists with gid ``notice``), :func:`save` writes it at ``width`` x ``height``
pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from resilienced.clock import parse_time
from resilienced.errors import ConfigError
from resilienced.ops.ledger import Ledger

COLOURS = {"spot": "#4c9f38", "capacity-block": "#1f77b4", "on-demand": "#d62728"}
SHADES = {"idle": "#9e9e9e", "capacity_wait": "#ff9f1c", "save_pause": "#6a4c93", "steps_repeated": "#e76f51"}
DPI = 100


@dataclass(frozen=True)
class WorldSize:
    """The ranks training from ``at`` on."""

    at: datetime
    ranks: int


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # the optional extra
        raise ConfigError("--plot", f"needs matplotlib: pip install 'resilienced[plot]' ({e})") from None
    return plt


def _t(value: str) -> datetime:
    return parse_time(value)


def render(ledgers: Sequence[Ledger], *, world_size: Sequence[WorldSize] = (), title: str | None = None,
           width: int = 1200, height: int = 600) -> Any:
    """The Figure of the run's timeline (see the module docstring)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(width / DPI, height / DPI), dpi=DPI,
                                      gridspec_kw={"height_ratios": [3, 2]})
    run = ledgers[0].run if ledgers else "run"
    fig.suptitle(title or f"{run}: {len(ledgers)} interruption(s)")
    if world_size:
        points = sorted(world_size, key=lambda w: w.at)
        end = max([points[-1].at, *(u.end for led in ledgers for u in led.capacity)])
        top.step([p.at for p in points] + [end], [p.ranks for p in points] + [points[-1].ranks],
                 where="post", color="black", linewidth=1.5, label="world size")
        top.set_ylim(0, max(p.ranks for p in points) + 1)
    top.set_ylabel("ranks training")
    seen_parts: set[str] = set()
    rows: dict[tuple[str, datetime, datetime, int], int] = {}
    labels: dict[int, str] = {}
    for led in ledgers:
        marks = {k: _t(v) for k, v in led.marks.items()}
        for ax in (top, bottom):
            ax.axvline(led.notice_at, color="red", linewidth=2, gid="notice" if ax is top else "notice-capacity")
        top.annotate(" notice", (led.notice_at, 1.0), xycoords=("data", "axes fraction"), color="red",
                     ha="right", va="top", fontsize=8, rotation=90)
        for name in ("stopped", "requeued", "placed", "again"):
            if name in marks:
                top.axvline(marks[name], color="#555555", linestyle=":", linewidth=1, gid=f"stage-{name}")
                top.annotate(name, (marks[name], 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                             rotation=90, ha="right", va="bottom", color="#555555")
        for part, start, end in _part_spans(led, marks):
            label = part if part not in seen_parts else None
            seen_parts.add(part)
            top.axvspan(start, end, color=SHADES[part], alpha=0.35, label=label, gid=f"lost-{part}")
        for use in led.capacity:  # one row per span of capacity (the same span of two ledgers shares its row)
            key = (use.capacity, use.start, use.end, use.instances)
            row = rows.setdefault(key, len(rows))
            bottom.barh(row, (use.end - use.start).total_seconds() / 86400, left=use.start, height=0.8,
                        color=COLOURS.get(use.capacity, "#777777"), gid=f"capacity-{use.capacity}")
            price = ("?" if use.price.usd_per_hour is None else f"${use.price.usd_per_hour:g}/h")
            labels[row] = f"{use.instances} x {use.capacity} {price}"
    bottom.set_yticks(list(labels), [labels[r] for r in labels], fontsize=7)
    bottom.invert_yaxis()
    bottom.set_ylabel("capacity")
    bottom.set_xlabel("time (UTC)")
    if seen_parts or world_size:
        top.legend(loc="lower right", fontsize=7)
    fig.autofmt_xdate()
    fig.subplots_adjust(left=0.17)
    return fig


def _part_spans(led: Ledger, marks: dict[str, datetime]) -> list[tuple[str, datetime, datetime]]:
    """The lost parts as time spans, where their times are known (the parts' seconds, placed)."""
    out = []
    save = led.part("save_pause").seconds
    if save:
        out.append(("save_pause", led.notice_at, led.notice_at + timedelta(seconds=save)))
    if "stopped" in marks and "again" in marks:
        wait_from, wait_to = marks.get("requeued"), marks.get("placed")
        if wait_from and wait_to and led.part("capacity_wait").seconds:
            start, end = max(wait_from, marks["stopped"]), min(wait_to, marks["again"])
            out += [("idle", marks["stopped"], start), ("capacity_wait", start, end), ("idle", end, marks["again"])]
        else:
            out.append(("idle", marks["stopped"], marks["again"]))
        repeated = led.part("steps_repeated").seconds
        if repeated:
            out.append(("steps_repeated", marks["again"], marks["again"] + timedelta(seconds=repeated)))
    return [(p, s, e) for p, s, e in out if e > s]


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at its size in pixels, and close it."""
    plt = _pyplot()
    path = Path(path)
    try:
        fig.savefig(path, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return path


def plot(ledgers: Sequence[Ledger], path: str | Path, **kwargs: Any) -> Path:
    """:func:`render` then :func:`save`."""
    return save(render(ledgers, **kwargs), path)


def png_size(path: str | Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; ValueError when it is not a PNG."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
