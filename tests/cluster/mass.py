"""A mass Spot interruption followed end to end on the real control plane (issue #45): the engine of
``bench/mass.py`` (the full wave) and ``tests/cluster/test_mass.py`` (its quick form).

The wave (:class:`Wave`): ``runs`` RayJobs under the real Kueue, ``workers`` 8-GPU workers each on
kwok Spot Nodes (one Node, one EC2 instance per worker), reconciled by the real KubeRay operator; a
ClusterQueue whose GPU quota has a Spot flavor (every run), a Capacity Block flavor that fits
``block_runs`` of them and an On-Demand flavor for the rest, each flavor's Nodes made to match; the
Capacity Block listed by EC2 (the stand-in) with room for every lost instance, so the daemon's
only evidence that the block is full is Kueue's quota as the ClusterQueue reports it.  Then one
"EC2 Spot Instance Interruption Warning" per worker Node (``runs x workers`` notices), a run's
notices together in one SendMessageBatch, through the real daemon (``replicas`` processes, Leases as
claims and follow-up records; ``follow_up`` False: ``--follow-up false``, the baseline).

The trainer's part is the harness's (:class:`Observer`): once the recording GCS stand-in recorded a
run's drain it writes the run's checkpoint (manifest last) to S3; once all the run's workers are
Running again off Spot it writes the run's resume record (trainer/resume.py), so the ``training``
stage is reached from the run's own records.

Measured per run, from the second the run's notices were sent (``notice``):
``drained`` (the first drain the stand-in recorded for the run), ``requeued`` (the daemon's first
``Requeued`` Event on the RayJob), ``admitted`` (the Workload's ``Admitted`` condition after it),
``scheduled`` (the last of the run's new worker pods' ``PodScheduled`` on a Node off Spot),
``training`` (the resume record written, the harness's clock) and, where the daemon follows, the
follow-up record's own ``reached`` times and end; the capacity every run ended on (the Nodes of its
workers); the daemon's Kubernetes API calls from the API server's audit log (its ServiceAccount's
requests, by verb and resource, from the first notice to the end); the daemon processes' CPU
seconds (``/proc/<pid>/stat``) and peak RSS (``VmHWM``).  API server condition times are whole
seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from resilienced.kube.followup_store import RECORD_ANNOTATION, lease_name
from tests.support.controlplane import ControlPlane
from tests.support.controlplane.world import DAEMON_NS, DAEMON_SA, World, karpenter_labels, kwok_node

from .stage import BLOCK, SYSTEM, Aws, Daemon, Trainer, instance, queue_world, rayjob

JsonObj = dict[str, Any]
DAEMON_USER = f"system:serviceaccount:{DAEMON_NS}:{DAEMON_SA}"
STAGES = ("drained", "requeued", "admitted", "scheduled", "training")
READ_VERBS = ("get", "list")
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
#: The follow-up records' Leases (``kube/followup_store``), counted apart from the claims' Leases.
RECORDS = "leases (follow-up records)"
#: The writes beyond the floor that keep a run's handling safe and visible, by name (issue #45): what
#: ``tests/cluster/test_mass.py`` bounds the writes by, ``floor + bookkeeping``.  Per run whose
#: notices one replica handles as one (a wave): the move claim (created and let go), one Event per
#: step on the RayJob; the leading notice's run claim, which stands for its event claim (the notices
#: that join it and those handled after the move, decided by their Node's cordon, write no claim):
#: without the follow-up created and completed; with it the move claim held from the handling's
#: start stands for the run claim, which is written once, done (docs/reliability.md, "Fewer claims
#: per run").  With the follow-up, its record (opened; a wait in each stage a look waits in, with
#: the stages it reached and its evidence, new evidence in the same stage only once half the stage's
#: bound passed; the end, the ledger kept in it in the same write: docs/requeue.md).
BOOKKEEPING_PER_RUN = {"move claim": 2, "Events (Draining, CheckpointDurable, Requeued)": 3}
BOOKKEEPING_UNFOLLOWED = {"run claim (standing for the event claim: created, completed)": 2}
BOOKKEEPING_FOLLOWED = {"run claim (written done, the move claim standing for it)": 1, "Event TrainingResumed": 1,
                        "follow-up record (opened; a wait in each stage a look waits in: admitted, scheduled, "
                        "training; the end with the ledger)": 5}
#: Per fallback (a move of its own): its move claim, its Events (RecoveryStalled, Requeued), the
#: record's writes (the move decided, the move made, a wait in each stage again).
BOOKKEEPING_PER_FALLBACK = {"move claim": 2, "Events (RecoveryStalled, Requeued)": 2,
                            "follow-up record (move decided, made; a wait in each stage)": 5}
STEP = 7


@dataclass(frozen=True)
class Wave:
    """One configuration of the wave (see the module docstring)."""

    runs: int = 50
    workers: int = 10
    block_runs: int = 20
    replicas: int = 1
    follow_up: bool = True
    admitted_bound_s: int = 30
    scheduled_bound_s: int = 60
    training_bound_s: int = 180
    #: ``--follow-up-interval-seconds`` (the default is 15 s; tests/cluster/stage.py's Daemon 1 s).
    interval_s: float = 1.0
    #: More ``resilienced run`` flags (e.g. ``("--concurrency", "50")``).
    extra: tuple[str, ...] = ()
    #: The whole wave's bound, from the first notice.
    timeout_s: float = 900.0
    #: Without the follow-up: the wave ends when nothing changed for this long.
    settle_s: float = 60.0

    @property
    def label(self) -> str:
        return (f"{self.replicas} replica{'s' if self.replicas > 1 else ''}, follow-up {'on' if self.follow_up else 'off'}"
                + (f" ({' '.join(self.extra)})" if self.extra else ""))

    def flags(self) -> list[str]:
        return ["--prefer-blocks", "true", "--follow-up", "true" if self.follow_up else "false",
                "--admitted-bound-seconds", str(self.admitted_bound_s),
                "--scheduled-bound-seconds", str(self.scheduled_bound_s),
                "--training-bound-seconds", str(self.training_bound_s),
                "--follow-up-interval-seconds", str(self.interval_s), *self.extra]


@dataclass
class RunState:
    """What the harness saw of one run."""

    name: str
    prefix: str
    heads: set[str] = field(default_factory=set)
    notice: float = 0.0
    at: dict[str, float] = field(default_factory=dict)
    requeues: int = 0
    fallbacks_seen: int = 0
    capacity: str = "spot"
    record: JsonObj | None = None
    saved: bool = False
    messages: list[str] = field(default_factory=list)
    resumed: bool = False

    def seconds(self, stage: str) -> float | None:
        return round(self.at[stage] - self.notice, 3) if stage in self.at else None


@dataclass
class Result:
    wave: Wave
    runs: list[RunState]
    calls: Counter[tuple[str, str]]
    #: The daemon's writes answered 409 Conflict (a claim another holds, an object changed since it
    #: was read: each retried or given up), by verb and resource.
    conflicts: Counter[str]
    #: Claim renewals (:func:`claim_renewals`): a held claim renewed every third of its TTL, so a
    #: handling that lasts longer (a loaded machine) renews more; named in the bound, counted apart.
    renewals: int
    #: The daemon's reads once the notices were all settled (Observer.quiet_at), by verb and resource.
    quiet_reads: Counter[str]
    quiet_at: float | None
    cpu_s: float
    cpu_start_s: float
    peak_rss_mib: float
    wall_s: float
    in_flight: int
    notices: int
    drains: int
    ended: str
    t0: float = 0.0
    t_end: float = 0.0

    # ---------------------------------------------------------------- figures
    def stage_stats(self) -> dict[str, dict[str, float | int | None]]:
        out: dict[str, dict[str, float | int | None]] = {}
        for stage in STAGES:
            values = [s for r in self.runs if (s := r.seconds(stage)) is not None]
            out[stage] = {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
                          "max": max(values) if values else None}
        return out

    def daemon_stats(self) -> dict[str, dict[str, float | int | None]]:
        """The follow-up records' own times (the daemon's clock), notice time = the record's."""
        per: dict[str, list[float]] = defaultdict(list)
        for r in self.runs:
            rec = r.record or {}
            notice = _iso(rec.get("notice_at"))
            if notice is None:
                continue
            for stage, when in (rec.get("reached") or {}).items():
                t = _iso(when)
                if t is not None:
                    per[stage].append(t - notice)
            if rec.get("ended_at") and rec.get("state") == "resumed":
                per["resumed"].append((_iso(rec["ended_at"]) or notice) - notice)
        return {k: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99), "max": max(v)}
                for k, v in sorted(per.items())}

    def capacities(self) -> Counter[str]:
        return Counter(r.capacity for r in self.runs)

    def ends(self) -> Counter[str]:
        return Counter((r.record or {}).get("state", "no follow-up") for r in self.runs)

    def moved_twice(self) -> list[str]:
        """Runs requeued more than once for the one wave (fallbacks, each a move of its own, apart)."""
        return [r.name for r in self.runs if r.requeues > 1]

    def writes(self) -> Counter[str]:
        return Counter({f"{v} {res}": n for (v, res), n in self.calls.items() if v in WRITE_VERBS})

    def reads(self) -> Counter[str]:
        return Counter({f"{v} {res}": n for (v, res), n in self.calls.items() if v in READ_VERBS})

    def bookkeeping(self) -> dict[str, int]:
        """The named writes beyond the floor the wave is allowed (:data:`BOOKKEEPING_PER_RUN`...)."""
        runs, fallbacks = self.wave.runs, sum(r.fallbacks_seen for r in self.runs)
        out = {f"{k} x{runs} runs": n * runs for k, n in BOOKKEEPING_PER_RUN.items()}
        more = BOOKKEEPING_FOLLOWED if self.wave.follow_up else BOOKKEEPING_UNFOLLOWED
        out.update({f"{k} x{runs} runs": n * runs for k, n in more.items()})
        out.update({f"{k} x{fallbacks} fallbacks": n * fallbacks for k, n in BOOKKEEPING_PER_FALLBACK.items()})
        return out

    def floor(self) -> int:
        """The fewest writes that move the runs as they were moved: per lost instance the Node's cordon
        (1 patch nodes); per move (a requeue or a fallback) deactivate the Workload (patch
        workloads), steer the RayJob's workers (patch rayjobs), reactivate the Workload with its
        PodSets steered (patch workloads)."""
        moves = sum(r.requeues + r.fallbacks_seen for r in self.runs)
        return self.wave.runs * self.wave.workers + 3 * moves

    def followup_minutes(self, *, since: float | None = None) -> float:
        """Run-minutes of follow-up (each record from opened to ended, or to the wave's end), from
        ``since`` on when given."""
        total = 0.0
        for r in self.runs:
            rec = r.record or {}
            start, end = _iso(rec.get("opened_at")), _iso(rec.get("ended_at"))
            if start is not None:
                start = max(start, since) if since is not None else start
                total += max(0.0, (end if end is not None else self.t_end) - start)
        return total / 60.0

    def as_json(self) -> JsonObj:
        writes, reads = sum(self.writes().values()), sum(self.reads().values())
        n = max(1, self.wave.runs)
        minutes = self.followup_minutes(since=self.quiet_at) if self.quiet_at is not None else 0.0
        quiet = sum(self.quiet_reads.values())
        return {
            "configuration": self.wave.label, "runs": self.wave.runs, "workers": self.wave.workers,
            "notices": self.notices, "drains": self.drains, "block_runs": self.wave.block_runs,
            "replicas": self.wave.replicas, "follow_up": self.wave.follow_up, "ended": self.ended,
            "wall_s": round(self.wall_s, 1),
            "stages_s": self.stage_stats(), "daemon_record_s": self.daemon_stats(),
            "capacity": dict(self.capacities()), "ends": dict(self.ends()),
            "stuck": {r.name: (r.record or {}).get("detail") or (r.record or {}).get("reason")
                      for r in self.runs if (r.record or {}).get("state") == "stuck"},
            "moved_twice": self.moved_twice(),
            "requeues": sum(r.requeues for r in self.runs), "fallbacks": sum(r.fallbacks_seen for r in self.runs),
            "api": {"writes_per_run": round(writes / n, 2), "reads_per_run": round(reads / n, 2),
                    "floor_writes_per_run": round(self.floor() / n, 2),
                    "writes_over_floor": round(writes / max(1, self.floor()), 2),
                    "within_2x_floor": writes <= 2 * self.floor(),
                    "bookkeeping_per_run": round(sum(self.bookkeeping().values()) / n, 2),
                    "conflicts": dict(self.conflicts.most_common()),
                    "claim_renewals": self.renewals,
                    "writes": dict(self.writes().most_common()), "reads": dict(self.reads().most_common()),
                    "watches": sum(c for (v, _), c in self.calls.items() if v == "watch"),
                    "followup_run_minutes": round(self.followup_minutes(), 2),
                    "quiet_from_s": round(self.quiet_at - self.t0, 1) if self.quiet_at is not None else None,
                    "quiet_reads": dict(self.quiet_reads.most_common()),
                    "followup_run_minutes_quiet": round(minutes, 2),
                    "reads_per_run_per_followup_minute": round(quiet / minutes, 1) if minutes > 0.05 else None},
            "daemon": {"cpu_s": round(self.cpu_s, 2), "cpu_start_s": round(self.cpu_start_s, 2),
                       "peak_rss_mib": round(self.peak_rss_mib, 1)},
            "sqs_in_flight_at_end": self.in_flight,
            "per_run": {r.name: {"stages_s": {s: r.seconds(s) for s in STAGES if s in r.at}, "capacity": r.capacity,
                                 "requeues": r.requeues, "fallbacks": r.fallbacks_seen, "requeued": r.messages,
                                 "record": {k: (r.record or {}).get(k) for k in ("state", "stage", "reached", "ended_at")}
                                 if r.record else None} for r in self.runs},
        }


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))], 3)


