"""Time, one way: the current UTC time, and reading an ISO-8601 time.

Every default clock of the daemon is :func:`utcnow` (tests pass their own); every time read from
text (a Kubernetes timestamp, an annotation, a record, a flag) goes through :func:`parse_time`.
Python 3.11's ``datetime.fromisoformat`` reads a trailing ``Z`` itself.
"""

from __future__ import annotations

from datetime import datetime, timezone


def utcnow() -> datetime:
    """The current time, tz-aware UTC."""
    return datetime.now(timezone.utc)


def parse_time(text: str) -> datetime:
    """An ISO-8601 time (``2024-05-01T11:30:00Z``, ``...+00:00``, with or without fractions);
    ValueError when it is not one.  A time without an offset comes back naive: callers that need
    an aware one say so."""
    return datetime.fromisoformat(text)
