"""Validation helpers shared by the intake and every handler.

Each helper takes a value from a decoded body and the *name of the field* it came from, and
either returns the checked value or raises :class:`~resilienced.errors.InvalidEventError`
whose message names that field (``detail.instance-id: 'i-0123' is not an EC2 instance id``).
Values are shown truncated, so a 256 KiB string never ends up in a log line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Literal, overload

from resilienced.clock import parse_time
from resilienced.errors import InvalidEventError
from resilienced.model import JsonValue
from resilienced.options import ACCOUNT_RE, REGION_RE

#: ``i-`` and 8 (older) or 17 lowercase hex digits.
INSTANCE_ID_RE = re.compile(r"i-(?:[0-9a-f]{8}|[0-9a-f]{17})")
#: A Capacity Reservation (and Capacity Block) id: ``cr-`` and 17 lowercase hex digits.
RESERVATION_ID_RE = re.compile(r"cr-[0-9a-f]{17}")
#: RFC 1123, as AWS Health writes ``startTime``: ``Sat, 05 Jun 2016 15:10:09 GMT``.
RFC1123_RE = re.compile(
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-9]{2} "
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [0-9]{4} [0-9]{2}:[0-9]{2}:[0-9]{2} GMT")
_ISO_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.,+\-Z]+", re.IGNORECASE)
MAX_TEXT = 1024
#: An event id (EventBridge ``id``, ASG ``RequestId``): AWS writes UUIDs; any id made of letters,
#: digits and ``-_.:`` is taken. It becomes part of claim keys, Kubernetes Event messages and
#: notifications, so slashes, quotes, spaces and control characters are refused.
EVENT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,255}")


def show(value: object) -> str:
    """A short, safe rendering of a value for a reason string."""
    if isinstance(value, Mapping):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def invalid(field: str, message: str) -> InvalidEventError:
    return InvalidEventError(message, field=field)


def mapping(value: object, *, field: str) -> Mapping[str, JsonValue]:
    if value is None:
        raise invalid(field, "missing")
    if not isinstance(value, Mapping):
        raise invalid(field, f"expected an object, got {show(value)}")
    return value


@overload
def text(value: object, *, field: str, required: Literal[True] = True) -> str: ...


@overload
def text(value: object, *, field: str, required: bool) -> str | None: ...


def text(value: object, *, field: str, required: bool = True) -> str | None:
    """A non-empty string of at most MAX_TEXT characters (None allowed when not required)."""
    if value is None:
        if required:
            raise invalid(field, "missing")
        return None
    if not isinstance(value, str):
        raise invalid(field, f"expected a string, got {show(value)}")
    if not value.strip():
        raise invalid(field, "empty")
    if len(value) > MAX_TEXT:
        raise invalid(field, f"longer than {MAX_TEXT} characters")
    return value


def _shaped(value: object, *, field: str, pattern: re.Pattern[str], what: str) -> str:
    """A string of ``text`` that also matches ``pattern`` in full, else invalid naming ``what``."""
    value = text(value, field=field)
    if not pattern.fullmatch(value):
        raise invalid(field, f"{show(value)} is not {what}")
    return value


def event_id(value: object, *, field: str) -> str:
    return _shaped(value, field=field, pattern=EVENT_ID_RE,
                   what="an event id (1-256 letters, digits and -_.:, starting with a letter or digit)")


def instance_id(value: object, *, field: str) -> str:
    return _shaped(value, field=field, pattern=INSTANCE_ID_RE,
                   what="an EC2 instance id (i- and 8 or 17 lowercase hex digits)")


def reservation_id(value: object, *, field: str) -> str:
    return _shaped(value, field=field, pattern=RESERVATION_ID_RE,
                   what="a capacity reservation id (cr- and 17 lowercase hex digits)")


def account(value: object, *, field: str, allowed: tuple[str, ...]) -> str | None:
    """A 12-digit account id; required and in the list when an allow-list is set."""
    if value is None:
        if allowed:
            raise invalid(field, "missing, and an account allow-list is set "
                                 f"({', '.join(allowed)})")
        return None
    if not isinstance(value, str) or not ACCOUNT_RE.fullmatch(value):
        raise invalid(field, f"{show(value)} is not a 12-digit AWS account id")
    if allowed and value not in allowed:
        raise invalid(field, f"{value} is not in the allowed accounts ({', '.join(allowed)})")
    return value


def region(value: object, *, field: str, allowed: tuple[str, ...]) -> str | None:
    """An AWS region name; required and in the list when an allow-list is set."""
    if value is None:
        if allowed:
            raise invalid(field, f"missing, and a region allow-list is set ({', '.join(allowed)})")
        return None
    if not isinstance(value, str) or not REGION_RE.fullmatch(value):
        raise invalid(field, f"{show(value)} is not an AWS region name")
    if allowed and value not in allowed:
        raise invalid(field, f"{value} is not in the allowed regions ({', '.join(allowed)})")
    return value


def iso_time(value: object, *, field: str) -> datetime:
    """An ISO-8601 time with a zone, as UTC (``2024-01-01T00:00:00Z``)."""
    value = text(value, field=field)
    if len(value) <= 40 and _ISO_RE.fullmatch(value):
        try:
            parsed = parse_time(value)
        except ValueError:
            parsed = None
        if parsed is not None:
            if parsed.tzinfo is None:
                raise invalid(field, f"{show(value)} has no time zone (AWS writes UTC, ...Z)")
            return _utc(parsed, field=field)
    raise invalid(field, f"{show(value)} is not an ISO-8601 time")


def health_time(value: object, *, field: str) -> datetime:
    """A time as AWS Health writes it: RFC 1123 (``Sat, 05 Jun 2016 15:10:09 GMT``) or ISO-8601."""
    value = text(value, field=field)
    if RFC1123_RE.fullmatch(value):
        try:
            parsed = datetime.strptime(value, "%a, %d %b %Y %H:%M:%S GMT")
        except ValueError:
            raise invalid(field, f"{show(value)} is not a valid RFC 1123 time") from None
        return parsed.replace(tzinfo=timezone.utc)
    try:
        return iso_time(value, field=field)
    except InvalidEventError:
        raise invalid(field, f"{show(value)} is neither an RFC 1123 nor an ISO-8601 time") from None


def shift(moment: datetime, delta: timedelta, *, field: str) -> datetime:
    """``moment + delta``, or invalid when that leaves the calendar (year 1 to 9999)."""
    try:
        return moment + delta
    except OverflowError:
        raise invalid(field, f"{moment.isoformat()} is too close to the end of the calendar") from None


def _utc(moment: datetime, *, field: str) -> datetime:
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:
        raise invalid(field, "out of range once converted to UTC") from None


def isoformat(moment: datetime | None) -> str | None:
    """UTC ISO-8601 with a ``Z`` (what the CLI and logs print)."""
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
