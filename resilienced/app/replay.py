"""``resilienced replay``: read message bodies from files and say what the daemon would decide.

Each PATH is a file holding one SQS message body, or a directory: its files are taken
recursively in name order (hidden files skipped).  Every file gives one row, built by
:func:`row` (the only place a row is made).  Bodies go through exactly the daemon's path
(``intake.read``), so the two cannot disagree.

Each event is judged (stale, from the future: ``intake.judge``) as of its own time, so a
recorded notice replays as it was decided; ``--at now|ISO-TIME`` judges them all as the daemon
would at that moment, and each row's ``stale`` says which would be ``past`` or ``future``.

``--dry-run``: nothing outside the process is touched.  Without it, actionable plans are also
handed to the responder -- today :class:`~resilienced.recovery.plan_only.PlanLogger`, which only logs them
(stderr).  Exit status: 0 when every input was read (invalid events included), 2 on a usage
error or an unreadable path, 1 when a cluster given does not answer at start-up, and with
``--strict`` (for CI) :data:`EXIT_STRICT` (3) when an input is invalid (or not an event) or a
directory holds no file.  A directory with no file is warned about on stderr either way.

Targets (``--kubeconfig`` or ``--ray-address``, only with ``--dry-run``): each actionable row
also gets ``targets``, the runs on its instances, and ``unresolved``, why the other instances
have none, found through the daemon's own resolve -> locate -> group
(:func:`resilienced.recovery.targets.find_targets`, as ``Recovery``, asked to record failures
instead of raising).  :func:`open_lookup` opens the cluster through the daemon's own composition
root, read-only (:func:`resilienced.app.runtime.open_cluster`: ``KubeCluster`` on watch caches, or
``RayModeCluster`` on one GCS, built by the functions ``open_runtime`` builds them with), and
``Ec2Capacity`` for the capacity decision, on a client from the same
:func:`resilienced.aws.clients.open_client`; never the acting
ones: no claims, no S3, no requeuer, no Auto Scaling.  The Ray and EC2 adapters are wrapped in
:class:`~resilienced.doubles.ReadOnlyRay` and :class:`~resilienced.doubles.ReadOnlyCapacity`, whose ``drain`` and ``purchase`` refuse, and
the capacity decision is :meth:`CapacityPlanner.target_plan` (a dry run: counts nothing, buys
nothing).  So the Kubernetes API sees only get/list/watch, the GCS only node listings, EC2 only
Describe* calls.

What is missing is said, not fatal: a RayCluster whose GCS does not answer gives its targets with
``ray_node_ids`` empty and ``gcs_error``; EC2 not configured (no region) or not answering gives a
decision made with no Capacity Blocks known, and the reason says so.  Each row's decision is made
on its own: replay does not carry one file's interruption into the pool history of the next.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from resilienced import log
from resilienced.intake import pipeline as intake
from resilienced.capacity.policy import CapacityPolicy
from resilienced.clock import parse_time, utcnow
from resilienced.doubles import ReadOnlyCapacity
from resilienced.errors import ConfigError, ResilienceError
from resilienced.intake.pipeline import Reading
from resilienced.model import JsonValue, Plan, Step, Target
from resilienced.ports import Cluster, Responder
from resilienced.recovery.plan_only import PlanLogger
from resilienced.recovery.targets import find_targets
from resilienced.settings import IntakeSettings, Mode, ModeSettings, QueueSettings
from resilienced.intake.validate import isoformat

if TYPE_CHECKING:  # imported where it is built (its dependencies load on use)
    from aiobotocore.client import AioBaseClient

    from resilienced.capacity.planner import CapacityPlanner

#: The ModeSettings flags replay takes: where the runs are (the mode follows from which is given).
MODE_FLAGS = ("kubeconfig", "kube_context", "ray_address", "ray_token_file", "instance_label",
              "checkpoint_uri", "instance_type")
#: The QueueSettings flags replay takes: the AWS region and endpoint, for EC2 (as the daemon).
AWS_FLAGS = ("region", "endpoint_url")
#: ``--strict``: the exit status when an input is invalid or a directory holds no file.
EXIT_STRICT = 3
#: The contract fields of a target (``Target.as_json``); capacity fields follow them.
TARGET_FIELDS = ("instance_id", "node", "ray_cluster", "ray_job", "ray_node_ids", "checkpoint_uri")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a file holding one SQS message body, or a directory of such files")
    parser.add_argument("--dry-run", action="store_true",
                        help="touch nothing outside this process (no responder is called; with "
                             "--kubeconfig or --ray-address, the cluster and EC2 are only read)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per input file on stdout, instead of a table")
    parser.add_argument("--strict", action="store_true",
                        help=f"exit {EXIT_STRICT} when an input is invalid or a directory holds "
                             "no file (for CI)")
    parser.add_argument("--at", metavar="now|ISO-TIME", type=parse_at, default=None,
                        help="judge every event as the daemon would at this time (`now`, or an "
                             "ISO-8601 time with a zone): a notice too old or from the future is "
                             "then not actionable, with `stale` past|future. Default: each event "
                             "as of its own time (a recorded notice replays as it was decided)")
    IntakeSettings.add_arguments(parser)
    ModeSettings.add_arguments(parser, only=MODE_FLAGS)
    QueueSettings.add_arguments(parser, only=AWS_FLAGS)
    CapacityPolicy.add_arguments(parser)


@dataclass(frozen=True)
class LookupSettings:
    """Where replay looks for targets: the cluster (mode), EC2 (region) and the capacity policy."""

    mode: ModeSettings
    aws: QueueSettings
    capacity: CapacityPolicy

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> LookupSettings | None:
        """The settings, validated; None when neither --kubeconfig nor --ray-address is given.

        Only those flags turn the lookup on (a daemon's RESILIENCED_KUBECONFIG or
        RESILIENCED_RAY_ADDRESS in the environment does not change what plain ``replay`` does);
        the other settings take their environment defaults as for ``run``.
        """
        kubeconfig, ray_address = getattr(args, "kubeconfig", None), getattr(args, "ray_address", None)
        if kubeconfig and ray_address:
            raise ConfigError("--ray-address", "give --kubeconfig (kubernetes mode) or --ray-address "
                                               "(ray mode), not both")
        if not kubeconfig and not ray_address:
            return None
        mode = ModeSettings.from_args(args, environ)
        if kubeconfig:
            mode = dataclasses.replace(mode, mode=Mode.KUBERNETES, ray_address=None)
        else:
            mode = dataclasses.replace(mode, mode=Mode.RAY, kubeconfig=None)
        mode.validate()
        aws = QueueSettings.from_args(args, environ)
        aws.validate(require_queue=False)
        return cls(mode=mode, aws=aws, capacity=CapacityPolicy.from_args(args, environ))


def parse_at(text: str) -> datetime:
    """``--at``: ``now`` (the current time) or an ISO-8601 time with a zone."""
    if text.strip().lower() == "now":
        return utcnow()
    try:
        moment = parse_time(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not `now` or an ISO-8601 time "
                                         "(2024-01-01T00:10:00Z)") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone (end it with Z or +00:00)")
    return moment.astimezone(timezone.utc)


def main(args: argparse.Namespace) -> int:
    settings = IntakeSettings.from_args(args, os.environ)
    settings.validate()
    lookup = LookupSettings.from_args(args, os.environ)
    if lookup is not None and not args.dry_run:
        raise ConfigError("--dry-run", "replay acts only with --dry-run when a cluster is given; "
                                       "use `resilienced run` to act")
    files = collect(args.paths)
    empty = empty_directories(args.paths)
    for path in empty:
        print(f"resilienced replay: warning: {path}: the directory holds no file", file=sys.stderr)
    log.configure(level="warning" if args.dry_run else "info", stream=sys.stderr)
    responder = None if args.dry_run else PlanLogger()
    rows = asyncio.run(replay(files, settings=settings, responder=responder, lookup=lookup,
                              at=args.at))
    write(rows, as_json=args.json, stream=sys.stdout,
          columns=COLUMNS if lookup is None else TARGET_COLUMNS)
    invalid = [r["source_file"] for r in rows if r["kind"] == "invalid"]
    if args.strict and (invalid or empty):
        print(f"resilienced replay: --strict: {len(invalid)} invalid input(s)"
              + (f" ({', '.join(invalid)})" if invalid else "")
              + f", {len(empty)} directory(ies) without a file", file=sys.stderr)
        return EXIT_STRICT
    return 0


def empty_directories(paths: Sequence[str]) -> list[str]:
    """The given directories that hold no file replay would read (hidden files do not count)."""
    return [text for text in paths if Path(text).is_dir() and not collect([text])]


def collect(paths: Sequence[str]) -> list[tuple[str, bytes]]:
    """(name, body) for every input file, in order; ConfigError for an unreadable path."""
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            try:
                entries = sorted(p for p in path.rglob("*")
                                 if p.is_file() and not any(part.startswith(".")
                                                            for part in p.relative_to(path).parts))
            except OSError as e:
                raise ConfigError(text, f"cannot list the directory: {e.strerror or e}") from None
            found.extend(entries)
        elif path.exists():
            found.append(path)
        else:
            raise ConfigError(text, "no such file or directory")
    bodies = []
    for path in found:
        try:
            bodies.append((str(path), path.read_bytes()))
        except OSError as e:
            raise ConfigError(str(path), f"cannot read: {e.strerror or e}") from None
    return bodies


async def replay(files: Sequence[tuple[str, bytes]], *, settings: IntakeSettings,
                 responder: Responder | None, lookup: LookupSettings | None = None,
                 at: datetime | None = None) -> list[dict[str, JsonValue]]:
    """One row per file; with ``lookup``, actionable rows get their targets (read only).

    Each event is judged (stale, from the future) at ``at``, or as of its own time when None.
    """
    if lookup is not None and responder is not None:
        raise ValueError("replay looks up targets only in a dry run (no responder)")
    rows = []
    async with AsyncExitStack() as stack:
        finder = await stack.enter_async_context(open_lookup(lookup)) if lookup is not None else None
        for name, body in files:
            reading = intake.judge(intake.read(body, settings), settings, at=at)
            if responder is not None and reading.plan.actionable:
                # Where acting happens: the same responder the daemon uses.
                await responder.act(reading.plan, holder=f"replay/{name}")
            found = await finder.find(reading.plan) if finder is not None and reading.plan.actionable else None
            rows.append(row(name, reading, found=found))
    return rows


@dataclass(frozen=True)
class Found:
    """What the lookup found for one plan: target entries, and why other instances have none."""

    targets: list[dict[str, JsonValue]]
    unresolved: dict[str, str] = field(default_factory=dict)


def row(source_file: str, reading: Reading, *, found: Found | None = None) -> dict[str, JsonValue]:
    """The replay record of one input (the CLI contract; add new fields here).

    ``found`` (a dry run with a cluster, actionable plans only) adds ``targets`` and
    ``unresolved``; without it the row has neither key.  When ``found`` has no target at all
    (no instance of the event resolves to a run), the row is ``actionable: false`` with no
    steps, and its ``reason`` says why each instance has none.
    """
    plan, event = reading.plan, reading.event
    record = {
        "source_file": source_file,
        "event_id": event.event_id,
        "kind": event.kind.value,
        "instance_ids": list(plan.instance_ids or event.instance_ids),
        "capacity_reservation_id": plan.capacity_reservation_id or event.capacity_reservation_id,
        "actionable": plan.actionable,
        "deadline": isoformat(plan.deadline),
        "reason": plan.reason,
        "steps": [step.value for step in plan.steps],
        "source": event.source,
        "detail_type": event.detail_type,
        "wrapping": event.wrapping.value if reading.decoded else None,
        "time": isoformat(event.time),
        "stale": reading.stale,
    }
    if found is not None:
        record["targets"] = found.targets
        record["unresolved"] = found.unresolved
        if plan.actionable and not found.targets:
            # Nothing of the event runs a run here: the daemon would find nothing to act on.
            why = "; ".join(f"{key}: {reason}" for key, reason in found.unresolved.items())
            record["actionable"] = False
            record["steps"] = []
            record["reason"] = ("nothing to act on: no instance of the event resolves to a run"
                                + (f" ({why})" if why else ""))
    return record


# --------------------------------------------------------------------------- the lookup
class Finder:
    """Targets of one plan, with each run's dry-run capacity decision (see :meth:`find`)."""

    def __init__(self, *, cluster: Cluster, planner: CapacityPlanner, capacity: ReadOnlyCapacity,
                 gcs_errors: Mapping[str, str]) -> None:
        self.cluster = cluster
        self.planner = planner
        self.capacity = capacity
        self.gcs_errors = gcs_errors

    async def find(self, plan: Plan) -> Found:
        """Resolve the plan's instances (a Capacity Block's through EC2), locate, decide per run.

        Resolve -> locate -> group is the daemon's own path (:func:`find_targets`, as ``Recovery``).

        Never raises for an outside system that fails: what could not be found is in
        ``unresolved`` (instance id, or the reservation id, -> why).
        """
        found = await find_targets(plan, cluster=self.cluster, capacity=self.capacity,
                                   record_failures=True)
        decisions = {run.run_key: await self._decide(plan, run) for run in found.runs}
        targets = []
        for target in found.located:
            entry = target.as_json()
            entry.update(decisions[target.run_key])
            gcs_error = self.gcs_errors.get(target.ray_address or "") or target.attributes.get("gcs_error")
            if gcs_error:
                entry["gcs_error"] = f"the GCS did not answer ({gcs_error}): the Ray node ids are unknown"
            targets.append(entry)
        return Found(targets=targets, unresolved=found.unresolved)

    async def _decide(self, plan: Plan, run: Target) -> dict[str, JsonValue]:
        """``capacity`` (or None) and ``reason`` for one run (a gang), plus the decision's extras."""
        if Step.REQUEUE not in plan.steps:
            steps = ", ".join(s.value for s in plan.steps)
            return {"capacity": None, "reason": f"no capacity decision: the plan does not requeue "
                                                f"(steps: {steps})"}
        seen = len(self.capacity.notes)
        try:
            planned = await self.planner.target_plan(run, event=plan.event)
        except (ValueError, ResilienceError) as e:
            return {"capacity": None, "reason": f"no capacity decision: {e}"}
        decision = {k: v for k, v in planned.items() if k not in TARGET_FIELDS}
        notes = list(dict.fromkeys(self.capacity.notes[seen:]))
        if notes:
            decision["reason"] = "; ".join([decision["reason"], *notes])
        return decision