def _iso(text: Any) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


# --------------------------------------------------------------------------- the world
class Stage:
    """The wave's objects in ``world``'s namespace (see the module docstring)."""

    def __init__(self, plane: ControlPlane, world: World, aws: Aws, wave: Wave, *, nodes: str | None = None) -> None:
        self.plane, self.world, self.aws, self.wave = plane, world, aws, wave
        self.ns = world.namespace
        #: The Nodes' name prefix and label: the namespace's (made and removed by this wave), or
        #: ``nodes`` (kept for the next wave of the same shape: bench/mass.py's configurations).
        self.prefix = nodes or self.ns
        self.instances: dict[str, str] = {}
        self.node_label = {"resilienced.test/wave": self.prefix}

    def nodes(self) -> None:
        """The system Node, one Spot Node per worker, Block and On-Demand Nodes for the runs the
        quota fits; created in parallel, then waited for Ready and untainted by one list."""
        w = self.wave
        specs: list[tuple[str, dict[str, str]]] = []
        for i in range(w.runs * w.workers):
            specs.append((f"{self.prefix}-spot-{i}", karpenter_labels("spot")))
        for i in range(w.block_runs * w.workers):
            specs.append((f"{self.prefix}-block-{i}", karpenter_labels("reserved", reservation=BLOCK)))
        for i in range((w.runs - w.block_runs) * w.workers):
            specs.append((f"{self.prefix}-od-{i}", karpenter_labels("on-demand")))
        bodies = []
        sys_node = kwok_node(f"{self.prefix}-sys", instance(0x4000), {**SYSTEM, **karpenter_labels("on-demand")},
                             gpus=0, cpu="2000")
        sys_node["status"]["capacity"]["pods"] = sys_node["status"]["allocatable"]["pods"] = str(4 * w.runs + 10)
        bodies.append(sys_node)
        for n, (name, labels) in enumerate(specs):
            self.instances[name] = instance(0x100000 + n)
            bodies.append(kwok_node(name, self.instances[name], labels))
        for body in bodies:
            body["metadata"]["labels"].update(self.node_label)
        selector = {"labelSelector": f"resilienced.test/wave={self.prefix}"}
        kept = self.plane.admin.request("GET", "/api/v1/nodes", query=selector).get("items", [])
        if len(kept) == len(bodies):  # the last wave's: its cordons lifted, its pods gone
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda n: self.plane.admin.request(
                    "PATCH", f"/api/v1/nodes/{n['metadata']['name']}", {"spec": {"taints": None}},
                    content_type="application/merge-patch+json"),
                    [n for n in kept if n["spec"].get("taints")]))
            names = {b["metadata"]["name"] for b in bodies}
            self.world.wait("the last wave's pods gone from the kept Nodes", lambda: not any(
                p["spec"].get("nodeName") in names
                for p in self.plane.admin.request("GET", "/api/v1/pods").get("items", [])), timeout=600)
        else:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda b: self.plane.admin.request("POST", "/api/v1/nodes", b), bodies))

        def ready() -> bool:
            found = self.plane.admin.request("GET", "/api/v1/nodes", query=selector).get("items", [])
            good = [n for n in found
                    if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions") or [])
                    and not any(t["key"].startswith("node.kubernetes.io/") for t in n["spec"].get("taints") or [])]
            return len(good) == len(bodies)

        self.world.wait(f"{len(bodies)} Nodes Ready and untainted", ready, timeout=120 + len(bodies))

    def remove_nodes(self) -> None:
        self.plane.admin.request("DELETE", "/api/v1/nodes", query={"labelSelector": f"resilienced.test/wave={self.prefix}"})

    def runs(self) -> list[RunState]:
        """The queue, the RayJobs, and each run Running on Spot with its RayCluster's head address."""
        w = self.wave
        gpus = 8 * w.workers
        queue = queue_world(self.world, spot=gpus * w.runs, block=gpus * w.block_runs,
                            od=gpus * (w.runs - w.block_runs))
        names = [f"run-{i:02d}" for i in range(w.runs)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: rayjob(self.world, queue=queue, workers=w.workers, name=n), names))
        states = {n: RunState(name=n, prefix=f"{self.ns}/{n}") for n in names}

        def placed() -> bool:
            clusters = self.world.list("ray.io/v1", "rayclusters")
            owner = {c["metadata"]["name"]: _owner(c, "RayJob") for c in clusters}
            for c in clusters:
                head = (c.get("status") or {}).get("head") or {}
                job = owner[c["metadata"]["name"]]
                if job in states:
                    states[job].heads = {h for h in (head.get("podIP"), head.get("serviceIP")) if h}
            pods = [p for p in self.world.pods("ray.io/node-type=worker") if p["status"].get("phase") == "Running"
                    and p["status"].get("podIP") and "-spot-" in (p["spec"].get("nodeName") or "")]
            return len(pods) == w.runs * w.workers and all(s.heads for s in states.values())

        self.world.wait(f"{w.runs * w.workers} workers Running on Spot and {w.runs} heads", placed,
                        timeout=180 + 2 * w.runs * w.workers)
        return list(states.values())

    def see(self, daemon: Daemon) -> None:
        """Every RayCluster's GCS on the stand-in, a Ray node per pod at its IP, in one write."""
        clusters = self.world.list("ray.io/v1", "rayclusters")
        pods = self.world.pods()
        by_cluster: dict[str, list[JsonObj]] = defaultdict(list)
        for p in pods:
            by_cluster[p["metadata"].get("labels", {}).get("ray.io/cluster", "")].append(p)
        save = daemon._write
        daemon._write = lambda: None  # type: ignore[method-assign]
        try:
            for c in clusters:
                daemon.see(c, by_cluster[c["metadata"]["name"]])
        finally:
            daemon._write = save  # type: ignore[method-assign]
        daemon._write()


