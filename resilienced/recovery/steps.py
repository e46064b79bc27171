"""What each step of a run's recovery did: one frozen dataclass per step, JSON only at the edges.

:class:`~resilienced.recovery.responder.Recovery` fills a run's :class:`StepResults` as its steps go
(NOTIFY -> :class:`NotifyStep`, SIGNAL -> :class:`SignalStep`, DURABLE -> :class:`DurableStep`,
REQUEUE -> :class:`ResumeStep` for an instance already gone, :class:`RequeueStep` and, when the run
is followed, :class:`FollowUpStep`); the follow-up reads them in-process.  They become JSON at the
edges only, each through its own ``as_json``: the run's record in its done claim
(:mod:`resilienced.ops.run_record`), the ``recovery`` log line, the outcome's details and the
notification.  That JSON is a contract (one key per step: ``notify``, ``signal``, ``durable``,
``resume``, ``requeue``, ``follow_up``), and :meth:`StepResults.from_json` is the one way back from
it (``resilienced status``, the drill): a key missing (a record written before the field existed)
is None; a field of the wrong form is a :class:`~resilienced.errors.RecordError` naming it
(``durable.step``).

Pure: imports only the vocabulary (layer 5 of ``resilienced/__init__.py``, so that
``ops.run_record`` may read it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, TypeVar

from resilienced.errors import RecordError
from resilienced.model import Capacity, JsonValue, RequeueResult

#: The steps' keys in a run's report and record, in the order the steps run.
STEP_KEYS = ("notify", "signal", "durable", "resume", "requeue", "follow_up")

DurableOutcome = Literal["durable", "not_durable", "unchecked"]
_Step = TypeVar("_Step")
_Value = TypeVar("_Value")


# --------------------------------------------------------------------------- reading JSON back
class _Fields:
    """One JSON object of a record, read field by field; a field of the wrong form raises
    :class:`RecordError` with its dotted name.  A missing field (or null) is None."""

    def __init__(self, name: str, data: JsonValue) -> None:
        if not isinstance(data, Mapping):
            raise RecordError(name, f"expected an object, got {_shown(data)}")
        self.name, self.data = name, data

    def _wrong(self, key: str, expected: str) -> RecordError:
        return RecordError(f"{self.name}.{key}", f"expected {expected}, got {_shown(self.data[key])}")

    def has(self, key: str) -> bool:
        return key in self.data

    def required(self, key: str, value: _Value | None) -> _Value:
        """``value`` read from ``key``, which a record of this step always has."""
        if value is None:
            raise RecordError(f"{self.name}.{key}", "missing")
        return value

    def text(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        raise self._wrong(key, "a string or null")

    def integer(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise self._wrong(key, "an integer or null")

    def number(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        raise self._wrong(key, "a number or null")

    def flag(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is None or isinstance(value, bool):
            return value
        raise self._wrong(key, "true, false or null")

    def texts(self, key: str) -> tuple[str, ...] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(str(v) for v in value)
        raise self._wrong(key, "a list of strings")

    def mapping(self, key: str) -> Mapping[str, JsonValue] | None:
        value = self.data.get(key)
        if value is None or isinstance(value, Mapping):
            return value
        raise self._wrong(key, "an object or null")

    def time(self, key: str) -> datetime | None:
        value = self.text(key)
        try:
            return None if value is None else datetime.fromisoformat(value)
        except ValueError:
            raise self._wrong(key, "an ISO-8601 time") from None


def _shown(value: JsonValue) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- the steps
@dataclass(frozen=True)
class NotifyStep:
    """NOTIFY: the reason of the Event recorded on the run (``RebalanceRecommendation``)."""

    reason: str

    def as_json(self) -> JsonValue:
        return self.reason

    @classmethod
    def from_json(cls, data: JsonValue) -> NotifyStep:
        if not isinstance(data, str):
            raise RecordError("notify", f"expected a string, got {_shown(data)}")
        return cls(reason=data)


@dataclass(frozen=True)
class SignalStep:
    """SIGNAL: the drain deadline and each Ray node drained -> ``accepted`` | ``already_draining``."""

    deadline: datetime
    drained: Mapping[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, JsonValue]:
        return {"deadline": self.deadline.isoformat(), "drained": dict[str, JsonValue](self.drained)}

    @classmethod
    def from_json(cls, data: JsonValue) -> SignalStep:
        fields = _Fields("signal", data)
        deadline = fields.required("deadline", fields.time("deadline"))
        drained = fields.mapping("drained") or {}
        for node, outcome in drained.items():
            if not isinstance(outcome, str):
                raise RecordError(f"signal.drained.{node}", f"expected a string, got {_shown(outcome)}")
        return cls(deadline=deadline, drained={n: str(o) for n, o in drained.items()})


@dataclass(frozen=True)
class DurableStep:
    """DURABLE: ``outcome`` ``durable`` (a checkpoint saved after the notice is in S3: ``step``,
    ``world_size``, ``notice_to_durable_s``, ``export_tasks``), ``not_durable`` (``reason``; the run
    resumes from ``resume_step``, repeating at least ``steps_lost``; ``rejected``: what was not
    trusted) or ``unchecked`` (no checkpoint URI or no object store: ``reason``).  The outcomes are
    the labels of ``resilienced_checkpoints`` (``unchecked`` counts as ``no_checkpoint_uri``)."""

    outcome: DurableOutcome
    reason: str | None = None
    step: int | None = None
    world_size: int | None = None
    notice_to_durable_s: float | None = None
    export_tasks: tuple[str, ...] = ()
    resume_step: int | None = None
    steps_lost: int | None = None
    rejected: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return self.outcome == "durable"

    @property
    def checkpoint_step(self) -> int | None:
        """The step the run resumes from: the durable one, else the newest from before the notice."""
        return self.step if self.verified else self.resume_step

    def as_json(self) -> dict[str, JsonValue]:
        if self.outcome == "durable":
            return {"verified": True, "step": self.step, "world_size": self.world_size,
                    "notice_to_durable_s": self.notice_to_durable_s, "export_tasks": list(self.export_tasks)}
        if self.outcome == "not_durable":
            return {"verified": False, "reason": self.reason, "resume_step": self.resume_step,
                    "steps_lost": self.steps_lost, "rejected": list(self.rejected)}
        return {"verified": False, "reason": self.reason}

    @classmethod
    def from_json(cls, data: JsonValue) -> DurableStep:
        fields = _Fields("durable", data)
        if fields.required("verified", fields.flag("verified")):
            return cls(outcome="durable", step=fields.integer("step"), world_size=fields.integer("world_size"),
                       notice_to_durable_s=fields.number("notice_to_durable_s"),
                       export_tasks=fields.texts("export_tasks") or ())
        looked = any(fields.has(k) for k in ("resume_step", "steps_lost", "rejected"))
        return cls(outcome="not_durable" if looked else "unchecked", reason=fields.text("reason"),
                   resume_step=fields.integer("resume_step"), steps_lost=fields.integer("steps_lost"),
                   rejected=fields.texts("rejected") or ())


@dataclass(frozen=True)
class ResumeStep:
    """REQUEUE of an instance already gone (no notice): the newest durable checkpoint, its step
    (``resume_step``, None: nothing durable, ``reason`` says so) and its age at the event."""

    resume_step: int | None
    checkpoint_age_s: float | None = None
    reason: str | None = None

    def as_json(self) -> dict[str, JsonValue]:
        if self.resume_step is None:
            return {"resume_step": None, "reason": self.reason}
        return {"resume_step": self.resume_step, "checkpoint_age_s": self.checkpoint_age_s}

    @classmethod
    def from_json(cls, data: JsonValue) -> ResumeStep:
        fields = _Fields("resume", data)
        return cls(resume_step=fields.integer("resume_step"), checkpoint_age_s=fields.number("checkpoint_age_s"),
                   reason=fields.text("reason"))


@dataclass(frozen=True)
class RequeueStep:
    """REQUEUE: the ``RequeueResult`` of the move (``of``), with an elastic run's replacement, or
    the reason nothing could move the run (``unconfigured``: ``capacity`` None).

    The fields a record written before them lacks are None (``run``, ``kind``, ``changes``,
    ``dry_run``)."""

    capacity: Capacity | None
    reason: str | None
    run: str | None = None
    kind: str | None = None
    changes: tuple[str, ...] | None = None
    dry_run: bool | None = None
    reservation_id: str | None = None
    retry_after_s: float | None = None
    details: Mapping[str, JsonValue] = field(default_factory=dict)
    refused: bool = False
    replacement: Mapping[str, JsonValue] | None = None

    @classmethod
    def of(cls, result: RequeueResult, *, replacement: Mapping[str, JsonValue] | None = None) -> RequeueStep:
        return cls(capacity=result.capacity, reason=result.reason, run=result.run_key, kind=result.kind,
                   changes=tuple(result.changes), dry_run=result.dry_run, reservation_id=result.reservation_id,
                   retry_after_s=result.retry_after.total_seconds() if result.retry_after is not None else None,
                   details=dict(result.details), refused=result.refused, replacement=replacement)

    @classmethod
    def unconfigured(cls, reason: str) -> RequeueStep:
        return cls(capacity=None, reason=reason)

    def as_json(self) -> dict[str, JsonValue]:
        """The run's requeue as the record keeps it (``replacement`` last); the keys a record lacks left out."""
        out: dict[str, JsonValue] = {}
        if self.run is not None:
            out["run"] = self.run
        if self.kind is not None:
            out["kind"] = self.kind
        out["capacity"] = self.capacity.value if self.capacity is not None else None
        out["reason"] = self.reason
        if self.changes is not None:
            out["changes"] = list(self.changes)
        if self.dry_run is not None:
            out["dry_run"] = self.dry_run
        if self.reservation_id:
            out["reservation_id"] = self.reservation_id
        if self.retry_after_s is not None:
            out["retry_after_seconds"] = self.retry_after_s
        if self.details:
            out["details"] = dict(self.details)
        if self.refused:
            out["refused"] = True
        if self.replacement is not None:
            out["replacement"] = dict(self.replacement)
        return out

    @classmethod
    def from_json(cls, data: JsonValue) -> RequeueStep:
        fields = _Fields("requeue", data)
        capacity = fields.text("capacity")
        try:
            where = Capacity(capacity) if capacity is not None else None
        except ValueError:
            raise RecordError("requeue.capacity", f"expected one of {', '.join(c.value for c in Capacity)}, "
                                                  f"got {capacity!r}") from None
        return cls(capacity=where, reason=fields.text("reason"), run=fields.text("run"), kind=fields.text("kind"),
                   changes=fields.texts("changes"), dry_run=fields.flag("dry_run"),
                   reservation_id=fields.text("reservation_id"), retry_after_s=fields.number("retry_after_seconds"),
                   details=fields.mapping("details") or {}, refused=bool(fields.flag("refused")),
                   replacement=fields.mapping("replacement"))


