"""Logging: structlog, one JSON object per line.

The daemon writes to stdout (what a container runtime collects); ``replay`` and ``inject``
write their logs to stderr so that stdout stays their output.  Every message handled produces
exactly one ``decision`` line (see :func:`decision`): the line an operator greps for.
"""

from __future__ import annotations

import logging
import sys
import enum
from collections.abc import Sequence
from typing import IO, Protocol

import structlog
from structlog.typing import Processor

from resilienced.model import JsonValue, Outcome, Verdict
from resilienced.intake.validate import isoformat

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _Current:
    """Writes to whatever ``sys.stdout`` / ``sys.stderr`` is at the time of the write."""

    def __init__(self, name: str) -> None:
        self._name = name

    def write(self, text: str) -> int:
        return getattr(sys, self._name).write(text)

    def flush(self) -> None:
        getattr(sys, self._name).flush()


class Logger(Protocol):
    """What the daemon's modules call on a logger: one line per call, the ``event`` and its
    key-value fields (:func:`get` gives one; structlog's bound loggers are one too)."""

    def debug(self, event: str, **fields: object) -> object: ...

    def info(self, event: str, **fields: object) -> object: ...

    def warning(self, event: str, **fields: object) -> object: ...

    def error(self, event: str, **fields: object) -> object: ...

    def exception(self, event: str, **fields: object) -> object: ...


def _shared() -> list[Processor]:
    """The processors every line goes through, a structlog event or a library's stdlib record."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]


def _render() -> list[Processor]:
    return [structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False, default=str)]


def configure(*, level: str = "info", stream: IO[str] | None = None) -> None:
    """JSON lines at ``level`` and above on ``stream`` (default: stdout).

    ``sys.stdout`` and ``sys.stderr`` are looked up at each write, so a replaced stream (a test
    capturing output) never leaves the logger writing to a closed file.  The project's own
    modules log through structlog (:func:`get`); the stdlib records of libraries (aiohttp,
    kubernetes_asyncio, botocore, ray) go through :func:`formatter`, so both come out as the
    same JSON lines.
    """
    if stream is None or stream is sys.stdout:
        stream = _Current("stdout")  # type: ignore[assignment]
    elif stream is sys.stderr:
        stream = _Current("stderr")  # type: ignore[assignment]
    structlog.configure(
        processors=[*_shared(), *_render()],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(stream)


def formatter() -> structlog.stdlib.ProcessorFormatter:
    """structlog's formatter for stdlib records: ``event``, ``level``, ``logger``, ``timestamp``."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_shared(), structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_render()],
    )


def _route_stdlib(stream: IO[str] | _Current) -> None:
    """Libraries' stdlib loggers at warning, through :func:`formatter`, on ``stream``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_resilienced", False)]:
        root.removeHandler(old)
    handler._resilienced = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


class _Named:
    """A structlog logger whose lines carry ``logger=name``, bound at each call.

    Binding at each call (not once) keeps it lazy: a module-level logger, made at import, follows
    a later :func:`configure` (structlog's ``bind`` fixes the configuration of the time it runs).
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def _bound(self) -> structlog.typing.FilteringBoundLogger:
        return structlog.get_logger(self._name).bind(logger=self._name)

    def debug(self, event: str, **fields: object) -> object:
        return self._bound().debug(event, **fields)

    def info(self, event: str, **fields: object) -> object:
        return self._bound().info(event, **fields)

    def warning(self, event: str, **fields: object) -> object:
        return self._bound().warning(event, **fields)

    def error(self, event: str, **fields: object) -> object:
        return self._bound().error(event, **fields)

    def exception(self, event: str, **fields: object) -> object:
        return self._bound().exception(event, **fields)


def get(name: str = "resilienced") -> Logger:
    """The structlog logger of module ``name``: its lines carry ``logger=name``."""
    return _Named(name)


def decision(logger: Logger, *, outcome: Outcome, verdict: Verdict, message_id: str | None,
             receive_count: int, latency_s: float, action: str | None = None) -> None:
    """The one line per handled message: what it was, what was decided, and why."""
    event = outcome.event
    plan = outcome.plan
    fields: dict[str, JsonValue] = {
        "message_id": message_id,
        "receive_count": receive_count,
        "event_id": event.event_id if event else None,
        "kind": event.kind.value if event else None,
        "instance_ids": list(plan.instance_ids if plan else (event.instance_ids if event else ())),
        "capacity_reservation_id": (plan.capacity_reservation_id if plan else None),
        "outcome": outcome.result.value,
        "reason": outcome.reason,
        "verdict": verdict.value,
        "latency_s": round(latency_s, 6),
    }
    if plan is not None and plan.actionable:
        fields["steps"] = _values(plan.steps)
        fields["deadline"] = isoformat(plan.deadline)
    if outcome.details.get("stale"):
        fields["stale"] = outcome.details["stale"]
    if action:
        fields["action"] = action
    if outcome.result.value in ("retry", "failed", "undecodable", "invalid"):
        logger.warning("decision", **fields)
    else:
        logger.info("decision", **fields)


def _values(items: Sequence[enum.Enum]) -> list[str]:
    return [item.value for item in items]