def _owner(obj: JsonObj, kind: str) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("kind") == kind:
            return str(ref["name"])
    return None


def _t(text: Any) -> float | None:
    return _iso(text)


# --------------------------------------------------------------------------- the trainer and the watch
class Observer:
    """Reads the wave's state once a second (the harness's own admin reads, not the daemon's) and
    plays the trainer (see the module docstring)."""

    def __init__(self, stage: Stage, runs: list[RunState], daemons: list[Daemon], drains: Path) -> None:
        self.stage, self.world, self.daemons, self.drains = stage, stage.world, daemons, drains
        self.runs = {r.name: r for r in runs}
        self.by_head = {f"{h}:6379": r for r in runs for h in r.heads}
        self.trainers = {r.name: Trainer(stage.aws, r.prefix) for r in runs}
        self.pool = ThreadPoolExecutor(6)
        self.drain_lines = 0
        self.drain_count = 0
        self.last_change = time.time()
        #: When every run was requeued and no notice was left in SQS: from then on, the daemon's API
        #: reads are the follow-up's (and the sweeps'), not the notices'.
        self.quiet_at: float | None = None

    def _changed(self) -> None:
        self.last_change = time.time()

    def look(self) -> None:
        w = self.stage.wave
        now = time.time()
        # the drains the stand-in recorded: the trainer saves the run's checkpoint once
        if self.drains.exists():
            lines = self.drains.read_text().splitlines()
            for line in lines[self.drain_lines:]:
                if not line.strip():
                    continue
                d = json.loads(line)
                self.drain_count += 1
                run = self.by_head.get(d["address"])
                if run is None:
                    continue
                if "drained" not in run.at:
                    run.at["drained"] = float(d.get("t", now))
                    self._changed()
                if not run.saved:
                    run.saved = True
                    self.pool.submit(self.trainers[run.name].save, step=STEP, world_size=w.workers)
            self.drain_lines = len(lines)
        # the daemon's Requeued Events on the RayJobs
        requeued: dict[str, list[JsonObj]] = defaultdict(list)
        for e in self.world.list("v1", "events"):
            if e.get("reason") == "Requeued" and (e.get("source") or {}).get("component", "").startswith("resilienced") \
                    and (e.get("involvedObject") or {}).get("kind") == "RayJob":
                requeued[e["involvedObject"]["name"]].append(e)
        for name, found in requeued.items():
            run = self.runs.get(name)
            if run is None:
                continue
            run.messages = [f"{e.get('count') or 1}x {e.get('message')}" for e in found]
            moves = sum(int(e.get("count") or 1) for e in found)
            fallbacks = sum(int(e.get("count") or 1) for e in found if "fallback-" in (e.get("message") or ""))
            if (moves - fallbacks, fallbacks) != (run.requeues, run.fallbacks_seen):
                run.requeues, run.fallbacks_seen = moves - fallbacks, fallbacks
                self._changed()
            if "requeued" not in run.at:
                times = [t for e in found if (t := _t(e.get("eventTime") or e.get("firstTimestamp")
                                                      or e["metadata"].get("creationTimestamp"))) is not None]
                run.at["requeued"] = min(times) if times else now
        # the Workloads: admitted after the requeue
        for wl in self.world.list("kueue.x-k8s.io/v1beta2", "workloads"):
            run = self.runs.get(_owner(wl, "RayJob") or "")
            if run is None or "requeued" not in run.at or "admitted" in run.at:
                continue
            for c in (wl.get("status") or {}).get("conditions") or []:
                if c["type"] == "Admitted" and c["status"] == "True":
                    t = _t(c.get("lastTransitionTime"))
                    if t is not None and t >= run.notice - 1:
                        run.at["admitted"] = t
                        self._changed()
        # the workers: scheduled off Spot, then Running: the trainer's resume record
        owner = {c["metadata"]["name"]: _owner(c, "RayJob") for c in self.world.list("ray.io/v1", "rayclusters")}
        workers: dict[str, list[JsonObj]] = defaultdict(list)
        for p in self.world.pods("ray.io/node-type=worker"):
            if p["metadata"].get("deletionTimestamp"):
                continue
            job = owner.get(p["metadata"].get("labels", {}).get("ray.io/cluster", ""))
            if job in self.runs:
                workers[job].append(p)
        for name, run in self.runs.items():
            pods = workers.get(name, [])
            nodes = [p["spec"].get("nodeName") or "" for p in pods]
            capacity = ("block" if all("-block-" in n for n in nodes) else "on-demand" if all("-od-" in n for n in nodes)
                        else "spot" if all("-spot-" in n for n in nodes) else "mixed") if len(pods) == w.workers \
                and all(nodes) else "pending"
            if capacity != run.capacity:
                run.capacity = capacity
                self._changed()
            off_spot = capacity in ("block", "on-demand")
            if off_spot and "scheduled" not in run.at and "requeued" in run.at:
                times = [_t(c.get("lastTransitionTime")) for p in pods for c in p["status"].get("conditions") or []
                         if c["type"] == "PodScheduled" and c["status"] == "True"]
                run.at["scheduled"] = max((t for t in times if t is not None), default=now)
            if off_spot and not run.resumed and "requeued" in run.at and all(
                    p["status"].get("phase") == "Running" for p in pods):
                run.resumed = True
                run.at["training"] = time.time()
                self.pool.submit(self.trainers[name].resumed, step=STEP, world_size=w.workers)
                self._changed()
        if self.quiet_at is None and all("requeued" in r.at for r in self.runs.values()) \
                and self.stage.aws.in_flight() == 0:
            self.quiet_at = time.time()
        # the follow-up records (the daemon's Leases)
        if w.follow_up:
            leases = {le["metadata"]["name"]: le for le in self.world.list(
                "coordination.k8s.io/v1", "leases", namespace=DAEMON_NS)}
            for name, run in self.runs.items():
                lease = leases.get(lease_name(f"{self.stage.ns}/{name}"))
                if lease is not None:
                    record = json.loads(lease["metadata"]["annotations"][RECORD_ANNOTATION])
                    if (record.get("state"), record.get("stage")) != ((run.record or {}).get("state"),
                                                                       (run.record or {}).get("stage")):
                        self._changed()
                    run.record = record

    def done(self) -> bool:
        runs = list(self.runs.values())
        if self.stage.wave.follow_up:
            return all((r.record or {}).get("state") in ("resumed", "stuck") for r in runs)
        return all(r.resumed for r in runs)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# --------------------------------------------------------------------------- the daemon's costs
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def audit_calls(path: Path, *, since: float, until: float) -> list[tuple[float, str, str, int, str]]:
    """The daemon's requests in [since, until] from the audit log: (time, verb, resource[/sub], the
    response's status code, the object's name)."""
    seen: set[str] = set()
    out = []
    with open(path) as f:
        first = _iso(json.loads(f.readline() or "{}").get("requestReceivedTimestamp"))
        assert first is not None and first <= since, (
            f"the audit log {path} begins after the wave's start: rotated, or nothing was logged")
        f.seek(0)
        for line in f:
            if DAEMON_USER not in line:
                continue
            entry = json.loads(line)
            if entry.get("user", {}).get("username") != DAEMON_USER or entry["auditID"] in seen:
                continue
            seen.add(entry["auditID"])
            t = _iso(entry.get("requestReceivedTimestamp"))
            if t is None or not since <= t <= until:
                continue
            ref = entry.get("objectRef") or {}
            resource = ref.get("resource", entry.get("requestURI", "?"))
            if resource == "leases" and str(ref.get("name") or "").startswith("resilienced-fu-"):
                resource = RECORDS
            if ref.get("subresource"):
                resource += "/" + ref["subresource"]
            out.append((t, entry["verb"], resource, int((entry.get("responseStatus") or {}).get("code") or 0),
                        str(ref.get("name") or "")))
    return out


