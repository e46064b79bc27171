"""From an SQS message body to a plan: decode, validate the envelope, parse, plan.

::

    body (str | bytes)
      └─ decode()      UTF-8, size, JSON, an object, nesting depth; SNS unwrapping; the direct
      │                ASG-to-SQS form                              -> Envelope | DecodeError
      └─ interpret()   common fields (id, source aws.*, detail-type, time, account/region
      │                allow-lists), then the handler registered for (source, detail-type)
      │                                                             -> Event (kind INVALID or
      │                                                                UNKNOWN with a reason)
      └─ registry.plan()  pure: what must happen to which instances by when  -> Plan
      └─ judge()       as of a time: a notice too old or from the future is not actionable

:func:`read` does the first three and never raises for any input: it is what the consumer and
``resilienced replay`` both call, so the two cannot disagree.  :func:`judge` then takes the
time: the daemon's clock in the consumer, each event's own time (or ``--at``) in replay.  A body that cannot be decoded
comes back as an ``invalid`` event with ``Reading.decoded`` false (poison for the queue).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TypedDict, cast

from handlers import registry
from resilienced.intake import validate
from resilienced.errors import DecodeError, InvalidEventError
from resilienced.model import Envelope, Event, JsonValue, Kind, Plan, Wrapping
from resilienced.settings import IntakeSettings

#: The largest body accepted, in bytes of UTF-8: EventBridge's maximum event size (256 KiB).
MAX_BODY_BYTES = 256 * 1024
#: The deepest nesting of objects/arrays accepted (real events nest 4 levels).
MAX_DEPTH = 64

ASG_TERMINATE = "EC2 Instance-terminate Lifecycle Action"
ASG_LAUNCH = "EC2 Instance-launch Lifecycle Action"
_ASG_DETAIL_TYPES = {
    "autoscaling:EC2_INSTANCE_TERMINATING": ASG_TERMINATE,
    "autoscaling:EC2_INSTANCE_LAUNCHING": ASG_LAUNCH,
}


@dataclass(frozen=True)
class Reading:
    """The plan for one body; ``decoded`` is False when the body is not an event at all.

    ``stale`` is set by :func:`judge` when the event is too old (``"past"``) or too far ahead
    (``"future"``) to act on at the time it was judged; the plan is then not actionable.
    """

    plan: Plan
    decoded: bool = True
    stale: str | None = None

    @property
    def event(self) -> Event:
        return self.plan.event


# --------------------------------------------------------------------------- decode
def decode(body: object) -> Envelope:
    """Decode an SQS body into an Envelope, or raise DecodeError saying why not."""
    obj = _load(body, field="body")
    if "detail-type" not in obj and obj.get("Type") == "Notification" and "Message" in obj:
        message = obj["Message"]
        if not isinstance(message, str):
            raise DecodeError(f"expected a string holding the event, got {validate.show(message)}",
                              field="Message")
        inner = _load(message, field="Message")
        return _envelope(inner, sns=True)
    return _envelope(obj, sns=False)


def _load(body: object, *, field: str) -> dict[str, JsonValue]:
    if isinstance(body, (bytes, bytearray, memoryview)):
        raw = bytes(body)
        if len(raw) > MAX_BODY_BYTES:
            raise DecodeError(f"{len(raw)} bytes, more than the {MAX_BODY_BYTES} an event may have",
                              field=field)
        try:
            body = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                              field=field) from None
    elif isinstance(body, str):
        size = len(body.encode("utf-8", "surrogatepass"))
        if size > MAX_BODY_BYTES:
            raise DecodeError(f"{size} bytes, more than the {MAX_BODY_BYTES} an event may have",
                              field=field)
    else:
        raise DecodeError(f"expected text or bytes, got {type(body).__name__}", field=field)
    if not body.strip():
        raise DecodeError("empty", field=field)
    try:
        obj = json.loads(body)
    except RecursionError:
        raise DecodeError(f"nested deeper than {MAX_DEPTH} levels", field=field) from None
    except ValueError as e:  # JSONDecodeError, and ints longer than Python's digit limit
        raise DecodeError(f"not JSON ({_first_line(e)})", field=field) from None
    if not isinstance(obj, dict):
        raise DecodeError(f"a JSON {_json_type(obj)}, expected an object", field=field)
    if _depth(obj) > MAX_DEPTH:
        raise DecodeError(f"nested deeper than {MAX_DEPTH} levels", field=field)
    return obj


def _depth(obj: object) -> int:
    """Nesting depth of objects and arrays, without recursion."""
    deepest, stack = 0, [(obj, 1)]  # only objects and arrays are pushed
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        children: Iterable[object] = node.values() if isinstance(node, dict) else cast("list[object]", node)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _json_type(value: object) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__


def _envelope(obj: dict[str, JsonValue], *, sns: bool) -> Envelope:
    wrapping = Wrapping.SNS if sns else Wrapping.EVENTBRIDGE
    if "detail-type" not in obj and (
        "LifecycleTransition" in obj or obj.get("Event") == "autoscaling:TEST_NOTIFICATION"
    ):
        # An ASG lifecycle hook notifying SQS (or SNS) directly: the body is the detail.
        transition = obj.get("LifecycleTransition")
        detail_type = _ASG_DETAIL_TYPES.get(transition, ASG_TERMINATE) if isinstance(transition, str) \
            else ASG_TERMINATE
        return Envelope(
            wrapping=Wrapping.SNS if sns else Wrapping.ASG_DIRECT, raw=obj,
            id=obj.get("RequestId", obj.get("LifecycleActionToken")),
            source="aws.autoscaling", detail_type=detail_type, account=obj.get("AccountId"),
            time=obj.get("Time"), detail=obj,
        )
    return Envelope(
        wrapping=wrapping, raw=obj, version=obj.get("version"), id=obj.get("id"),
        source=obj.get("source"), detail_type=obj.get("detail-type"), account=obj.get("account"),
        time=obj.get("time"), region=obj.get("region"), resources=obj.get("resources"),
        detail=obj.get("detail"),
    )


def is_asg_direct(envelope: Envelope) -> bool:
    """True for the direct ASG-to-SQS form (possibly through SNS): the detail is the whole body."""
    return envelope.detail is envelope.raw and envelope.source == "aws.autoscaling"


# --------------------------------------------------------------------------- interpret
def interpret(envelope: Envelope, settings: IntakeSettings) -> Event:
    """Validate the envelope's common fields and parse it with its kind's handler.

    Never raises InvalidEventError: a broken rule becomes an ``invalid`` event whose reason
    names the field; a valid event nobody handles becomes ``unknown``.
    """
    known = _known_fields(envelope)
    try:
        base = _common(envelope, settings)
    except InvalidEventError as e:
        return Event(kind=Kind.INVALID, reason=str(e), **known)
    handler = registry.lookup(base.source, base.detail_type)
    if handler is None:
        return replace(base, kind=Kind.UNKNOWN, reason=(
            f"no handler for source {base.source!r} and detail-type {base.detail_type!r}"))
    try:
        return handler.parse(envelope, base, settings)
    except InvalidEventError as e:
        return replace(base, kind=Kind.INVALID, reason=str(e))


class _Known(TypedDict):
    """The fields of an ``invalid`` event that can be said of it."""

    event_id: str | None
    source: str | None
    detail_type: str | None
    wrapping: Wrapping


def _known_fields(envelope: Envelope) -> _Known:
    """What can be said about an event that breaks a rule (strings only)."""
    def as_text(value: object) -> str | None:
        return value if isinstance(value, str) and 0 < len(value) <= validate.MAX_TEXT else None
    return {"event_id": as_text(envelope.id), "source": as_text(envelope.source),
            "detail_type": as_text(envelope.detail_type), "wrapping": envelope.wrapping}


def _common(envelope: Envelope, settings: IntakeSettings) -> Event:
    direct = is_asg_direct(envelope)
    names = _ASG_FIELDS if direct else _EVENTBRIDGE_FIELDS
    raw = envelope.raw
    if not direct and "detail-type" not in raw and "detail_type" in raw:
        raise validate.invalid("detail-type", "missing; the body has 'detail_type', the spelling "
                                              "of the EC2 User Guide's sample, not of an "
                                              "EventBridge event")
    if not direct and "source" not in raw and "detail-type" not in raw:
        raise validate.invalid("source", "missing, and no detail-type either: not an EventBridge "
                                         "event, an SNS notification or an ASG lifecycle message")
    source = validate.text(envelope.source, field="source")
    if not source.startswith("aws."):
        raise validate.invalid("source", f"{validate.show(source)} is not an AWS source (only "
                                         "aws.* events count: anyone may put a custom-source "
                                         "event on a bus)")
    detail_type = validate.text(envelope.detail_type, field="detail-type")
    event_id = validate.event_id(envelope.id, field=names["id"])
    if envelope.version is not None:
        validate.text(envelope.version, field="version")
    account = validate.account(envelope.account, field=names["account"],
                               allowed=settings.allowed_accounts)
    region = validate.region(envelope.region, field="region", allowed=settings.allowed_regions)
    time = validate.iso_time(envelope.time, field=names["time"])
    if envelope.resources is not None and not (
        isinstance(envelope.resources, list) and all(isinstance(r, str) for r in envelope.resources)
    ):
        raise validate.invalid("resources", f"expected a list of strings, got "
                                            f"{validate.show(envelope.resources)}")
    validate.mapping(envelope.detail, field="detail")
    return Event(kind=Kind.UNKNOWN, event_id=event_id, source=source, detail_type=detail_type,
                 account=account, region=region, time=time, wrapping=envelope.wrapping)


_EVENTBRIDGE_FIELDS = {"id": "id", "account": "account", "time": "time"}
_ASG_FIELDS = {"id": "RequestId", "account": "AccountId", "time": "Time"}


# --------------------------------------------------------------------------- read
def read(body: object, settings: IntakeSettings) -> Reading:
    """Decode, interpret and plan one body.  Never raises for any body."""
    try:
        envelope = decode(body)
    except DecodeError as e:
        event = Event(kind=Kind.INVALID, event_id=None, reason=str(e))
        return Reading(plan=Plan(event=event, actionable=False, reason=event.reason), decoded=False)
    event = interpret(envelope, settings)
    return Reading(plan=registry.plan(event, settings))


# --------------------------------------------------------------------------- judge
STALE_PAST = "past"
STALE_FUTURE = "future"


def staleness(plan: Plan, settings: IntakeSettings, *, at: datetime) -> tuple[str, str] | None:
    """(``"past"`` or ``"future"``, why) when ``plan``'s event is not to be acted on at ``at``.

    Future: the event's time is more than ``future_skew_seconds`` after ``at``.  Past: the
    plan's deadline (a notice without one, e.g. a state change: the event's time) is more than
    ``stale_after_seconds`` before ``at``; an ASG lifecycle action's deadline is the hook's own
    timeout (``asg_deadline_seconds``) and gets no grace beyond it.
    """
    event = plan.event
    if event.time is not None and event.time - at > timedelta(seconds=settings.future_skew_seconds):
        return STALE_FUTURE, (
            f"stale: the event's time {validate.isoformat(event.time)} is "
            f"{_span(event.time - at)} after {validate.isoformat(at)}, more than the "
            f"{settings.future_skew_seconds:g}s allowed (--future-skew-seconds): not acted on")
    if event.kind is Kind.ASG_LIFECYCLE:
        grace, what, flag = timedelta(0), "the lifecycle action's timeout", "--asg-deadline-seconds"
    else:
        grace, what, flag = (timedelta(seconds=settings.stale_after_seconds), "its deadline",
                             "--stale-after-seconds")
    reference = plan.deadline or event.time
    if reference is None or at - reference <= grace:
        return None
    if plan.deadline is None:
        what = "its time"
    return STALE_PAST, (
        f"stale: {what} {validate.isoformat(reference)} passed {_span(at - reference)} before "
        f"{validate.isoformat(at)} (allowed: {grace.total_seconds():g}s, {flag}): not acted on")


def judge(reading: Reading, settings: IntakeSettings, *, at: datetime | None) -> Reading:
    """``reading`` as decided at ``at``: not actionable, with the reason, when stale.

    ``at`` None judges the event as of its own time (a recorded notice as it was decided).
    """
    plan = reading.plan
    at = at if at is not None else plan.event.time
    if not plan.actionable or at is None:
        return reading
    found = staleness(plan, settings, at=at)
    if found is None:
        return reading
    stale, why = found
    return replace(reading, plan=replace(plan, actionable=False, steps=(), reason=why), stale=stale)


def _span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    days, rest = divmod(seconds, 86400)
    return (f"{days}d " if days else "") + f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