#: Bounds of the lookup (seconds): one GCS node listing, and the caches' first lists.
GCS_TIMEOUT_S = 20.0
KUBE_READY_TIMEOUT_S = 15.0


@asynccontextmanager
async def ec2_client(*, region: str, endpoint_url: str | None) -> AsyncIterator[AioBaseClient]:
    """An aiobotocore ``ec2`` client for ``region``, made as the daemon's (the seam tests replace
    with a Stubber's)."""
    from resilienced.aws.clients import open_client

    async with open_client("ec2", region=region, endpoint_url=endpoint_url) as client:
        yield client


@asynccontextmanager
async def open_lookup(settings: LookupSettings) -> AsyncIterator[Finder]:
    """The read-only adapters of ``settings``' mode, started; closed again on exit.

    The cluster is opened by the daemon's own :func:`resilienced.app.runtime.open_cluster`, read-only.
    Raises (before yielding) when the cluster does not answer at all: the Kubernetes caches do
    not fill within ``KUBE_READY_TIMEOUT_S``, or the GCS at ``--ray-address`` refuses or does
    not answer (BackendUnavailable, RayAuthError: the CLI exits 1).
    """
    from resilienced.capacity.ec2 import Ec2Capacity
    from resilienced.capacity.planner import CapacityPlanner
    from resilienced.app.runtime import ReadOnly, open_cluster

    mode = settings.mode
    region = settings.aws.effective_region
    async with AsyncExitStack() as stack:
        ec2 = None
        if region:
            ec2 = await stack.enter_async_context(ec2_client(region=region, endpoint_url=settings.aws.endpoint_url))
            capacity = ReadOnlyCapacity(Ec2Capacity(ec2))
        else:
            capacity = ReadOnlyCapacity(None, missing="EC2 not configured (no --region)")
        planner = CapacityPlanner(source=capacity, policy=settings.capacity)
        read_only = ReadOnly(gcs_timeout_s=GCS_TIMEOUT_S, ready_timeout_s=KUBE_READY_TIMEOUT_S)
        cluster = await open_cluster(mode, stack, replica="replay", ec2=ec2, read_only=read_only)
        yield Finder(cluster=cluster, planner=planner, capacity=capacity, gcs_errors=read_only.gcs_errors)