def claim_renewals(calls: list[tuple[float, str, str, int, str]]) -> int:
    """The claim Leases' renewals among the daemon's updates (answered 200): a claim Lease that was
    deleted (a move claim let go) was only ever renewed by its updates; one kept (a run claim, or an
    event claim) and updated had one update that completed it and the rest were renewals (a run
    claim written done has no update)."""
    updates: Counter[str] = Counter(name for _, v, res, code, name in calls
                                    if res == "leases" and v == "update" and code == 200)
    deleted = {name for _, v, res, code, name in calls if res == "leases" and v == "delete" and code == 200}
    return sum(n if name in deleted else n - 1 for name, n in updates.items())


# --------------------------------------------------------------------------- one wave
def run_wave(plane: ControlPlane, world: World, aws: Aws, wave: Wave, workdir: Path, *,
             progress: Any = None, keep_nodes: str | None = None) -> Result:
    """Build the wave in ``world``, interrupt it, follow it to its end; every daemon is stopped and
    the wave's Nodes removed before it returns (also on failure), but with ``keep_nodes`` (their
    name prefix): kept for the next wave, which finds them by it."""
    say = progress or (lambda text: None)
    stage = Stage(plane, world, aws, wave, nodes=keep_nodes)
    daemons: list[Daemon] = []
    observer: Observer | None = None
    try:
        t = time.time()
        stage.nodes()
        say(f"{len(stage.instances) + 1} Nodes Ready in {time.time() - t:.0f} s")
        t = time.time()
        runs = stage.runs()
        say(f"{wave.runs} runs Running on Spot in {time.time() - t:.0f} s")
        drains = workdir / "drains.jsonl"
        blocks = [{"reservation_id": BLOCK, "instance_type": "p5.48xlarge", "availability_zone": "us-east-1a",
                   "reservation_type": "capacity-block", "state": "active",
                   "available_instances": wave.runs * wave.workers, "total_instances": wave.runs * wave.workers,
                   "start": (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat(),
                   "end": (datetime.now(timezone.utc) + timedelta(days=2)).isoformat()}]
        for r in range(wave.replicas):
            daemon = Daemon(plane=plane, world=world, aws=aws, queue_url=aws.queue_url, workdir=workdir / f"replica-{r}",
                            name=f"replica-{'abcdef'[r]}", blocks=blocks, flags=wave.flags())
            daemon.drains = drains
            daemon._world["gcs"]["drains"] = str(drains)
            stage.see(daemon)
            daemons.append(daemon.start())
        started = lambda: all(any(line.get("event") == "started" for line in d.lines()) for d in daemons)  # noqa: E731
        _wait("the daemons started", started, timeout=120, daemons=daemons)
        cpu_start = sum(cpu_seconds(d.proc.pid) for d in daemons if d.proc)
        observer = Observer(stage, runs, daemons, drains)
        # the wave: a run's notices together, one SendMessageBatch per run (at most 10 a batch)
        t0 = time.time()
        by_run: dict[str, list[str]] = defaultdict(list)
        for node in sorted(stage.instances, key=lambda n: int(n.rsplit("-", 1)[1])):
            if "-spot-" in node:
                by_run[f"run-{int(node.rsplit('-', 1)[1]) // wave.workers:02d}"].append(stage.instances[node])
        notices = 0
        for run in runs:
            run.notice = time.time()
            ids = by_run[run.name]
            for i in range(0, len(ids), 10):
                entries = [{"Id": str(k), "MessageBody": notice_body(iid)} for k, iid in enumerate(ids[i:i + 10])]
                aws.sqs.send_message_batch(QueueUrl=aws.queue_url, Entries=entries)
                notices += len(entries)
        say(f"{notices} notices sent in {time.time() - t0:.1f} s")
        ended = "all ended"
        last_say = time.time()
        while not observer.done():
            observer.look()
            now = time.time()
            if now - t0 > wave.timeout_s:
                ended = f"the wave's bound ({wave.timeout_s:.0f} s) passed"
                break
            if not wave.follow_up and now - observer.last_change > wave.settle_s:
                ended = f"nothing changed for {wave.settle_s:.0f} s"
                break
            dead = [d.name for d in daemons if not d.alive()]
            if dead:
                raise AssertionError(f"daemon(s) {dead} ended\n" + "\n".join(d.tail() for d in daemons))
            if now - last_say > 30:
                last_say = now
                say(f"  {now - t0:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(
                    Counter(_where(r) for r in runs).items())))
            time.sleep(1.0)
        observer.look()
        t_end = time.time()
        cpu = sum(cpu_seconds(d.proc.pid) for d in daemons if d.proc)
        rss = max(peak_rss_mib(d.proc.pid) for d in daemons if d.proc)
        in_flight = aws.in_flight()
        for d in daemons:
            d.stop()
        observer.close()
        calls = audit_calls(plane.audit_log, since=t0, until=t_end)
        quiet = observer.quiet_at
        quiet_reads = Counter(f"{v} {res}" for t, v, res, _, _ in calls
                              if v in READ_VERBS and quiet is not None and t >= quiet)
        return Result(wave=wave, runs=runs, calls=Counter((v, res) for _, v, res, _, _ in calls),
                      conflicts=Counter(f"{v} {res}" for _, v, res, code, _ in calls if v in WRITE_VERBS and code == 409),
                      renewals=claim_renewals(calls),
                      quiet_reads=quiet_reads, quiet_at=quiet,
                      cpu_s=cpu - cpu_start, cpu_start_s=cpu_start, peak_rss_mib=rss, wall_s=t_end - t0,
                      in_flight=in_flight, notices=notices, drains=observer.drain_count, ended=ended,
                      t0=t0, t_end=t_end)
    finally:
        for d in daemons:
            d.kill()
        if observer is not None:
            observer.close()
        try:
            if keep_nodes is None:
                stage.remove_nodes()
        except Exception:  # noqa: BLE001 - the namespace's removal goes on; the Nodes are the wave's
            pass


