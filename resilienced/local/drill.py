"""``resilienced drill``: the whole interruption story on one machine.

The drill starts and wires, all on 127.0.0.1:

* moto server (EventBridge, SQS with a DLQ, S3), with one EventBridge rule per event kind;
* a local multi-node Ray cluster: a head with no CPUs and ``--workers`` worker nodes, each
  labelled with a made-up instance id and ``resilienced.io/capacity-type=spot``;
* the FSx stand-in: a local checkpoint root and an exporter that copies committed checkpoint
  files to ``s3://<bucket>/runs/drill`` as DRA auto-export does;
* the trainer (``python -m trainer``, FSDP2 on gloo, ``--workers`` ranks) on that cluster;
* the daemon in ray mode (in this process), whose requeue asks a local provider for
  replacement nodes: ``--spot-capacity`` Spot nodes (0 by default) and a Capacity Block of
  ``--workers`` nodes.

Then it plays an interruption as AWS FIS does: a rebalance recommendation, then the Spot
interruption notice for one worker's instance, then that instance's termination at the deadline
(``--scenario spot``); or an instance that is simply gone, announced only by a state change
(``--scenario abrupt``); or the Spot story where the Capacity Block the daemon decides first
accepts the launch but its node never joins (``--scenario stalled``): the daemon's follow-up
sees the stall after its bound and moves the run to On-Demand, which the provider has here.  The
run resumes and finishes; an uninterrupted reference run with the same seed (no Ray) gives the
losses to compare with, bit for bit: at the same world size (run while the cluster and the
trainer start: a gang run's world size is known from the start), or, for an elastic run, at the
same world sizes at the same steps, once the run has finished (and the fixed-size one as a figure).

Time is compressed: EC2's notice is 120 s; the drill tells the daemon (``--notice-seconds`` of
the intake) and the world that it is ``--notice-seconds`` (25 by default), so the whole story
fits in a few minutes.  Everything else is real: the drain is Ray's, the checkpoint is torch DCP,
the S3 check reads what the exporter wrote, the replacement is a new Ray node.

Anchors for ``docs/benchmarks.md``: ``--daemon off`` (no daemon: periodic checkpoints only; the
drill itself replaces the lost node, as an autoscaler would) and ``--preemption-poll 5`` (Ray
Train's default poll interval, against the 0.5 s the trainer documents).

Everything started is stopped at the end, also on Ctrl-C and on failure; the work directory is
removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar
from urllib.parse import urlsplit

from resilienced import log
from resilienced.clock import utcnow
from resilienced.errors import ConfigError, ResilienceError
from resilienced.local.drill_ledger import PRICED_AS
from resilienced.model import CAPACITY_NAMES
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL as CAPACITY_LABEL
from resilienced.ray.cluster import ELASTIC_LABEL
from resilienced.ray.cluster import INSTANCE_ID_LABEL as INSTANCE_LABEL
from resilienced.recovery.steps import StepResults
from resilienced.settings import (
    FollowUpSettings,
    LedgerSettings,
    HttpSettings,
    IntakeSettings,
    Mode,
    ModeSettings,
    NotifySettings,
    QueueSettings,
    RecoverySettings,
    Settings,
)

if TYPE_CHECKING:  # imported where used: `resilienced drill --help` does not load the daemon's adapters
    from resilienced.app.runtime import StandIns
    from resilienced.model import Capacity, JsonValue
    from resilienced.ports import NodeProvider, ProvidedNode
    from resilienced.local.raycluster import LocalRayNode

REGION = "us-east-1"
BUCKET = "resilienced-drill"
PREFIX = "runs/drill"
INSTANCE_TYPE = "drill.cpu"
BLOCK_ID = "cr-0d1e2a3b4c5d6e7f8"
ZONE = f"{REGION}a"  # the block's zone
SCENARIOS = ("spot", "abrupt", "elastic", "stalled")
#: ``local``: Ray nodes started by the local provider; ``ec2``: instances launched through EC2's API
#: on moto by the production provider, each joined by the user-data hook (``resilienced.local.ec2``).
PROVIDERS = ("local", "ec2")
#: Scenarios that play a Spot notice (rebalance, notice, termination at the deadline).
NOTICE_SCENARIOS = ("spot", "elastic", "stalled")
#: The daemon's follow-up bounds in the drill (time is compressed, as the notice is): a replacement
#: joins within seconds here (``--node-boot-seconds`` more where set), and the run trains again
#: once the lost node is gone (at the deadline) and Ray Train restarted it.
JOINED_BOUND_S = 20.0
TRAINING_BOUND_EXTRA_S = 90.0
#: The relative difference from the fixed-size run above which an elastic run's loss counts as
#: having drifted (``loss_diff_from_step``): the float32 rounding of another world size shows from
#: there (docs/benchmarks.md).  A figure, not a check: the check is bit for bit against the
#: uninterrupted run with the same world sizes.
LOSS_DRIFT = 1e-6
#: The elastic scenario's loss check.
SAME_LOSSES = "losses equal the uninterrupted run with the same world sizes"
#: ``--resize-interval-s`` of an elastic drill run: how often Ray Train considers growing it
#: (time is compressed, as the notice is; Ray's default is 60 s).
RESIZE_INTERVAL_S = 2.0
#: Defaults of ``--scenario elastic`` where the flag is not given (3 workers, min 2; a replacement
#: that joins after the lost node is gone; a run long enough to grow back before it ends).
ELASTIC_DEFAULTS = {"workers": 3, "steps": 300, "node_boot_seconds": 60.0}


T = TypeVar("T")
#: In the environment of every process the drill starts (moto, Ray nodes, the trainer, the
#: reference run): its work dir, so that what it left running can be found (the tests look).
WORKDIR_MARKER = "RESILIENCED_DRILL_WORKDIR"
#: Exit code after SIGTERM (128 + 15), as a shell reports a process ended by it; Ctrl-C: 130.
EXIT_TERMINATED = 143


#: Lines of the trainer's and the daemon's logs that a failed drill prints (README, the drill).
FAILURE_TAIL_LINES = 40


class DrillError(ResilienceError):
    """The drill could not play its story (a part did not start, the run did not finish)."""


@dataclass(frozen=True)
class DrillOptions:
    workers: int = 2
    steps: int = 80
    interrupt_at_step: int = 15
    spot_capacity: int = 0
    seed: int = 0
    scenario: str = "spot"
    keep: bool = False
    json_report: str | None = None
    plot: str | None = None  # --plot FILE.png: the run's timeline (issue #43)
    notice_seconds: float = 25.0
    checkpoint_every: int = 10
    preemption_poll: float = 0.5
    daemon: bool = True
    step_seconds: float = 0.5
    timeout: float = 300.0
    workdir: str | None = None
    notify_webhook: str | None = None
    node_boot_seconds: float = 0.0
    join_estimate_seconds: float | None = None
    provider: str = "local"

    @property
    def join_estimate(self) -> float | None:
        """What the daemon is told a node takes to join (``--node-join-seconds``): the boot time
        unless ``--join-estimate-seconds`` says otherwise (to play a wrong estimate); None: nothing."""
        if self.join_estimate_seconds is not None:
            return self.join_estimate_seconds
        return self.node_boot_seconds or None

    @property
    def min_workers(self) -> int | None:
        """The elastic run's minimum (one node may go): ``--min-workers`` of the trainer."""
        return self.workers - 1 if self.scenario == "elastic" else None

    def validate(self) -> DrillOptions:
        if self.workers < 1:
            raise ConfigError("--workers", f"must be at least 1, got {self.workers}")
        if self.steps < 2:
            raise ConfigError("--steps", f"must be at least 2, got {self.steps}")
        if not 1 <= self.interrupt_at_step < self.steps:
            raise ConfigError("--interrupt-at-step", f"must be between 1 and --steps - 1 "
                                                     f"({self.steps - 1}), got {self.interrupt_at_step}")
        if self.spot_capacity < 0:
            raise ConfigError("--spot-capacity", f"must be >= 0, got {self.spot_capacity}")
        if self.provider not in PROVIDERS:
            raise ConfigError("--provider", f"expected one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.scenario not in SCENARIOS:
            raise ConfigError("--scenario", f"expected one of {', '.join(SCENARIOS)}, got {self.scenario!r}")
        if self.scenario == "elastic" and self.workers < 2:
            raise ConfigError("--workers", f"an elastic run needs at least 2 workers (one goes), got {self.workers}")
        if self.scenario == "elastic" and (4 * self.workers) % (self.workers - 1):
            raise ConfigError("--workers", (
                f"the global batch of {self.workers} workers ({4 * self.workers}: 4 per worker) does not split "
                f"evenly over {self.workers - 1}, which the reference run without Ray needs: use 2, 3 or 5"))
        if not 0 <= self.node_boot_seconds <= 600:
            raise ConfigError("--node-boot-seconds", f"must be between 0 and 600, got {self.node_boot_seconds}")
        if self.join_estimate_seconds is not None and not 1 <= self.join_estimate_seconds <= 3600:
            raise ConfigError("--join-estimate-seconds", f"must be between 1 and 3600, got {self.join_estimate_seconds}")
        if not 5 <= self.notice_seconds <= 120:
            raise ConfigError("--notice-seconds", f"must be between 5 and 120, got {self.notice_seconds}")
        if self.checkpoint_every < 0:
            raise ConfigError("--checkpoint-every", f"must be >= 0, got {self.checkpoint_every}")
        if not 0.05 <= self.preemption_poll <= 60:
            raise ConfigError("--preemption-poll", f"must be between 0.05 and 60 s, got {self.preemption_poll}")
        if self.step_seconds < 0:
            raise ConfigError("--step-seconds", f"must be >= 0, got {self.step_seconds}")
        if (self.scenario in ("spot", "stalled") and self.step_seconds > 0
                and (self.steps - self.interrupt_at_step) * self.step_seconds <= self.notice_seconds):
            raise ConfigError("--steps", (
                f"the run would finish before the deadline ({self.steps - self.interrupt_at_step} steps "
                f"of at least {self.step_seconds:g}s after the notice <= {self.notice_seconds:g}s): "
                "raise --steps or --step-seconds, or lower --notice-seconds"))
        if (self.scenario == "elastic" and self.step_seconds > 0 and (self.steps - self.interrupt_at_step)
                * self.step_seconds <= self.notice_seconds + self.node_boot_seconds + 30):
            raise ConfigError("--steps", (
                f"the elastic run would finish before it grows back ({self.steps - self.interrupt_at_step} steps of "
                f"{self.step_seconds:g}s after the notice <= notice {self.notice_seconds:g}s + node boot "
                f"{self.node_boot_seconds:g}s + 30s): raise --steps"))
        if self.notify_webhook is not None:
            NotifySettings(notify_webhook=self.notify_webhook).validate()
        if self.workdir is not None and len(str(Path(self.workdir).absolute() / "ray")) > 45:
            raise ConfigError("--workdir", f"{self.workdir!r} is too long: Ray keeps unix sockets under "
                                           "it (at most 41 characters, e.g. /tmp/drill)")
        return self


# --------------------------------------------------------------------------- the timeline
@dataclass
class Timeline:
    """What happened when, printed live relative to the notice (before it: relative to start)."""

    out: TextIO
    started: float = field(default_factory=time.time)
    notice: float | None = None
    entries: list[dict[str, JsonValue]] = field(default_factory=list)

    def add(self, who: str, what: str, *, at: float | None = None) -> None:
        at = time.time() if at is None else at
        self.entries.append({"time": at, "who": who, "what": what})
        if self.notice is None:
            stamp = f"   start+{at - self.started:6.1f}s"
        else:
            stamp = f"  notice{at - self.notice:+7.1f}s"
        self.out.write(f"{stamp}  {who:<8} {what}\n")
        self.out.flush()


class JsonLines:
    """Tails a JSON-lines file written by another process (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.lines: list[dict[str, JsonValue]] = []

    def read_new(self) -> list[dict[str, JsonValue]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        new = []
        for raw in complete:
            if raw.strip():
                try:
                    new.append(json.loads(raw))
                except json.JSONDecodeError:
                    continue
        self.lines.extend(new)
        return new


# --------------------------------------------------------------------------- events to put
def _event(detail_type: str, detail: dict[str, JsonValue], *, instance_id: str, when: datetime) -> dict[str, JsonValue]:
    return {
        "Source": "aws.ec2",
        "DetailType": detail_type,
        "Detail": json.dumps(detail),
        "Resources": [f"arn:aws:ec2:{REGION}a:instance/{instance_id}"],
        "Time": when,
        "EventBusName": "default",
    }


def rebalance(instance_id: str, when: datetime) -> dict[str, JsonValue]:
    return _event("EC2 Instance Rebalance Recommendation", {"instance-id": instance_id},
                  instance_id=instance_id, when=when)


def spot_notice(instance_id: str, when: datetime) -> dict[str, JsonValue]:
    return _event("EC2 Spot Instance Interruption Warning",
                  {"instance-id": instance_id, "instance-action": "terminate"},
                  instance_id=instance_id, when=when)


def state_change(instance_id: str, state: str, when: datetime) -> dict[str, JsonValue]:
    return _event("EC2 Instance State-change Notification",
                  {"instance-id": instance_id, "state": state}, instance_id=instance_id, when=when)


def made_up_ids(n: int, *, seed: int) -> list[str]:
    """Instance ids of EC2's form (``i-`` + 17 hex), stable for a seed."""
    return [f"i-0{(seed * 7919 + i + 1) * 0x9E3779B1 % (1 << 64):016x}" for i in range(n)]


# --------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class ResumeFacts:
    """Where the trainer was stopped and where it went on, from its metrics and events."""

    interrupted_at: int | None  # the last step of the first attempt
    checkpoint_step: int | None  # the step the attempt after the notice resumed from
    resumed_at: int | None  # that attempt's first step
    after: list[dict[str, JsonValue]]  # that attempt's metrics
    heard: dict[str, JsonValue] | None  # the trainer's first preemption_notice event after the notice
    committed: list[dict[str, JsonValue]]  # the checkpoints committed after it, at or beyond its step


def resume_facts(*, metrics: list[dict[str, JsonValue]], events: list[dict[str, JsonValue]], notice: float | None) -> ResumeFacts:
    """The first attempt's last step, the resumed attempt's checkpoint and first step, and the
    checkpoint holding the step the notice reached the trainer at (spot): the first committed after
    the notice at or beyond that step (a periodic save of it counts); abrupt: none."""
    starts = sorted((e for e in events if e.get("event") == "started"), key=lambda e: e["time"])
    resumed = next((e for e in starts if e.get("resumed_from_step") is not None and
                    notice is not None and e["time"] >= notice), None)
    first_attempt = starts[0].get("attempt") if starts else None
    before = [m for m in metrics if m.get("attempt") == first_attempt] if starts else metrics
    after = ([m for m in metrics if m.get("attempt") == resumed.get("attempt")] if resumed else [])
    heard = next((e for e in sorted(events, key=lambda e: e["time"]) if e.get("event") == "preemption_notice"
                  and notice is not None and e["time"] >= notice), None)
    committed = [e for e in events if e.get("event") == "checkpoint_committed" and heard is not None
                 and e["time"] >= notice and e.get("step", -1) >= heard.get("step", 0)]
    return ResumeFacts(interrupted_at=max((m["step"] for m in before), default=None),
                       checkpoint_step=resumed.get("resumed_from_step") if resumed else None,
                       resumed_at=min((m["step"] for m in after), default=None),
                       after=after, heard=heard, committed=committed)


def report_from(
    *, options: DrillOptions, metrics: list[dict[str, JsonValue]], events: list[dict[str, JsonValue]],
    reference: dict[int, float], notice: float | None, durable_at: float | None, capacity: str | None,
    trainer_exit: int | None, node_spans: Sequence[tuple[float, float | None]] = (),
    fixed_reference: dict[int, float] | None = None, replacement: dict[str, JsonValue] | None = None,
    follow_up: Mapping[str, JsonValue] | None = None, ec2: Mapping[str, JsonValue] | None = None,
) -> dict[str, JsonValue]:
    """The drill's report, from what the trainer, the daemon and the reference wrote.

    ``reference``: the uninterrupted run's losses with the run's world sizes (its
    :func:`world_size_schedule`); ``fixed_reference``: the uninterrupted run at ``--workers``
    (None: the same run).  ``node_spans``: (joined, gone or None) of every worker node, for
    ``worker_seconds_idle`` and ``restarts``.  ``replacement``: what the daemon announced to an
    elastic run (``resilienced.ray.replacement``), against when the replacement joined;
    ``follow_up``: the daemon's follow-up record (:func:`follow_up_facts`), None: not read;
    ``ec2``: ``--provider ec2``'s ``ec2_launches`` and ``ec2_terminations`` (:func:`ec2_checks`)."""
    run = resume_facts(metrics=metrics, events=events, notice=notice)
    interrupted_at, checkpoint_step, resumed_at = run.interrupted_at, run.checkpoint_step, run.resumed_at
    losses = loss_facts(options, metrics, reference, fixed_reference)
    every_step, trained_twice = losses["every_step"], losses["steps_trained_twice"]
    idle = idle_facts(options=options, metrics=metrics, notice=notice, node_spans=node_spans)
    finished = any(e.get("event") == "finished" for e in events)

    def since(t: float | None) -> float | None:
        return None if t is None or notice is None else round(t - notice, 3)
    steps_lost = (interrupted_at - checkpoint_step
                  if interrupted_at is not None and checkpoint_step is not None else None)
    checks = {
        "run finished": finished and trainer_exit == 0 and every_step,
        "run resumed from a checkpoint": checkpoint_step is not None,
        "resumed_at_step == checkpoint_step + 1": (resumed_at is not None and checkpoint_step is not None
                                                   and resumed_at == checkpoint_step + 1),
    }
    checks[SAME_LOSSES if options.scenario == "elastic" else "losses match the uninterrupted run"] = \
        losses["losses_match_uninterrupted"]
    if options.scenario == "elastic":
        checks.update(elastic_checks(options, idle=idle, trained_twice=trained_twice, events=events))
    if options.scenario in NOTICE_SCENARIOS and options.daemon:
        checks["no step lost"] = steps_lost == 0
        checks["requeued on capacity that exists"] = capacity in CAPACITY_NAMES
    followed, follow_checks = follow_up_facts(options, follow_up)
    checks.update(follow_checks)
    if ec2 is not None:
        checks.update(ec2_checks(options, ec2))
    return {
        "ok": all(checks.values()),
        "scenario": options.scenario,
        "daemon": options.daemon,
        "workers": options.workers,
        "steps": options.steps,
        "seed": options.seed,
        "notice_seconds": options.notice_seconds,
        "preemption_poll_s": options.preemption_poll,
        "interrupted_at_step": interrupted_at,
        "checkpoint_step": checkpoint_step,
        "resumed_at_step": resumed_at,
        "steps_lost": steps_lost,
        "steps_trained_twice": trained_twice,
        "notice_to_trainer_s": since(run.heard["time"] if run.heard else None),
        "notice_to_checkpoint_s": since(min((e["time"] for e in run.committed), default=None)),
        "notice_to_durable_s": since(durable_at),
        "notice_to_resumed_s": since(min((m["time"] for m in run.after), default=None)),
        "capacity": capacity,
        **followed,
        **{k: v for k, v in losses.items() if k not in ("every_step", "steps_trained_twice")},
        **restart_report(metrics=metrics, events=events, node_spans=node_spans, replacement=replacement),
        **idle,
        **(dict(ec2) if ec2 is not None else {}),
        "checks": checks,
    }


def ec2_checks(options: DrillOptions, ec2: Mapping[str, JsonValue]) -> dict[str, bool]:
    """``--provider ec2``: the replacement was an EC2 launch; a block launch named the block; in the
    stalled story the block's instance was terminated before the On-Demand launch."""
    launches = [launch for launch in ec2.get("ec2_launches") or () if not launch.get("error")]
    block = [launch for launch in launches if launch["market"] == "capacity-block"]
    checks = {"the replacement was launched through EC2's API": bool(launches)}
    if options.scenario in ("spot", "stalled") and options.spot_capacity == 0:
        checks["the Capacity Block launch names the block's reservation id"] = bool(block) and all(
            launch["reservation_id"] == BLOCK_ID for launch in block)
    if options.scenario == "stalled":
        terminated = list(ec2.get("ec2_terminations") or ())
        on_demand = [launch for launch in launches if launch["market"] == "on-demand"]
        checks["the stalled block's instance was terminated, then On-Demand launched"] = bool(
            block and on_demand and all(launch["instance_id"] in terminated for launch in block)
            and launches.index(on_demand[0]) > launches.index(block[-1]))
    return checks


def follow_up_facts(options: DrillOptions, record: Mapping[str, JsonValue] | None) -> tuple[dict[str, JsonValue], dict[str, bool]]:
    """What the daemon itself recorded of the run's way back (its follow-up), and the checks on it.

    ``daemon_training_again_s``: notice -> the first step trained again, as the daemon recorded it
    (the trainer's resume record); ``recovery_stages``: stage -> seconds from the notice;
    ``fallbacks``: ``{from, to, reason}`` of each move the follow-up made (empty: none).
    """
    facts: dict[str, JsonValue] = {"daemon_training_again_s": None, "recovery_stages": {}, "fallbacks": []}
    if record is None:
        return facts, {}
    if record:
        from resilienced.followup.rules import FollowUp

        follow_up = FollowUp.from_json(record)
        stages = follow_up.stage_seconds()
        facts.update(daemon_training_again_s=stages.get("training"), recovery_stages=stages,
                     fallbacks=[{k: f.get(k) for k in ("from", "to", "reason")} for f in follow_up.fallbacks])
    checks = {"the daemon saw the run train again": facts["daemon_training_again_s"] is not None}
    if options.scenario == "stalled":
        checks["the stalled Capacity Block was left for On-Demand"] = any(
            str(f["from"]).startswith("capacity-block") and str(f["to"]).startswith("on-demand")
            for f in facts["fallbacks"])
    return facts, checks


def loss_facts(options: DrillOptions, metrics: list[dict[str, JsonValue]], reference: dict[int, float],
               fixed: dict[int, float] | None = None) -> dict[str, JsonValue]:
    """What the losses say, against the uninterrupted runs.

    ``losses_match_uninterrupted``: every line's loss (a step trained twice too) equals, bit for
    bit, ``reference`` (the uninterrupted run with the same world sizes); ``loss_max_rel_diff``
    and ``loss_diff_from_step``: the largest relative difference from ``fixed`` (the run at
    ``--workers``; None: ``reference``) and the first step whose difference exceeds
    :data:`LOSS_DRIFT` (None: none does).
    """
    final: dict[int, list[float]] = {}
    for m in metrics:
        final.setdefault(int(m["step"]), []).append(float(m["loss"]))
    every_step = all(s in final for s in range(1, options.steps + 1))
    match = bool(reference) and every_step and all(
        reference.get(step) is not None and all(loss == reference[step] for loss in losses)
        for step, losses in final.items())
    fixed = reference if fixed is None else fixed
    diffs = {step: abs(losses[-1] - fixed[step]) / abs(fixed[step]) if fixed[step] else abs(losses[-1])
             for step, losses in sorted(final.items()) if step in fixed}
    return {
        "every_step": every_step,
        "steps_trained_twice": sum(len(v) - 1 for v in final.values()),
        "losses_match_uninterrupted": match,
        "loss_max_rel_diff": float(f"{max(diffs.values()):.3g}") if diffs else None,
        "loss_diff_from_step": next((step for step, d in diffs.items() if d > LOSS_DRIFT), None),
    }


def world_size_schedule(metrics: list[dict[str, JsonValue]]) -> list[tuple[int, int]]:
    """The world size each step was trained at, as segments ``(world size, last step)``.

    A step trained twice counts at its last line (the one the run went on from).
    """
    size = {int(m["step"]): int(m.get("world_size") or 0) for m in metrics}
    segments: list[tuple[int, int]] = []
    for step in sorted(size):
        if segments and segments[-1][0] == size[step]:
            segments[-1] = (size[step], step)
        else:
            segments.append((size[step], step))
    return segments


def restart_facts(*, metrics: list[dict[str, JsonValue]], events: list[dict[str, JsonValue]],
                  node_spans: Sequence[tuple[float, float | None]]) -> list[dict[str, JsonValue]]:
    """How long each restart took: from what it waited for to the new attempt's first step.

    For every attempt after the first: ``after`` is the last of what happened between the previous
    attempt's last step and this one's first: ``resize`` (Ray Train asked the ranks to save before
    it grows the run), ``node gone`` (the lost node terminated), ``node joined`` (the replacement
    joined: a gang, or an elastic run that waited for it); ``seconds`` runs from it to the end of the
    first step (the metric line).
    """
    by_attempt: dict[Any, list[dict[str, JsonValue]]] = {}
    for m in sorted(metrics, key=lambda m: m["time"]):
        by_attempt.setdefault(m.get("attempt"), []).append(m)
    attempts = sorted(by_attempt.values(), key=lambda lines: lines[0]["time"])
    out = []
    for before, lines in zip(attempts, attempts[1:]):
        stopped, first = before[-1]["time"], lines[0]["time"]
        marks = [(stopped, "last step")]
        marks += [(e["time"], "resize") for e in events if e.get("event") == "resize_requested"]
        marks += [(gone, "node gone") for _joined, gone in node_spans if gone is not None]
        marks += [(joined, "node joined") for joined, _gone in node_spans]
        at, after = max((m for m in marks if stopped <= m[0] <= first), key=lambda m: m[0])
        out.append({"attempt": lines[0].get("attempt"), "world_size": lines[0].get("world_size"),
                    "after": after, "seconds": round(first - at, 1)})
    return out


def restart_report(*, metrics: list[dict[str, JsonValue]], events: list[dict[str, JsonValue]],
                   node_spans: Sequence[tuple[float, float | None]],
                   replacement: dict[str, JsonValue] | None) -> dict[str, JsonValue]:
    """The world sizes and the restarts: as the drill saw them, as the run measured them
    (``restarted`` events), the elastic run's shrink-or-wait decision and the daemon's estimate."""
    return {
        "world_size_schedule": world_size_schedule(metrics),
        "restarts": restart_facts(metrics=metrics, events=events, node_spans=node_spans),
        "restarts_measured": [{k: e.get(k) for k in ("kind", "world_size", "seconds", "phases")}
                              for e in events if e.get("event") == "restarted"],
        "elastic_decision": next(((e.get("decision") or {}).get("reason") for e in events
                                  if e.get("event") == "restarted" and e.get("decision")), None),
        "replacement": _replacement_facts(replacement, node_spans),
    }


def _replacement_facts(announced: dict[str, JsonValue] | None,
                       node_spans: Sequence[tuple[float, float | None]]) -> dict[str, JsonValue] | None:
    """The daemon's estimate of the replacement's join, and the join (seconds after it was asked for)."""
    if not announced or announced.get("asked_at") is None:
        return None
    asked = float(announced["asked_at"])
    joined = min((j for j, _gone in node_spans if j >= asked), default=None)
    return {"expected_join_s": announced.get("expected_join_s"), "basis": announced.get("basis"),
            "joined_s": round(joined - asked, 1) if joined is not None else None}


def elastic_checks(options: DrillOptions, *, idle: dict[str, JsonValue], trained_twice: int,
                   events: Sequence[dict[str, JsonValue]] = ()) -> dict[str, bool]:
    """The elastic story's checks.  The run either shrank (resumed at ``--workers`` - 1) or, when
    its replacement was due before shrinking would pay, waited for it and resumed at full size
    (its ``restarted`` event says which, ``trainer.replacement``)."""
    waited = any(e.get("event") == "restarted" and (e.get("decision") or {}).get("outcome") == "joined"
                 for e in events)
    resumed = (f"waited for the replacement and resumed at world size {options.workers}" if waited
               else f"resumed at world size {options.min_workers}")
    return {
        resumed: idle["resumed_world_size"] == (options.workers if waited else options.min_workers),
        f"back at world size {options.workers}": idle["back_to_full_s"] is not None,
        "no step trained twice": trained_twice == 0,
    }


def training_spans(metrics: list[dict[str, JsonValue]]) -> list[tuple[float, float, int]]:
    """(start, end, world size) of each attempt's training, from its metric lines.

    A line is written when a step ends; the attempt trained from one step (the median step time)
    before its first line to its last line.
    """
    by_attempt: dict[Any, list[dict[str, JsonValue]]] = {}
    for m in metrics:
        by_attempt.setdefault(m.get("attempt"), []).append(m)
    spans = []
    for lines in by_attempt.values():
        times = sorted(float(m["time"]) for m in lines)
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        step = gaps[len(gaps) // 2] if gaps else 0.0
        spans.append((times[0] - step, times[-1], int(lines[0].get("world_size") or 0)))
    return sorted(spans)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def idle_facts(*, options: DrillOptions, metrics: list[dict[str, JsonValue]], notice: float | None,
               node_spans: Sequence[tuple[float, float | None]]) -> dict[str, JsonValue]:
    """What an interruption cost in worker time, from the notice until the run is back at full size.

    ``worker_seconds_idle``: the seconds worker nodes were up (the lost one until it went, the
    replacement from when it joined) minus the seconds of ranks training (world size x time),
    between the notice and the start of the first attempt at ``--workers`` after it.
    ``resumed_world_size``: the world size of the first attempt after the notice.
    """
    spans = training_spans(metrics)
    after = [s for s in spans if notice is not None and s[0] >= notice]
    full = next((s for s in after if s[2] == options.workers), None)
    facts: dict[str, JsonValue] = {"resumed_world_size": after[0][2] if after else None,
                             "back_to_full_s": None, "worker_seconds_idle": None}
    if notice is None or full is None:
        return facts
    window = (notice, full[0])
    up = sum(_overlap((joined, gone if gone is not None else float("inf")), window) for joined, gone in node_spans)
    training = sum(ws * _overlap((start, end), window) for start, end, ws in spans)
    facts["back_to_full_s"] = round(full[0] - notice, 3)
    facts["worker_seconds_idle"] = round(up - training, 1) if node_spans else None
    return facts


def table(report: dict[str, JsonValue]) -> str:
    keys = ("ok", "scenario", "interrupted_at_step", "checkpoint_step", "resumed_at_step",
            "steps_lost", "steps_trained_twice", "notice_to_trainer_s", "notice_to_checkpoint_s",
            "notice_to_durable_s",
            "notice_to_resumed_s", "capacity", "daemon_training_again_s", "recovery_stages", "fallbacks",
            "losses_match_uninterrupted", "loss_max_rel_diff", "loss_diff_from_step", "world_size_schedule",
            "restarts", "restarts_measured", "elastic_decision", "replacement", "resumed_world_size",
            "back_to_full_s", "worker_seconds_idle", "ledger")
    width = max(len(k) for k in keys)

    def shown(key: str) -> Any:
        if key == "ledger":
            led = report.get(key) or {}
            cost = led.get("cost") or {}
            return (f"lost {led.get('lost_gpu_seconds')} GPU-s {led.get('parts')}, goodput {led.get('goodput')}, "
                    f"premium {cost.get('premium')} USD, prices {cost.get('prices')}") if led else None
        if key == "fallbacks":
            return "; ".join(f"{f.get('from')} -> {f.get('to')}" for f in report.get(key) or []) or "none"
        return report.get(key)

    lines = [f"  {k:<{width}}  {shown(k)}" for k in keys]
    lines += [f"  {'ec2_launch':<{width}}  {launch}" for launch in report.get("ec2_launches") or ()]
    if "ec2_terminations" in report:
        lines.append(f"  {'ec2_terminations':<{width}}  {report['ec2_terminations']}")
    lines += [f"  {'check':<{width}}  {'passed' if v else 'FAILED'}: {name}"
              for name, v in report["checks"].items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the drill
class BootingProvider:
    """The local node provider with a boot time: a node joins ``boot_seconds`` after it is asked for.

    EC2 (or Karpenter) answers a launch at once with an instance that runs Ray minutes later; the
    local provider starts a node in seconds.  This wrapper answers at once with the booting
    node (listed by :meth:`nodes`, so a second event for the same lost instance finds its
    replacement, as it would find a pending EC2 instance) and starts it ``boot_seconds`` later,
    so that the replacement joins after the lost node is gone, as it does on AWS.
    """

    def __init__(self, inner: NodeProvider, *, boot_seconds: float) -> None:
        self._inner = inner
        self._boot_seconds = boot_seconds
        self._booting: dict[str, tuple[ProvidedNode, asyncio.Task[None]]] = {}

    async def available(self, capacity: Capacity) -> int | None:
        have = await self._inner.available(capacity)
        booting = sum(1 for node, _ in self._booting.values() if node.capacity == capacity)
        return None if have is None else max(0, have - booting)

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None, idempotency_key: str | None = None,
                     ) -> list[ProvidedNode]:
        from resilienced.ports import ProvidedNode

        n = min(len(node_labels), await self.available(capacity) or 0)
        if n == 0:  # the inner provider says NoCapacity, in its words
            return await self._inner.launch(capacity=capacity, node_labels=node_labels, reservation_id=reservation_id)
        started = []
        for labels in node_labels[:n]:
            node = ProvidedNode(f"i-booting-{secrets.token_hex(4)}", capacity, dict(labels))
            task = asyncio.create_task(self._boot(node, reservation_id), name="drill.boot")
            self._booting[node.instance_id] = (node, task)
            started.append(node)
        return started

    async def _boot(self, node: ProvidedNode, reservation_id: str | None) -> None:
        try:
            await asyncio.sleep(self._boot_seconds)
            await self._inner.launch(capacity=node.capacity, node_labels=[node.labels], reservation_id=reservation_id)
        except Exception as e:  # nobody awaits this task: say why the replacement never joined
            log.get("resilienced.drill").error("replacement node failed to boot", instance_id=node.instance_id,
                                               error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._booting.pop(node.instance_id, None)

    async def nodes(self) -> list[ProvidedNode]:
        return [*await self._inner.nodes(), *(node for node, _ in self._booting.values())]

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        started = []
        for node in nodes:
            entry = self._booting.pop(node.instance_id, None)
            if entry is not None:
                entry[1].cancel()
            else:
                started.append(node)
        if started:
            await self._inner.release(started)


class StallingProvider:
    """The local node provider, except that launches of ``stalled`` capacity are accepted and never join.

    A Capacity Block whose instance EC2 accepts and that never boots into the cluster (or a
    NodeClaim that never registers): the launch answers at once with the node, :meth:`nodes`
    lists it (so a second requeue finds it and launches nothing), and no Ray node ever comes.
    Releasing it gives it back.  Every other capacity is the inner provider's.
    """

    def __init__(self, inner: NodeProvider, *, stalled: Sequence[str]) -> None:
        self._inner = inner
        self._stalled = set(stalled)
        self._hanging: dict[str, ProvidedNode] = {}

    async def available(self, capacity: Capacity) -> int | None:
        return await self._inner.available(capacity)

    async def launch(self, *, capacity: Capacity, node_labels: Sequence[Mapping[str, str]],
                     reservation_id: str | None = None, idempotency_key: str | None = None,
                     ) -> list[ProvidedNode]:
        from resilienced.ports import ProvidedNode

        if getattr(capacity, "value", capacity) not in self._stalled:
            return await self._inner.launch(capacity=capacity, node_labels=node_labels, reservation_id=reservation_id)
        nodes = [ProvidedNode(f"i-stalled-{secrets.token_hex(4)}", capacity, dict(labels)) for labels in node_labels]
        self._hanging.update((n.instance_id, n) for n in nodes)
        log.get("resilienced.drill").info("launch accepted; the node will never join",
                                          capacity=getattr(capacity, "value", capacity),
                                          nodes=[n.instance_id for n in nodes])
        return nodes

    async def nodes(self) -> list[ProvidedNode]:
        return [*await self._inner.nodes(), *self._hanging.values()]

    async def release(self, nodes: Sequence[ProvidedNode]) -> None:
        inner = [n for n in nodes if self._hanging.pop(n.instance_id, None) is None]
        if inner:
            await self._inner.release(inner)


class Drill:
    """One run of the drill; :meth:`run` returns the report."""

    def __init__(self, options: DrillOptions, *, out: TextIO = sys.stdout) -> None:
        self.o = options
        self.out = out
        self.timeline = Timeline(out)
        self.workdir = Path(options.workdir or tempfile.mkdtemp(prefix="rdrill-", dir="/tmp"))
        self.ckpt = self.workdir / "fsx" / "drill"
        self.metrics = JsonLines(self.workdir / "metrics.jsonl")
        self.events = JsonLines(self.workdir / "events.jsonl")
        self.instance_ids = made_up_ids(options.workers, seed=options.seed)
        self.decisions: list[dict[str, JsonValue]] = []
        self.durable_at: float | None = None
        self.capacity: str | None = None
        self.replacement: dict[str, JsonValue] | None = None  # what the daemon told the elastic run
        self._trainer: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None  # reads the trainer's metrics for _until
        self._nodes: dict[str, LocalRayNode] = {}
        self._cluster: Any = None
        self._spans: dict[str, list[float | None]] = {}  # worker node name -> [joined, gone]
        self.terminated = False  # stopped by SIGTERM
        self.follow_up: dict[str, JsonValue] | None = None  # the daemon's follow-up of the run, as last read
        self.ledger: Any = None  # the recovery's ledger (resilienced.local.drill_ledger), once reported
        self._ec2: tuple[Any, str, str, Any] | None = None  # --provider ec2: client, subnet, template, recorder

    # ------------------------------------------------------------------ parts
    def _trainer_args(self, *, ray_address: str, checkpoint_dir: Path, metrics: Path,
                      events: Path | None, pad: bool, workers: int | None = None,
                      steps: int | None = None) -> list[str]:
        """``python -m trainer``'s command line: the run (Ray), or a reference (``local``; its
        ``workers`` and ``steps``, for one segment of the run's world-size schedule)."""
        reference = ray_address == "local"
        args = [sys.executable, "-m", "trainer", "--ray-address", ray_address,
                "--num-workers", str(workers or self.o.workers), "--steps", str(steps or self.o.steps),
                "--seed", str(self.o.seed), "--checkpoint-dir", str(checkpoint_dir),
                "--checkpoint-every", str(self.o.checkpoint_every), "--metrics-out", str(metrics),
                # 4 sequences per worker (8 for the default 2): any --workers splits it evenly, and an
                # elastic run's smaller size too for 3 workers (12 over 2)
                "--batch-size", str(4 * self.o.workers)]
        if events is not None:
            args += ["--events-out", str(events)]
        if pad and self.o.step_seconds:
            args += ["--min-step-seconds", str(self.o.step_seconds)]
        if self.o.scenario == "elastic":
            # no dropout: a rank's RNG stream is seeded afresh when the world size changes, so with
            # dropout the fixed-size run would not be a comparison (the same-schedule one would)
            args += ["--dropout", "0"]
            if not reference:
                args += ["--min-workers", str(self.o.min_workers), "--resize-interval-s", str(RESIZE_INTERVAL_S)]
        return args

    async def _provision_aws(self, endpoint: str) -> str:
        from aiobotocore.session import get_session

        from resilienced.local.aws import create_queue_with_dlq, create_rules

        session = get_session()
        async with session.create_client("sqs", region_name=REGION, endpoint_url=endpoint) as sqs, \
                session.create_client("events", region_name=REGION, endpoint_url=endpoint) as events, \
                session.create_client("s3", region_name=REGION, endpoint_url=endpoint) as s3:
            queue_url, _dlq = await create_queue_with_dlq(sqs, name="resilienced-drill", max_receive_count=5)
            await create_rules(events, queue_url=queue_url, sqs=sqs)
            await s3.create_bucket(Bucket=BUCKET)
        return queue_url

    async def _put(self, endpoint: str, entry: dict[str, JsonValue], what: str) -> None:
        from aiobotocore.session import get_session

        async with get_session().create_client("events", region_name=REGION, endpoint_url=endpoint) as ev:
            response = await ev.put_events(Entries=[entry])
        if response.get("FailedEntryCount"):
            raise DrillError(f"EventBridge refused the {what}: {response['Entries']}")
        self.timeline.add("aws", f"EventBridge <- {what}")

    def _observe(self, message: Any, outcome: Any, verdict: Any, latency: float) -> None:
        """The daemon's decisions, as they settle (called by the consumer)."""
        event = outcome.event
        record = {"time": time.time(), "kind": event.kind.value if event else None,
                  "result": outcome.result.value, "verdict": verdict.value,
                  "reason": outcome.reason, "details": dict(outcome.details)}
        self.decisions.append(record)
        runs = [StepResults.from_json(run) for run in outcome.details.get("runs") or []]
        for run in runs:
            durable, requeue = run.durable, run.requeue
            if durable is not None and durable.verified and durable.notice_to_durable_s is not None \
                    and event is not None and event.time is not None and self.durable_at is None:
                # the daemon measured from the event's time; the notice is when it was sent
                self.durable_at = event.time.timestamp() + durable.notice_to_durable_s
            if requeue is not None and requeue.capacity is not None and requeue.changes:
                self.capacity = requeue.capacity.value
            if requeue is not None and requeue.replacement and self.replacement is None:
                self.replacement = dict(requeue.replacement)
        summary = outcome.reason or outcome.result.value
        if runs:
            parts = []
            for run in runs:
                if run.signal is not None:
                    parts.append(f"drained {len(run.signal.drained)} node(s)")
                if run.durable is not None:
                    d = run.durable
                    parts.append(f"checkpoint step {d.step} durable in S3" if d.verified
                                 else f"nothing durable after the notice ({d.reason})")
                if run.resume is not None:
                    parts.append(f"resume point step {run.resume.resume_step}")
                if run.requeue is not None:
                    r = run.requeue
                    parts.append(f"requeue -> {r.capacity.value if r.capacity is not None else None}: {r.reason}")
                if run.notify is not None:
                    parts.append(f"recorded {run.notify.reason}")
            summary = "; ".join(parts) or summary
        self.timeline.add("daemon", f"{record['kind']}: {outcome.result.value} ({summary})")

    async def _watch_trainer(self) -> None:
        """Print the trainer's lifecycle events and progress as they come."""
        last_step_shown = 0
        while True:
            for e in self.events.read_new():
                kind = e.get("event")
                if kind == "started":
                    text = (f"attempt {e.get('attempt')} started, world size {e.get('world_size')}"
                            + (f", resumed from step {e['resumed_from_step']}"
                               if e.get("resumed_from_step") is not None else ", from scratch"))
                elif kind == "preemption_notice":
                    text = f"preemption notice at step {e.get('step')} (from {e.get('source')})"
                elif kind == "checkpoint_committed":
                    text = (f"checkpoint step {e.get('step')} committed ({e.get('reason')}, "
                            f"{float(e.get('save_seconds') or 0):.2f}s)")
                elif kind == "resize_requested":
                    text = f"Ray Train grows the run: saving step {e.get('step')} before the restart"
                elif kind == "restarted":
                    decision = e.get("decision") or {}
                    text = (f"{e.get('kind')} at world size {e.get('world_size')} took {e.get('seconds')}s to its "
                            f"first step {e.get('phases')}" + (f"; {decision.get('reason')}" if decision else ""))
                elif kind == "waiting_for_teardown":
                    text = f"trained up to step {e.get('step')}; waiting to be torn down"
                elif kind == "finished":
                    text = f"finished at step {e.get('step')}"
                else:
                    text = f"{kind}: {e}"
                self.timeline.add("trainer", text, at=e.get("time"))
            for m in self.metrics.read_new():
                if m["step"] - last_step_shown >= 10 or m["step"] == self.o.interrupt_at_step:
                    self.timeline.add("trainer", f"step {m['step']} loss {m['loss']:.4f} "
                                                 f"(world size {m.get('world_size')})", at=m.get("time"))
                    last_step_shown = m["step"]
            self._note_joins()
            await asyncio.sleep(0.2)

    def _note_joins(self) -> None:
        """Worker nodes that joined since the last look (the replacement): when, for the report."""
        for node in list(self._cluster.workers if self._cluster is not None else ()):
            if node.name not in self._spans:
                self._spans[node.name] = [time.time(), None]
                self.timeline.add("ray", f"node {node.labels.get(INSTANCE_LABEL)} joined "
                                         f"({node.labels.get(CAPACITY_LABEL)})")

    async def _until(self, predicate: Callable[[], bool], *, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if self._watcher is not None and self._watcher.done():  # nobody reads the metrics now
                failure = None if self._watcher.cancelled() else self._watcher.exception()
                raise DrillError(f"the drill stopped reading the trainer's progress while waiting for "
                                 f"{what}: {type(failure).__name__ + ': ' + str(failure) if failure else 'cancelled'}")
            if self._trainer is not None and self._trainer.returncode is not None:
                raise DrillError(f"the trainer exited with {self._trainer.returncode} while waiting "
                                 f"for {what}; see {self.workdir / 'trainer.log'}")
            if time.monotonic() > end:
                raise DrillError(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ the story
    async def run(self) -> dict[str, JsonValue]:
        """The story (:meth:`_play`); SIGTERM stops it as Ctrl-C does: everything started is stopped."""
        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        assert me is not None
        loop.add_signal_handler(signal.SIGTERM, self._stop_requested, me)
        try:
            return await self._play()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    def _stop_requested(self, task: asyncio.Task[Any]) -> None:
        self.terminated = True
        task.cancel()

    async def _play(self) -> dict[str, JsonValue]:
        from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer

        for key, value in FAKE_CREDENTIALS.items():  # the drill's AWS is a local moto
            os.environ[key] = value
        os.environ.setdefault("AWS_DEFAULT_REGION", REGION)
        os.environ[WORKDIR_MARKER] = str(self.workdir)  # every process it starts inherits it
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.out.write(f"resilienced drill: scenario {self.o.scenario}, {self.o.workers} workers, "
                       f"{self.o.steps} steps, interrupt at step {self.o.interrupt_at_step}, "
                       f"spot capacity {self.o.spot_capacity}, notice {self.o.notice_seconds:g}s, "
                       f"daemon {'on' if self.o.daemon else 'off'}\n  work dir {self.workdir}\n")
        async with contextlib.AsyncExitStack() as stack:
            moto = MotoServer(log_path=self.workdir / "moto.log", env=self._moto_env())
            stack.callback(moto.stop)
            await _in_thread(moto.start)
            queue_url = await self._provision_aws(moto.endpoint_url)
            self.timeline.add("aws", f"moto on {moto.endpoint_url}: EventBridge rules -> SQS (+DLQ), S3 bucket")
            early = self._start_reference(stack)

            cluster = await self._start_ray(stack)
            await self._start_exporter(stack, moto.endpoint_url)
            stop = asyncio.Event()
            daemon_task = None
            if self.o.provider == "ec2":
                await self._start_ec2(stack, moto.endpoint_url, cluster)
            if self.o.daemon:
                daemon_task = await self._start_daemon(stack, moto.endpoint_url, queue_url, cluster, stop)
            watcher = self._watcher = asyncio.create_task(self._watch_trainer(), name="drill.watch")
            stack.push_async_callback(_cancel, watcher)
            if daemon_task is not None:
                following = asyncio.create_task(self._watch_follow_up(cluster), name="drill.follow-up")
                stack.push_async_callback(_cancel, following)
            await self._start_trainer(stack, cluster)
            await self._until(lambda: any(m["step"] >= self.o.interrupt_at_step for m in self.metrics.lines),
                              what=f"step {self.o.interrupt_at_step}", timeout=self.o.timeout)
            victim = self.instance_ids[0]
            if self.o.scenario in NOTICE_SCENARIOS:
                await self._play_spot(moto.endpoint_url, cluster, victim)
            else:
                await self._play_abrupt(moto.endpoint_url, cluster, victim)
            assert self._trainer is not None
            try:
                async with asyncio.timeout(self.o.timeout):
                    code = await self._trainer.wait()
            except asyncio.TimeoutError:
                raise DrillError(f"the run did not finish within {self.o.timeout:.0f}s after the "
                                 f"interruption; see {self.workdir / 'trainer.log'}") from None
            self.events.read_new()
            self.metrics.read_new()
            self.timeline.add("trainer", f"exited with {code}")
            follow_up = None
            if daemon_task is not None:
                await self._settle(daemon_task)
                follow_up = await self._followed(daemon_task)
                stop.set()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(30):
                        await daemon_task
            reference, fixed = await self._references(early)
            prices = await self._prices(moto.endpoint_url)
        report = report_from(options=self.o, metrics=self.metrics.lines, events=self.events.lines,
                             reference=reference, fixed_reference=fixed, notice=self.timeline.notice,
                             durable_at=self.durable_at,
                             capacity=(follow_up or {}).get("capacity") or self.capacity, trainer_exit=code,
                             node_spans=[(span[0], span[1]) for span in self._spans.values()],
                             replacement=self.replacement, follow_up=follow_up, ec2=self._ec2_report())
        report["ledger"] = self._ledger(report, follow_up, prices)
        return report

    def _price_file(self) -> Path:
        """The drill's ``--on-demand-prices`` file (On-Demand and the block's fee), for the daemon and the ledger."""
        from resilienced.local.drill_ledger import price_file

        path = self.workdir / "prices.json"
        return path if path.exists() else price_file(path, instance_type=PRICED_AS, block_id=BLOCK_ID,
                                                     instances=self.o.workers, also=(INSTANCE_TYPE,))

    async def _prices(self, endpoint: str) -> dict[str, Any]:
        """The ledger's prices: Spot from moto's DescribeSpotPriceHistory, the rest from the price file."""
        from resilienced.local.drill_ledger import drill_prices

        return await drill_prices(endpoint=endpoint, region=REGION, zone=f"{REGION}a", instance_type=PRICED_AS,
                                  block_id=BLOCK_ID, file=self._price_file(), at=utcnow())

    def _ledger(self, report: Mapping[str, JsonValue], follow_up: Mapping[str, JsonValue] | None,
                prices: Mapping[str, Any]) -> dict[str, JsonValue] | None:
        """The report's ``ledger`` (``resilienced.local.drill_ledger``); kept for ``--plot``."""
        from resilienced.local.drill_ledger import drill_ledger, report_ledger

        record = dict(follow_up or {})
        spans = [(span[0], span[1]) for span in self._spans.values()]
        if self.timeline.notice is None:
            return None
        self.ledger = drill_ledger(
            run=str(record.get("run") or "drill"), event_id=str(record.get("event_id") or "drill"),
            workers=self.o.workers, metrics=self.metrics.lines, events=self.events.lines, notice=self.timeline.notice,
            steps_trained_twice=int(report.get("steps_trained_twice") or 0), follow_up=record or None,
            prices=prices, node_spans=spans)
        return report_ledger(self.ledger, worker_seconds_idle=report.get("worker_seconds_idle"),  # type: ignore[arg-type]
                             node_spans=spans, workers=self.o.workers)

    def plot(self, path: str) -> Path | None:
        """``--plot``: the run's timeline from its ledger and world sizes (None: no ledger)."""
        from resilienced.local.drill_ledger import world_sizes
        from resilienced.ops.plot import plot

        if self.ledger is None:
            return None
        return plot([self.ledger], path, world_size=world_sizes(self.metrics.lines),
                    title=f"resilienced drill --scenario {self.o.scenario}: {self.o.workers} ranks")

    def _start_reference(self, stack: contextlib.AsyncExitStack) -> asyncio.Task[dict[int, float]] | None:
        """A gang run keeps its world size: its uninterrupted reference runs while the cluster
        and the trainer start (a task; None for an elastic run, whose sizes come at the end)."""
        if self.o.min_workers is not None:
            return None
        self.timeline.add("drill", f"running the uninterrupted reference (same seed, no Ray) meanwhile, "
                                   f"world size {self.o.workers} to step {self.o.steps}")
        early = asyncio.create_task(self._reference("reference", [(self.o.workers, self.o.steps)]),
                                    name="drill.reference")
        stack.push_async_callback(_cancel, early)
        return early

    async def _references(self, early: asyncio.Task[dict[int, float]] | None,
                          ) -> tuple[dict[int, float], dict[int, float] | None]:
        """The reference with the run's world sizes, and the fixed-size one where they changed.

        A gang run's is the one started early (``early``): its world size is ``--workers``, and a
        run that trained other sizes or not every step does not match it (``loss_facts``).
        """
        if early is not None:
            return await early, None
        planned = [(self.o.workers, self.o.steps)]
        schedule = world_size_schedule(self.metrics.lines) or planned
        self.timeline.add("drill", "running the uninterrupted reference (same seed, no Ray), world "
                                   "sizes " + ", ".join(f"{ws} to step {stop}" for ws, stop in schedule))
        reference = await self._reference("reference", schedule)
        if schedule == planned:
            return reference, None
        self.timeline.add("drill", f"and the fixed-size one ({self.o.workers} ranks) to compare with")
        return reference, await self._reference("fixed", planned)

    async def _start_ray(self, stack: contextlib.AsyncExitStack) -> Any:
        from resilienced.local.raycluster import LocalRayCluster

        cluster = LocalRayCluster(workdir=self.workdir, env={
            "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": str(self.o.preemption_poll)})
        stack.callback(cluster.stop)
        await _in_thread(cluster.start)
        self._cluster = cluster
        elastic = {ELASTIC_LABEL: "true"} if self.o.scenario == "elastic" else {}
        for instance_id in self.instance_ids:
            node = await _in_thread(cluster.add_node, labels={
                INSTANCE_LABEL: instance_id, CAPACITY_LABEL: "spot", **elastic}, num_cpus=1)
            self._nodes[instance_id] = node
            self._spans[node.name] = [time.time(), None]
        self.timeline.add("ray", f"cluster at {cluster.address}: head + {self.o.workers} spot node(s) "
                                 f"{', '.join(self.instance_ids)}")
        return cluster

    async def _start_exporter(self, stack: contextlib.AsyncExitStack, endpoint: str) -> Any:
        from resilienced.local.fsx import LocalExporter

        self.ckpt.mkdir(parents=True, exist_ok=True)
        exporter = LocalExporter(root=self.ckpt, bucket=BUCKET, prefix=PREFIX, endpoint_url=endpoint,
                                 region=REGION, poll_interval=0.2, shuffle=True, seed=self.o.seed)
        await exporter.start()
        stack.push_async_callback(exporter.stop)
        self.timeline.add("fsx", f"{self.ckpt} auto-exports to s3://{BUCKET}/{PREFIX}")
        return exporter

    def _provider(self, cluster: Any) -> Any:
        """The daemon's node provider: the local cluster's nodes, booting ``--node-boot-seconds``
        (stalled: the Capacity Block accepts the launch and its node never joins)."""
        from resilienced.local.provider import LocalNodeProvider

        stalled = self.o.scenario == "stalled"
        provider: Any = LocalNodeProvider(cluster, capacity={
            "spot": self.o.spot_capacity, "capacity-block": self.o.workers,
            "on-demand": self.o.workers if stalled else 0})
        if self.o.node_boot_seconds:
            provider = BootingProvider(provider, boot_seconds=self.o.node_boot_seconds)
        if stalled:
            provider = StallingProvider(provider, stalled=("capacity-block",))
        return provider

    def _moto_env(self) -> dict[str, str]:
        """--provider ec2: moto's EC2 has the capacity the local provider would have."""
        from resilienced.local.motoserver import EC2_CAPACITY_ENV

        if self.o.provider != "ec2":
            return {}
        stalled = self.o.scenario == "stalled"
        return {EC2_CAPACITY_ENV: json.dumps({"spot": self.o.spot_capacity, "capacity-block": self.o.workers,
                                              "on-demand": self.o.workers if stalled else 0})}

    async def _start_ec2(self, stack: contextlib.AsyncExitStack, endpoint: str, cluster: Any) -> None:
        """--provider ec2: the client the daemon's Ec2NodeProvider launches with (its calls recorded),
        a subnet in the block's zone, the launch template, and the user-data hook."""
        from aiobotocore.session import get_session

        from resilienced.local.ec2 import Ec2Recorder, UserDataHook, provision

        client = await stack.enter_async_context(
            get_session().create_client("ec2", region_name=REGION, endpoint_url=endpoint))
        recorder = Ec2Recorder()
        recorder.install(client)
        subnet, template = await provision(client, zone=ZONE)
        hook = UserDataHook(client, cluster, boot_seconds=self.o.node_boot_seconds,
                            never_join=("capacity-block",) if self.o.scenario == "stalled" else (),
                            note=lambda text: self.timeline.add("ec2", text))
        task = asyncio.create_task(hook.run(), name="drill.user-data")
        stack.push_async_callback(_cancel, task)
        self._ec2 = (client, subnet, template, recorder)
        self.timeline.add("ec2", f"moto EC2: launch template {template}, subnet {subnet} in {ZONE}; "
                                 f"capacity {self._moto_env()}")

    def _ec2_report(self) -> dict[str, JsonValue] | None:
        if self._ec2 is None:
            return None
        recorder = self._ec2[3]
        return {"ec2_launches": list(recorder.launches), "ec2_terminations": list(recorder.terminations)}

    def _daemon_settings(self, endpoint: str, queue_url: str, cluster: Any) -> Settings:
        """The daemon's settings in the drill: ray mode on the local cluster with its token, the moto
        queue, short polls, and follow-up bounds scaled to the drill's notice and node boot."""
        token_file = self.workdir / "ray-token"
        token_file.write_text(cluster.auth_token)
        token_file.chmod(0o600)
        return Settings(
            queue=QueueSettings(queue_url=queue_url, region=REGION, endpoint_url=endpoint,
                                wait_seconds=1, visibility_timeout=30, shutdown_timeout=10),
            intake=IntakeSettings(notice_seconds=self.o.notice_seconds),
            http=HttpSettings(http_host="127.0.0.1", http_port=0),
            mode=ModeSettings(mode=Mode.RAY, ray_address=cluster.address, ray_token_file=str(token_file),
                              checkpoint_uri=f"s3://{BUCKET}/{PREFIX}", instance_type=INSTANCE_TYPE),
            recovery=RecoverySettings(durable_poll_seconds=0.5, durable_grace_seconds=30, node_join_seconds=(
                (f"capacity-block={self.o.join_estimate}", f"on-demand={self.o.join_estimate}",
                 f"spot={self.o.join_estimate}") if self.o.join_estimate else ())),
            notify=NotifySettings(notify_webhook=self.o.notify_webhook),
            follow_up=FollowUpSettings(
                scheduled_bound_seconds=JOINED_BOUND_S + self.o.node_boot_seconds,
                training_bound_seconds=self.o.notice_seconds + TRAINING_BOUND_EXTRA_S,
                follow_up_interval_seconds=1.0, follow_up_claim_ttl_seconds=60),
            ledger=LedgerSettings(on_demand_prices=str(self._price_file())),
        ).validate()

    def _stand_ins(self, cluster: Any) -> StandIns:
        """The drill's EC2, one active Capacity Block of ``workers`` instances, and its node provider
        (:meth:`_provider`)."""
        from resilienced.app.runtime import StandIns
        from resilienced.local.capacity import StaticCapacity
        from resilienced.ports import CapacityReservation

        now = utcnow()
        block = CapacityReservation(
            reservation_id=BLOCK_ID, instance_type=INSTANCE_TYPE, availability_zone=ZONE,
            reservation_type="capacity-block", state="active", available_instances=self.o.workers,
            total_instances=self.o.workers, start=now - timedelta(hours=1), end=now + timedelta(days=1))
        capacity = StaticCapacity([block])
        if self._ec2 is None:
            return StandIns(capacity=capacity, node_provider=self._provider(cluster))
        from resilienced.aws.ec2nodes import Ec2NodeProvider
        from resilienced.local.ec2 import OWNER

        client, subnet, template, _ = self._ec2
        return StandIns(capacity=capacity, node_provider=Ec2NodeProvider(
            client, launch_template=template, gcs_address=cluster.address, owner=OWNER,
            subnets={ZONE: subnet}, reservations=capacity))

    async def _start_daemon(self, stack: contextlib.AsyncExitStack, endpoint: str, queue_url: str,
                            cluster: Any, stop: asyncio.Event) -> asyncio.Task[int]:
        from resilienced.app import daemon

        settings = self._daemon_settings(endpoint, queue_url, cluster)
        stand_ins = self._stand_ins(cluster)
        stalled = self.o.scenario == "stalled"
        daemon_log = open(self.workdir / "daemon.log", "a")
        stack.callback(daemon_log.close)
        # unwound first: nothing logs into the closed file after the drill (structlog raises there)
        stack.callback(log.configure, level="info", stream=sys.stderr)
        log.configure(level="info", stream=daemon_log)
        ready = asyncio.Event()
        task = asyncio.create_task(daemon.run(
            settings, ready=ready, observer=self._observe, stop=stop, stand_ins=stand_ins), name="drill.daemon")

        async def shut() -> None:
            stop.set()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(30):
                    await task
            await _cancel(task)
        stack.push_async_callback(shut)
        waiter = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({waiter, task}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            if task.done():
                raise DrillError(f"the daemon did not start: {task.exception() or task.result()}")
            raise DrillError("the daemon did not start within 60s")
        self.timeline.add("daemon", f"running in ray mode on {queue_url.rsplit('/', 1)[-1]}; "
                                    + ("EC2 (moto) " if self._ec2 is not None else "")
                                    + f"provider: spot {self.o.spot_capacity}, capacity-block "
                                    f"{BLOCK_ID} {self.o.workers}"
                                    + (" (its nodes never join), on-demand " + str(self.o.workers)
                                       if stalled else "")
                                    + (f"; notifications to {urlsplit(self.o.notify_webhook).hostname}"
                                       if self.o.notify_webhook else ""))
        return task

    async def _start_trainer(self, stack: contextlib.AsyncExitStack, cluster: Any) -> None:
        env = dict(os.environ)
        env.update(cluster.env)
        env["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(self.o.preemption_poll)
        env["PYTHONUNBUFFERED"] = "1"
        if self.o.node_boot_seconds or self.o.scenario == "stalled":
            # a fixed-size run waits for the replacement to place its workers (stalled: the fallback's)
            env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(
                max(60.0, self.o.notice_seconds + self.o.node_boot_seconds + JOINED_BOUND_S + 60))
        log_file = open(self.workdir / "trainer.log", "ab")
        stack.callback(log_file.close)
        self._trainer = await asyncio.create_subprocess_exec(
            *self._trainer_args(ray_address=cluster.address, checkpoint_dir=self.ckpt,
                                metrics=self.metrics.path, events=self.events.path, pad=True),
            stdout=log_file, stderr=log_file, env=env, start_new_session=True)
        stack.push_async_callback(_stop_process, self._trainer)
        self.timeline.add("trainer", f"python -m trainer: {self.o.workers} ranks, FSDP2 on gloo "
                                     f"(pid {self._trainer.pid})")

    async def _play_spot(self, endpoint: str, cluster: Any, victim: str) -> None:
        now = utcnow()
        await self._put(endpoint, rebalance(victim, now), f"rebalance recommendation for {victim}")
        self.timeline.notice = time.time()
        deadline = self.timeline.notice + self.o.notice_seconds
        await self._put(endpoint, spot_notice(victim, utcnow()),
                        f"Spot interruption notice for {victim} (deadline in {self.o.notice_seconds:g}s)")
        await asyncio.sleep(max(0.0, deadline - time.time()))  # EC2 acts at the deadline
        await self._terminate(endpoint, cluster, victim)

    async def _play_abrupt(self, endpoint: str, cluster: Any, victim: str) -> None:
        self.timeline.notice = time.time()
        await self._terminate(endpoint, cluster, victim)

    async def _terminate(self, endpoint: str, cluster: Any, victim: str) -> None:
        # at a Spot deadline EC2 terminates the instance with a graceful OS shutdown; an abrupt
        # loss is a power cut (Ray sees it only when its health checks fail, ~17 s here)
        end = cluster.terminate_node if self.o.scenario in NOTICE_SCENARIOS else cluster.kill_node
        await _in_thread(end, self._nodes[victim])
        self._spans[self._nodes[victim].name][1] = time.time()
        self.timeline.add("aws", f"instance {victim} terminated (its Ray node is gone)")
        await self._put(endpoint, state_change(victim, "terminated", utcnow()),
                        f"state change: {victim} terminated")
        if not self.o.daemon:  # nobody requeues: play the autoscaler that replaces the node
            replacement = made_up_ids(self.o.workers + 1, seed=self.o.seed)[-1]
            await asyncio.sleep(self.o.node_boot_seconds)
            await _in_thread(cluster.add_node, labels={
                INSTANCE_LABEL: replacement, CAPACITY_LABEL: "on-demand"}, num_cpus=1)
            self.capacity = "on-demand"
            self.timeline.add("drill", f"(daemon off) an autoscaler replaced it with {replacement}")

    async def _settle(self, daemon_task: asyncio.Task[int]) -> None:
        """Let the daemon settle the last event (the state change) before it is stopped."""
        end = time.monotonic() + 30
        while time.monotonic() < end and not daemon_task.done():
            if any(d["kind"] == "state_change" for d in self.decisions):
                return
            await asyncio.sleep(0.2)

    async def _watch_follow_up(self, cluster: Any) -> None:
        """Print the daemon's follow-up of the run as it goes (read from the GCS KV, as
        ``resilienced status`` reads it): opened, each stage reached, each fallback, the end."""
        from resilienced.ray.followup_store import RayKvFollowUps
        from resilienced.ray.gcs import RayGcs

        store = RayKvFollowUps(kv=RayGcs(cluster.address, token=cluster.auth_token))
        shown: tuple[Any, ...] = ()
        while True:
            try:
                found = await store.all()
            except ResilienceError:  # the GCS is busy: look again
                found = []
            record = max((r for r, _ in found), key=lambda r: r.get("opened_at") or "", default={})
            now = (record.get("event_id"), record.get("state"), record.get("stage"), len(record.get("fallbacks") or []))
            if record and now != shown:
                if shown[:1] == now[:1] and now[3] > shown[3]:
                    last = record["fallbacks"][-1]
                    self.timeline.add("daemon", f"follow-up: {last.get('reason')}; moved {last.get('from')} -> {last.get('to')}")
                shown = now
                self.timeline.add("daemon", f"follow-up of event {str(now[0])[:8]}: {now[1]}, stage {now[2]} on "
                                            f"{record.get('capacity')}")
            self.follow_up = record
            await asyncio.sleep(0.5)

    async def _followed(self, daemon_task: asyncio.Task[int]) -> dict[str, JsonValue]:
        """The daemon's follow-up of the run once it ended (resumed or stuck); ``{}`` when it kept
        none.  Waits (bounded) for the follower to see the run train again."""
        end = time.monotonic() + 60
        while time.monotonic() < end and not daemon_task.done():
            if (self.follow_up or {}).get("state") in ("resumed", "stuck"):
                break
            await asyncio.sleep(0.5)
        return dict(self.follow_up or {})

    async def _reference(self, name: str, schedule: Sequence[tuple[int, int]]) -> dict[int, float]:
        """The uninterrupted run's losses (no Ray), ``schedule``'s world sizes one after the other.

        Each segment is a local run to its last step at its world size, resuming the previous
        one's final checkpoint (DCP reshards it, as in the run): the same arithmetic as the run
        whose world size changed at those steps, so the losses are equal bit for bit.
        """
        path = self.workdir / f"{name}.jsonl"
        ckpt = self.workdir / f"{name}-ckpt"
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        for workers, stop in schedule:
            with open(self.workdir / f"{name}.log", "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *self._trainer_args(ray_address="local", checkpoint_dir=ckpt, metrics=path,
                                        events=None, pad=False, workers=workers, steps=stop),
                    stdout=log_file, stderr=log_file, env=env, start_new_session=True)
                try:
                    async with asyncio.timeout(self.o.timeout):
                        code = await proc.wait()
                finally:
                    await _stop_process(proc)
            if code != 0:
                raise DrillError(f"the {name} run ({workers} ranks to step {stop}) exited with {code}; "
                                 f"see {self.workdir / f'{name}.log'}")
        return {int(line["step"]): float(line["loss"]) for line in JsonLines(path).read_new()}

    def logs_tail(self, lines: int = FAILURE_TAIL_LINES) -> str:
        """The last ``lines`` lines of the trainer's and the daemon's logs (those written so far),
        for a failure's message: without ``--keep`` the work dir and the logs go with it."""
        parts = []
        for name in ("trainer.log", "daemon.log"):
            try:
                tail = (self.workdir / name).read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail:
                parts.append(f"--- the last {len(tail)} lines of {name}:\n" + "\n".join(tail))
        return "\n".join(parts)

    def cleanup(self) -> None:
        if self.o.keep:
            self.out.write(f"artifacts kept in {self.workdir} (trainer.log, daemon.log, metrics.jsonl, "
                           f"events.jsonl, reference.jsonl, fsx/, ray logs)\n")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def _in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn`` in a thread; a cancel (Ctrl-C) lets it finish first, then goes on.

    A start cut off half-way (``ray start`` of a node, moto) would leave behind what it started
    and the teardown does not know of yet; waiting for it makes the teardown stop it too.
    """
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():  # a second Ctrl-C does not cut it off either
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({future})
        raise


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def _stop_process(proc: asyncio.subprocess.Process) -> None:
    """Stop a child started in its own session: SIGTERM to its group, then SIGKILL.

    The group is signalled by its id only while the child is not reaped (its pid, the group's
    id, cannot be another's yet). What is left of the group after that is found by the drill's
    marker: a reaped child's id may already be another session's on a busy machine (pid_max
    32768), and a SIGKILL to it would end someone else's processes.
    """
    from resilienced.local.raycluster import group_members_with

    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except asyncio.TimeoutError:
            pass
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    marker = f"{WORKDIR_MARKER}={os.environ.get(WORKDIR_MARKER, '')}"
    for pid in group_members_with(proc.pid, marker):  # whatever of its group is left
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- the command
def configure(parser: argparse.ArgumentParser) -> None:
    d = DrillOptions()
    parser.add_argument("--workers", type=int, default=None,
                        help=f"ranks, one per Ray worker node (default {d.workers}; elastic: "
                             f"{ELASTIC_DEFAULTS['workers']}, min one less)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps of the run (default {d.steps}; elastic: {ELASTIC_DEFAULTS['steps']})")
    parser.add_argument("--interrupt-at-step", type=int, default=d.interrupt_at_step,
                        help="the interruption comes once the run has trained this step")
    parser.add_argument("--spot-capacity", type=int, default=d.spot_capacity,
                        help="replacement Spot nodes the local provider has (0: none, so the run "
                             "goes to the Capacity Block)")
    parser.add_argument("--provider", choices=PROVIDERS, default=d.provider,
                        help="local: replacement Ray nodes started on this machine; ec2: the daemon's "
                             "EC2 node provider launches instances through EC2's API on moto (over "
                             "HTTP), each joined by a hook playing deploy/aws/ray-node-user-data.sh; "
                             "the report lists ec2_launches")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--scenario", choices=SCENARIOS, default=d.scenario,
                        help="spot: rebalance, notice, termination at the deadline; abrupt: the "
                             "instance is gone with no notice (a state change only); elastic: the "
                             "spot story for an elastic run (python -m trainer --min-workers): the "
                             "survivors go on, the replacement joins, the run grows back; stalled: the "
                             "spot story where the Capacity Block's node never joins and the daemon "
                             "falls back to On-Demand")
    parser.add_argument("--join-estimate-seconds", type=float, default=None,
                        help="what the daemon is told a replacement takes to join (its --node-join-seconds; "
                             "default: --node-boot-seconds): another value plays a wrong estimate")
    parser.add_argument("--node-boot-seconds", type=float, default=None,
                        help="a replacement node joins this long after it is asked for (AWS: minutes; "
                             f"default {d.node_boot_seconds:g}, elastic: {ELASTIC_DEFAULTS['node_boot_seconds']:g})")
    parser.add_argument("--notice-seconds", type=float, default=d.notice_seconds,
                        help="time from the notice to the termination (EC2: 120)")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="periodic checkpoints every K steps")
    parser.add_argument("--preemption-poll", type=float, default=d.preemption_poll,
                        help="RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (Ray's default: 5)")
    parser.add_argument("--step-seconds", type=float, default=d.step_seconds,
                        help="pad each training step to at least this long, so the story is "
                             "visible (the model itself trains a step in milliseconds)")
    parser.add_argument("--daemon", choices=("on", "off"), default="on",
                        help="off: no daemon (periodic checkpoints only), as a baseline")
    parser.add_argument("--timeout", type=float, default=d.timeout,
                        help="seconds each wait of the drill may take before it fails")
    parser.add_argument("--keep", action="store_true", help="keep the work directory and say where")
    parser.add_argument("--json-report", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the run's timeline (world size, capacity, the "
                                                     "notice, the stages, the lost parts) to FILE.png (matplotlib)")
    parser.add_argument("--workdir", metavar="DIR", help="work directory (default: a new one under /tmp)")
    parser.add_argument("--notify-webhook", metavar="URL",
                        default=os.environ.get("RESILIENCED_NOTIFY_WEBHOOK") or None,
                        help="also POST the run's notification to this webhook, as the daemon "
                             "does (env RESILIENCED_NOTIFY_WEBHOOK)")


def _scenario_default(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name)
    if value is not None:
        return value
    return ELASTIC_DEFAULTS[name] if args.scenario == "elastic" else getattr(DrillOptions(), name)


def main(args: argparse.Namespace) -> int:
    options = DrillOptions(
        workers=_scenario_default(args, "workers"), steps=_scenario_default(args, "steps"),
        node_boot_seconds=_scenario_default(args, "node_boot_seconds"),
        join_estimate_seconds=args.join_estimate_seconds,
        interrupt_at_step=args.interrupt_at_step,
        spot_capacity=args.spot_capacity, seed=args.seed, scenario=args.scenario, keep=args.keep,
        json_report=args.json_report, plot=args.plot, notice_seconds=args.notice_seconds,
        checkpoint_every=args.checkpoint_every, preemption_poll=args.preemption_poll,
        daemon=args.daemon == "on", step_seconds=args.step_seconds, timeout=args.timeout,
        workdir=args.workdir, notify_webhook=args.notify_webhook, provider=args.provider,
    ).validate()
    drill = Drill(options)
    try:
        report = asyncio.run(drill.run())
    except (DrillError, ResilienceError, OSError, ValueError, RuntimeError) as e:
        message = f"{type(e).__name__}: {e}" if not isinstance(e, DrillError) else str(e)
        print(f"resilienced drill: failed: {message}"
              + ("" if options.keep else " (run again with --keep to keep the logs)"), file=sys.stderr)
        tail = drill.logs_tail()
        if tail:
            print(tail, file=sys.stderr)
        drill.cleanup()
        if options.json_report:
            Path(options.json_report).write_text(json.dumps(
                {"ok": False, "scenario": options.scenario, "error": message}, indent=2) + "\n")
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError) as e:
        drill.cleanup()
        stopped_by = "SIGTERM" if drill.terminated else "Ctrl-C"
        print(f"resilienced drill: stopped by {stopped_by}; everything it started is stopped", file=sys.stderr)
        if drill.terminated:
            return EXIT_TERMINATED
        raise KeyboardInterrupt from e  # the CLI's exit code for Ctrl-C: 130
    except BaseException:
        drill.cleanup()
        raise
    if options.plot:
        drawn = drill.plot(options.plot)
        print(f"resilienced drill: {'wrote ' + str(drawn) if drawn else 'no ledger to plot'}", file=sys.stderr)
    drill.cleanup()
    sys.stdout.write("\n" + table(report))
    if options.json_report:
        Path(options.json_report).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1