# --------------------------------------------------------------------------- output
COLUMNS = (("FILE", "source_file"), ("KIND", "kind"), ("ACT", "actionable"),
           ("EVENT ID", "event_id"), ("INSTANCES", "instance_ids"), ("DEADLINE", "deadline"),
           ("STEPS", "steps"), ("REASON", "reason"))
#: With a cluster: each target as ``instance>run:capacity``, then the instances with no run
#: (``instance (why)``), before the reason.
TARGET_COLUMNS = (*COLUMNS[:-1], ("TARGETS", "targets"), ("UNRESOLVED", "unresolved"), COLUMNS[-1])


def write(rows: Sequence[dict[str, JsonValue]], *, as_json: bool, stream: TextIO,
          columns: Sequence[tuple[str, str]] = COLUMNS) -> None:
    """JSON lines, or a table of ``columns`` (title, key)."""
    if as_json:
        stream.writelines(json.dumps(record, default=str) + "\n" for record in rows)
        return
    stream.write(table(rows, columns))


def table(rows: Sequence[dict[str, JsonValue]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A plain-text table (the last column is not padded)."""
    def cell(value: object) -> str:
        if value is None or value == [] or value == {}:
            return "-"
        if isinstance(value, dict):
            return "; ".join(f"{key} ({why})" for key, why in value.items())
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, list):
            return ",".join(target_cell(v) if isinstance(v, dict) else str(v) for v in value)
        return str(value).replace("\n", " ")
    cells = [[cell(r.get(key)) for _, key in columns] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells]) for i, (title, _) in enumerate(columns)]
    lines = []
    for values in [[title for title, _ in columns]] + cells:
        padded = [v.ljust(w) for v, w in zip(values[:-1], widths[:-1], strict=True)] + [values[-1]]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"


def target_cell(target: Mapping[str, JsonValue]) -> str:
    """``instance>run:capacity``, then the fallback chain a stalled recovery would try:
    ``[then on-demand>wait]``."""
    run = target.get("ray_job") or target.get("ray_cluster") or target.get("node") or "?"
    chain = ">".join(str(f.get("capacity")) + (f" {f['reservation_id']}" if f.get("reservation_id") else "")
                     for f in target.get("fallbacks") or [])
    return f"{target.get('instance_id')}>{run}:{target.get('capacity') or '-'}" + (f"[then {chain}]" if chain else "")