@dataclass(frozen=True)
class FollowUpStep:
    """The follow-up the requeue opened (or kept): its event, stage, stages and capacity."""

    event_id: str
    stage: str
    stages: tuple[str, ...]
    capacity: str

    def as_json(self) -> dict[str, JsonValue]:
        return {"event_id": self.event_id, "stage": self.stage, "stages": list(self.stages),
                "capacity": self.capacity}

    @classmethod
    def from_json(cls, data: JsonValue) -> FollowUpStep:
        fields = _Fields("follow_up", data)
        event_id, stage, capacity = (fields.required(k, fields.text(k)) for k in ("event_id", "stage", "capacity"))
        return cls(event_id=event_id, stage=stage, stages=fields.texts("stages") or (), capacity=capacity)


# --------------------------------------------------------------------------- one run's steps
@dataclass(frozen=True)
class StepResults:
    """What each step did to one run (None: the step did not run, or a record has no report of it)."""

    notify: NotifyStep | None = None
    signal: SignalStep | None = None
    durable: DurableStep | None = None
    resume: ResumeStep | None = None
    requeue: RequeueStep | None = None
    follow_up: FollowUpStep | None = None

    @property
    def checkpoint_step(self) -> int | None:
        """The step the run resumes from (the DURABLE step's, else the resume point's; None: unknown)."""
        if self.durable is not None:
            return self.durable.checkpoint_step
        return self.resume.resume_step if self.resume is not None else None

    @property
    def checkpoint_world_size(self) -> int | None:
        """The world size of a verified durable checkpoint (None: none verified)."""
        return self.durable.world_size if self.durable is not None and self.durable.verified else None

    def as_json(self) -> dict[str, JsonValue]:
        """One key per step that ran, in the order of ``STEP_KEYS``."""
        out: dict[str, JsonValue] = {}
        for key, step in zip(STEP_KEYS, (self.notify, self.signal, self.durable, self.resume, self.requeue,
                                         self.follow_up)):
            if step is not None:
                out[key] = step.as_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> StepResults:
        """The steps of a run's report or record (its other keys are not read); raises
        :class:`RecordError` naming the first field of the wrong form."""
        return cls(notify=_step(data, "notify", NotifyStep.from_json),
                   signal=_step(data, "signal", SignalStep.from_json),
                   durable=_step(data, "durable", DurableStep.from_json),
                   resume=_step(data, "resume", ResumeStep.from_json),
                   requeue=_step(data, "requeue", RequeueStep.from_json),
                   follow_up=_step(data, "follow_up", FollowUpStep.from_json))


def _step(data: Mapping[str, JsonValue], key: str, parse: Callable[[JsonValue], _Step]) -> _Step | None:
    value = data.get(key)
    return None if value is None else parse(value)