def _where(run: RunState) -> str:
    rec = run.record or {}
    if rec.get("state") in ("resumed", "stuck"):
        return str(rec["state"])
    if run.resumed:
        return "training"
    for stage in reversed(STAGES[:-1]):
        if stage in run.at:
            return stage
    return "notified"


def _wait(what: str, check: Any, *, timeout: float, daemons: list[Daemon]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if any(not d.alive() for d in daemons):
            break
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n" + "\n".join(f"--- {d.name}\n{d.tail()}" for d in daemons))


_ids = threading.Lock()
_next_id = [0]


def notice_body(instance_id: str) -> str:
    with _ids:
        _next_id[0] += 1
        n = _next_id[0]
    when = datetime.now(timezone.utc)
    return json.dumps({"version": "0", "id": f"5a1e0000-0000-4000-8000-{os.getpid() % 10**4:04d}{n:08d}",
                       "detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
                       "account": "123456789012", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "region": "us-east-1",
                       "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance_id}"],
                       "detail": {"instance-id": instance_id, "instance-action": "terminate"}})


# --------------------------------------------------------------------------- the report
def report(results: list[Result]) -> str:
    lines = []
    for res in results:
        j = res.as_json()
        lines.append(f"== {j['configuration']}: {j['runs']} runs x {j['workers']} workers, {j['notices']} notices "
                     f"({j['ended']}, {j['wall_s']} s)")
        lines.append("  notice -> stage (s)   n     p50      p99      max")
        for stage, s in j["stages_s"].items():
            lines.append(f"  {stage:<18} {s['n']:>4} {_f(s['p50'])} {_f(s['p99'])} {_f(s['max'])}")
        for stage, s in j["daemon_record_s"].items():
            lines.append(f"  record: {stage:<10} {s['n']:>4} {_f(s['p50'])} {_f(s['p99'])} {_f(s['max'])}")
        lines.append(f"  capacity at the end: {j['capacity']}; follow-up ends: {j['ends']}; "
                     f"requeues {j['requeues']}, fallbacks {j['fallbacks']}, moved twice: {j['moved_twice'] or 'none'}")
        for name, why in j["stuck"].items():
            lines.append(f"  stuck {name}: {why}")
        a = j["api"]
        lines.append(f"  API per run: writes {a['writes_per_run']} (floor {a['floor_writes_per_run']}, "
                     f"x{a['writes_over_floor']} the floor: {'within' if a['within_2x_floor'] else 'NOT within'} 2x; "
                     f"named bookkeeping allowed {a['bookkeeping_per_run']}), reads {a['reads_per_run']}; "
                     f"watches {a['watches']}")
        lines.append(f"    writes: {a['writes']}; answered 409 Conflict: {a['conflicts'] or 'none'}; "
                     f"claim renewals: {a['claim_renewals']}")
        lines.append(f"    reads:  {a['reads']}")
        lines.append(f"    once the notices were settled ({a['quiet_from_s']} s on): {sum(a['quiet_reads'].values())} reads "
                     f"over {a['followup_run_minutes_quiet']} run-minutes of follow-up = "
                     f"{a['reads_per_run_per_followup_minute']} reads per run per minute {a['quiet_reads']}")
        d = j["daemon"]
        lines.append(f"  daemon: {d['cpu_s']} CPU-s for the wave ({d['cpu_start_s']} CPU-s to start), "
                     f"peak RSS {d['peak_rss_mib']} MiB (largest replica); SQS in flight at the end: "
                     f"{j['sqs_in_flight_at_end']}")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return f"{v:8.1f}" if v is not None else "       -"
