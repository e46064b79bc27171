"""Scenario 2 in ray mode: Ray's GCS stopped (SIGSTOP) while a notice is handled, then resumed.

The world of tests/chaos/world.py (moto with the queue, its DLQ and the checkpoint bucket; the
fault proxy in front of moto, which also answers ``DescribeCapacityReservations``), plus:

* a real local Ray cluster (:class:`~resilienced.local.raycluster.LocalRayCluster`): a head with
  no CPUs and one worker node per trial, labelled as the drill labels its workers (instance id,
  ``spot``, instance type and zone), each kept busy by an actor (tests/support/ray.py ``busy``)
  so a drain keeps it alive, draining, as a training worker's node is;
* two daemon replicas ``python -m resilienced run --mode ray`` on that cluster
  (``--ray-address``, ``--ray-token-file``, ``--checkpoint-uri s3://ckpt/trial-0/train``); in
  ray mode their claims (event and run) live in the GCS internal KV (resilienced/ray/claims.py),
  so a stopped GCS holds up the claims, ``locate`` and the drain alike.

The daemons reach the GCS through a TCP forwarder (:class:`TcpForwarder`), which can make the
address unreachable. One trial (:data:`GCS_FAULTS`): the worker of instance ``instance(n)`` is
busy; the head's ``gcs_server`` is stopped (SIGSTOP: it keeps its listening socket, so a TCP
connect still succeeds and every request hangs past the daemon's GCS timeout, ``RayGcs.timeout``
10 s, resilienced/ray/gcs.py), or the forwarder refuses connections; the trainer's save is written
to S3 and the Spot notice for ``instance(n)`` is sent; once a replica has received it the fault
is held ``hold_s`` more, then the GCS is resumed (SIGCONT) or reachable again. One fault starts
later instead: once the node is drained, while the replica waits for the checkpoint. Counted:

* drains: ``HandleDrainNode`` lines for the node in the GCS's own log (``gcs_server.out``; Ray
  2.60 ``src/ray/gcs/gcs_autoscaler_state_manager.cc`` logs one per DrainNode request it
  handles), and the node's draining deadline on the GCS, which must be the notice's;
  a second DrainNode is a duplicate drain (``RayGcs.drain`` does not re-send a drain to a node
  draining with the same or an earlier deadline);
* the checkpoint verified: the run claim (``run/<event id>/<GCS address>`` in the GCS KV) done,
  its record saying ``durable.verified``;
* the requeue: a plain ``run --mode ray`` has no node provider (resilienced/app/runtime.py: only the
  drill passes one), so its requeue step is recorded in the run's record without launching
  anything; counted are the ``recovery`` log lines carrying a ``requeue`` step for the event
  (one wanted), and the run claim done once;
* the message deleted, nothing in the DLQ, no receive past the redrive count, each replica's
  ``/readyz`` polled while the fault lasts (not ready only with a reason) and ready again after,
  and the time from the fault's end (SIGCONT, or the address reachable again) to the run done:
  ``decided_s`` to the done decision line (written once the message is deleted), ``recover_s``
  to that seen here (the run claim done and the queue empty, polled every 0.5 s).

Two faults (full form only) kill the GCS instead: ``gcs-restart`` before the notice is sent,
``gcs-restart-after-drain`` once the node is drained (as ``gcs-stop-after-drain``: the run claim,
held in the GCS KV, must outlive the GCS). They need GCS fault tolerance, as KubeRay configures it
(resilienced/local/raycluster.py, module docstring: ``RAY_REDIS_ADDRESS`` and
``RAY_external_storage_namespace`` on the head, ``RAY_gcs_rpc_server_reconnect_timeout_s=600`` on
the workers): they run on a second cluster of their own whose head keeps the GCS's state in a
``redis-server`` started for it (tests/support/redis.py), with its own world (moto, two replicas).
The head's ``gcs_server`` is SIGKILLed (before the notice is sent, or once drained); its ``ray start
--block`` then kills the head's other processes and exits (Ray 2.60 ray/scripts/scripts.py), as a
KubeRay head container exits with it; ``hold_s`` later (from the notice's receive, or the kill) the
head is started again with its first command line and environment (``LocalRayCluster.restart_head``,
as the kubelet restarts the container): the fault's end, from which ``decided_s`` and ``recover_s``
count (``ending_s``: until the new head is listed ALIVE; its GCS serves a little earlier). The GCS
reloads the cluster from Redis: the workers (which wait for it, up to the reconnect timeout), the
GCS KV (the daemon's claims), the node's drain. The busy actor is a detached one there
(tests/support/ray.py ``busy``): its driver's job hangs on the old head node, which the restarted
GCS marks dead. Counted as for the other faults (the GCS's log: ``gcs_server*.out``, the restarted
GCS writing ``gcs_server.1.out``). Without ``redis-server`` on the PATH the faults are not run and
``extra["skipped"]`` says so (``make chaos`` installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from resilienced.local.aws import FAKE_CREDENTIALS
from resilienced.local.raycluster import LocalRayCluster, LocalRayNode
from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL, INSTANCE_TYPE_LABEL, ZONE_LABEL
from tests.chaos.scenarios import Tally, check_past_redrive
from tests.chaos.world import ACCOUNT, BUCKET, World, instance, notice, world
from tests.intake.process import DaemonProcess
from tests.recovery.conftest import REGION
from tests.support.ray import busy
from tests.support.redis import REDIS_SERVER, redis_server

#: the daemon's GCS timeout (``RayGcs(timeout=10.0)``, resilienced/ray/gcs.py; ray mode does not
#: change it): each step of a GCS call is bounded by it, a whole call by 3 x it + 15 s
GCS_TIMEOUT_S = 10.0
#: all trials share this run's checkpoint URI (ray mode: one run per cluster, from configuration)
RUN = 0
CHECKPOINT_URI = f"s3://{BUCKET}/trial-{RUN}/train"


@dataclass(frozen=True)
class GcsFault:
    what: str
    #: seconds the fault is held: from the notice's receive (``when`` "notice"), or from the drain
    hold_s: float
    quick: bool
    #: "notice": injected before the notice is sent (claims, locate and the drain meet it);
    #: "drained": injected once a replica has drained the node, while it waits for the checkpoint
    #: (the save comes 1 s later), so the durable step, the requeue and the run claim's renewal and
    #: completion meet it
    when: str = "notice"
    #: the GCS is SIGKILLed and its head restarted: needs a Redis-backed head (GCS fault tolerance)
    restart: bool = False


GCS_FAULTS: dict[str, GcsFault] = {
    "gcs-stop": GcsFault(f"SIGSTOP of the head's gcs_server held 15 s after the notice is received (past the "
                         f"daemon's {GCS_TIMEOUT_S:g} s GCS timeout), then SIGCONT", 15.0, True),
    "gcs-stop-long": GcsFault("SIGSTOP of the head's gcs_server held 50 s after the notice is received (past a "
                              "whole GCS call's bound, 3 x 10 + 15 s), then SIGCONT", 50.0, False),
    "gcs-stop-after-drain": GcsFault(
        "SIGSTOP of the head's gcs_server as soon as a replica has drained the node, while it waits for the "
        "checkpoint (saved 1 s later), held 15 s, then SIGCONT", 15.0, False, when="drained"),
    # A refused connect fails at once and gives no retry delay. With a fixed delay (the visibility
    # timeout, 4 s) each 4 s of outage cost one receive of the redrive count (5), so an outage of
    # over 16 s dead-lettered the notice (12 s: done at receive 5 of 5 on 2026-12-01); with the
    # backoff by receive count (docs/reliability.md, fix 9) receives come at 0, 4, 12, 28 s, so
    # 20 s held is done at receive 4; with the fixed delay the receives at 0, 4, 8, 12 and 16 s
    # would all fall inside the outage and the sixth would move the notice to the DLQ.
    "gcs-unreachable": GcsFault(
        "the GCS address refuses connections (the TCP forwarder in front of it closes its listener and resets "
        "open connections) for 20 s after the notice is received, then accepts again", 20.0, False),
    "gcs-restart": GcsFault(
        "SIGKILL of the head's gcs_server on a Redis-backed head (GCS fault tolerance, as KubeRay sets it up), "
        "the head going down with it; 30 s after the notice is received (past one GCS call's steps, which wait "
        "for the GCS: 10 s, and up to ~10 s more inside Ray) the head is started again with the same command line "
        "(the fault's end), its GCS reloading the cluster from Redis",
        30.0, False, restart=True),
    "gcs-restart-after-drain": GcsFault(
        "SIGKILL of the head's gcs_server on a Redis-backed head as soon as a replica has drained the node, while "
        "it waits for the checkpoint (saved 1 s later); the head is started again 30 s later, its GCS reloading "
        "the cluster (the run claim held in the GCS KV included) from Redis", 30.0, False, when="drained",
        restart=True),
}


class TcpForwarder:
    """A TCP forwarder in front of the GCS (the daemons' ``--ray-address``), on its own loop's thread.

    :meth:`refuse` makes the address unreachable: the listener is closed (a connect is refused)
    and every open connection is reset; :meth:`accept` listens again on the same port. gRPC is
    bytes on a TCP stream to it, so forwarding changes nothing else.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: tuple[str, int]) -> None:
        self.loop = loop
        self.upstream = upstream
        self.port = 0
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def start(self) -> TcpForwarder:
        self._run(self._listen())
        return self

    def refuse(self) -> None:
        self._run(self._close())

    def accept(self) -> None:
        self._run(self._listen())

    def stop(self) -> None:
        self._run(self._close())

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()  # RST: the peer sees the connection reset
        self._open.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        for w in (writer, up_writer):
            self._open.discard(w)
            w.close()


class RayWorld:
    """A :class:`World` (moto, the fault proxy) plus a local Ray cluster and ray-mode replicas."""

    def __init__(self, w: World, cluster: LocalRayCluster) -> None:
        self.w = w
        self.cluster = cluster
        #: the daemons reach the GCS through it (its port is their --ray-address)
        self.forwarder = TcpForwarder(w.kube.loop, ("127.0.0.1", cluster.gcs_port)).start()
        self.stopped_gcs: list[int] = []
        self.token_file = w.workdir / "ray-token"
        self.token_file.write_text(cluster.auth_token)
        self.token_file.chmod(0o600)
        self.workers: dict[int, LocalRayNode] = {}

    # ------------------------------------------------------------------ Ray
    def add_worker(self, n: int) -> LocalRayNode:
        """The worker node on ``instance(n)``, labelled as the drill labels a Spot worker."""
        node = self.cluster.add_node(labels={
            INSTANCE_ID_LABEL: instance(n), CAPACITY_TYPE_LABEL: "spot",
            INSTANCE_TYPE_LABEL: "p5.48xlarge", ZONE_LABEL: f"{REGION}a"}, num_cpus=1)
        self.workers[n] = node
        return node

    def gcs_pid(self) -> int:
        """The head's ``gcs_server`` process."""
        assert self.cluster.head is not None
        for pid in self.cluster.processes(self.cluster.head):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server":
                    return pid
            except OSError:
                continue
        raise AssertionError("no gcs_server process on the head")

    def gcs_log(self) -> str:
        logs = self.cluster.temp_dir / "session_latest" / "logs"
        return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("gcs_server*.out")))

    def drain_requests(self, node_id: str) -> list[str]:
        """The DrainNode requests the GCS handled for ``node_id`` (its own log lines)."""
        return [line for line in self.gcs_log().splitlines() if "HandleDrainNode" in line and node_id in line]

    def draining_deadline_ms(self, node_id: str) -> int | None:
        for info in self.cluster.nodes():
            if info.node_id == node_id:
                return info.draining_deadline_ms
        return None

    def done_run_claims(self, event_id: str) -> list[Any]:
        """The done run claims of ``event_id`` in the GCS KV, read with the daemon's own store."""
        from resilienced.ray.claims import RayKvClaims
        from resilienced.ray.gcs import RayGcs

        claims = RayKvClaims(kv=RayGcs(self.cluster.address, token=self.cluster.auth_token))
        return asyncio.run(claims.done(f"run/{event_id}/"))

    # ------------------------------------------------------------------ daemons
    def start_replica(self, *, wait: bool = True) -> DaemonProcess:
        w = self.w
        env = {**FAKE_CREDENTIALS, "AWS_DEFAULT_REGION": REGION, "PYTHONUNBUFFERED": "1",
               "HOSTNAME": f"ray-replica-{len(w.replicas) + len(w.retired)}", "RAY_USAGE_STATS_ENABLED": "0"}
        argv = ["-m", "resilienced", "run", "--queue-url", w.queue_url, "--region", REGION,
                "--endpoint-url", w.aws_proxy.url, "--mode", "ray",
                "--ray-address", f"127.0.0.1:{self.forwarder.port}",
                "--ray-token-file", str(self.token_file), "--checkpoint-uri", CHECKPOINT_URI,
                "--wait-seconds", "1", "--visibility-timeout", str(w.visibility), "--http-port", "0",
                "--http-host", "127.0.0.1", "--allowed-accounts", ACCOUNT, "--durable-poll-seconds", "0.2"]
        daemon = DaemonProcess(argv, env=env)
        daemon.hostname = env["HOSTNAME"]  # type: ignore[attr-defined]
        w.replicas.append(daemon)
        if wait:
            w.wait_started(daemon)
        return daemon

    def lines(self, event: str) -> list[dict[str, Any]]:
        return [line for d in (*self.w.retired, *self.w.replicas) for line in d.lines if line.get("event") == event]


@contextmanager
def ray_world(workdir: Path, *, moto: Any = None, redis_address: str | None = None) -> Iterator[RayWorld]:
    """The world, a started Ray cluster (head only: workers come per trial), all stopped after.

    ``redis_address``: the head keeps the GCS's state there (GCS fault tolerance)."""
    # Ray's unix sockets live under the cluster's temp dir: it must be short, whatever ``workdir`` is
    raydir = Path(tempfile.mkdtemp(prefix="gcs-", dir="/tmp"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, raydir, True)
        w = stack.enter_context(world(workdir, moto=moto))
        cluster = LocalRayCluster(workdir=raydir, env={"RAY_USAGE_STATS_ENABLED": "0"}, redis_address=redis_address)
        stack.callback(cluster.stop)
        cluster.start()
        rw = RayWorld(w, cluster)
        stack.callback(rw.forwarder.stop)

        def resume() -> None:  # never leave a stopped GCS behind (its cluster could not stop)
            for pid in rw.stopped_gcs:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        stack.callback(resume)
        yield rw


def _notice(n: int) -> dict[str, Any]:
    return notice(n, event_id=str(uuid.uuid4()), when=datetime.now(timezone.utc))


def _inject(rw: RayWorld, name: str) -> Any:
    """Start fault ``name``; the function that ends it."""
    if name == "gcs-unreachable":
        rw.forwarder.refuse()
        return rw.forwarder.accept
    if GCS_FAULTS[name].restart:
        os.kill(rw.gcs_pid(), signal.SIGKILL)  # the head's `ray start --block` ends the rest of the head

        def restart() -> None:
            rw.cluster.restart_head()
        return restart
    pid = rw.gcs_pid()
    os.kill(pid, signal.SIGSTOP)
    rw.stopped_gcs.append(pid)

    def resume() -> None:
        os.kill(pid, signal.SIGCONT)
        rw.stopped_gcs.remove(pid)
    return resume


def gcs_trial(rw: RayWorld, n: int, name: str, *, step: int) -> dict[str, Any]:
    """One notice for the busy worker of ``instance(n)`` while the GCS is stopped; what was seen."""
    w = rw.w
    fault = GCS_FAULTS[name]
    node = rw.workers[n]
    event = _notice(n)
    seen: list[tuple[int, str]] = []

    def polled() -> None:
        seen.extend(w.readyz(d) for d in w.replicas)

    def save() -> None:  # the trainer's save (after the notice: the notice's time is whole seconds)
        w.put_checkpoint(RUN, step=step, saved=datetime.now(timezone.utc) + timedelta(seconds=1))

    if fault.when == "notice":
        save()
        end = _inject(rw, name)
        stopped = time.monotonic()
        w.send([json.dumps(event)])

        def received() -> bool:
            polled()
            return w.queue_counts() == (0, 1)
        w.wait(received, timeout=60, what=f"trial {n} ({name}): a replica to receive the notice", every=0.2)
        held_from = time.monotonic()
    else:  # "drained": no checkpoint yet; the fault starts at the drain's log line
        w.send([json.dumps(event)])

        def drained() -> bool:
            return any(line.get("node_id") == node.node_id for line in rw.lines("ray drain"))
        w.wait(drained, timeout=60, what=f"trial {n} ({name}): a replica to drain the node")
        end = _inject(rw, name)
        stopped = held_from = time.monotonic()
        w.wait(lambda: time.monotonic() - held_from >= 1.0, timeout=10, what="a second")
        save()

    def held() -> bool:
        polled()
        return time.monotonic() - held_from >= fault.hold_s
    w.wait(held, timeout=fault.hold_s + 30, what="the fault's hold", every=0.2)
    # the fault's end: SIGCONT, the address reachable again, or the head's restart begun (its
    # new GCS serves before the new head node is ALIVE, which is when end() returns then)
    resumed = time.monotonic()
    resumed_at = datetime.now(timezone.utc)
    end()
    ended = time.monotonic()
    ready: list[float] = []

    def all_ready() -> bool:
        if not ready and all(w.readyz(d)[0] == 200 for d in w.replicas):
            ready.append(time.monotonic() - resumed)
        return bool(ready)

    def decided() -> list[dict[str, Any]]:
        return [line for line in rw.lines("decision") if line.get("event_id") == event["id"]
                and line.get("outcome") == "done"]

    def done() -> bool:
        all_ready()
        return bool(rw.done_run_claims(event["id"])) and w.queue_counts() == (0, 0) and bool(decided())
    w.wait(done, timeout=float(os.environ.get("CHAOS_TRIAL_TIMEOUT", "600")),
           what=f"trial {n} ({name}): the run claim done, the message deleted and decided", every=0.5)
    took = time.monotonic() - resumed
    draining = rw.draining_deadline_ms(node.node_id)  # while the node is busy: an idle drained node exits
    try:
        w.wait(all_ready, timeout=120, what=f"every replica ready again after {name}", every=0.2)
        ready_again: float | None = round(ready[0], 1)
    except AssertionError:
        ready_again = None
    unready = [(status, reason) for status, reason in seen if status != 200]
    final = decided()
    return {"event_id": event["id"], "instance": instance(n), "node_id": node.node_id,
            "stopped_s": round(resumed - stopped, 1),
            # how long ending the fault took (a head restart: until the new head is ALIVE)
            "ending_s": round(ended - resumed, 1),
            "draining_deadline_ms": draining,
            # from the fault's end to the decision line of the run's message (written once it is
            # deleted, the run claim done), and to that seen here (polled every 0.5 s)
            "decided_s": round((datetime.fromisoformat(final[0]["timestamp"])
                                - resumed_at).total_seconds(), 2) if final else None,
            "recover_s": round(took, 1),
            "readyz": {"polls": len(seen), "unready": len(unready),
                       "reasons": sorted({r[:160] for _, r in unready})[:3], "ready_again_s": ready_again}}


def _deadline_ms(text: str) -> int:
    return int(datetime.fromisoformat(text).timestamp() * 1000)


def check_trial(rw: RayWorld, name: str, seen: dict[str, Any], tally: Tally) -> None:
    """The trial's invariants (after the replicas stopped: every log line read)."""
    event_id, node_id = seen["event_id"], seen["node_id"]
    drains = rw.drain_requests(node_id)
    sent = [line for line in rw.lines("ray drain") if line.get("node_id") == node_id]
    outcomes = [line.get("outcome") for line in sent]
    claims = rw.done_run_claims(event_id)
    record = claims[0].details if claims else {}
    runs = [r for line in rw.lines("recovery") if line.get("event_id") == event_id for r in line.get("runs", [])]
    requeues = [r for r in runs if "requeue" in r]
    signal_step = record.get("signal") or {}
    want_ms = _deadline_ms(signal_step["deadline"]) if signal_step.get("deadline") else None
    have_ms = seen["draining_deadline_ms"]
    decisions = [d for d in rw.w.decisions() if d.get("event_id") == event_id]
    final = [d for d in decisions if d.get("outcome") in ("done", "not_actionable", "failed", "ignored")]
    verified = (record.get("durable") or {}).get("verified") is True
    # ray mode records a step as a log line (resilienced/ray/cluster.py ``record``)
    records = [line for d in (*rw.w.retired, *rw.w.replicas) for line in d.lines
               if line.get("instance_id") == seen["instance"] and line.get("reason")]
    seen["records"] = {reason: sum(1 for line in records if line["reason"] == reason)
                       for reason in ("Draining", "CheckpointDurable", "CheckpointNotDurable")}
    seen["claims_lost"] = [line.get("reason") for line in rw.lines("claim lost")
                           if event_id in str(line.get("key"))]
    seen.update(drain_requests=len(drains), drain_outcomes=outcomes, run_claims_done=len(claims),
                requeue_steps=len(requeues), checkpoint_verified=verified,
                notice_deadline_ms=want_ms,
                decisions=[(d.get("outcome"), d.get("receive_count"), (d.get("reason") or "")[:160])
                           for d in decisions])
    tally.duplicate_drains += max(0, len(drains) - 1)
    tally.duplicate_requeues += max(0, len(requeues) - 1)
    problems = []
    if len(drains) != 1:
        problems.append(f"{len(drains)} DrainNode requests on the GCS for the node (want 1)")
    if outcomes.count("drained") != 1:
        problems.append(f"ray drain outcomes {outcomes} (want one 'drained')")
    if want_ms is None or have_ms != want_ms:
        problems.append(f"the node drains with deadline {have_ms} ms, the notice's is {want_ms} ms")
    if len(claims) != 1 or not verified:
        problems.append(f"{len(claims)} done run claims, checkpoint verified {verified} (want 1, True)")
    if len(requeues) != 1:
        problems.append(f"{len(requeues)} requeue steps for the event (want 1)")
    if len(final) != 1 or final[0].get("outcome") != "done":
        problems.append(f"final decisions {[d.get('outcome') for d in final]} (want one done)")
    for problem in problems:
        tally.violations.append(f"{name}: {problem}")
    readyz = seen["readyz"]
    if any(not reason for reason in readyz["reasons"]):
        tally.violations.append(f"{name}: /readyz said not ready without a reason: {readyz}")
    if readyz["ready_again_s"] is None:
        tally.violations.append(f"{name}: /readyz not ready 120 s after the GCS resumed: {readyz}")


def scenario_gcs(workdir: Path, *, quick: bool, moto: Any = None) -> Tally:
    """The GCS faults (the --quick subset, or all), two ray-mode replicas, one busy worker a trial.

    The faults that restart the head run on a Redis-backed cluster of their own (a second world),
    or are reported skipped in ``extra["skipped"]`` when no ``redis-server`` is on the PATH."""
    names = [k for k, fault in GCS_FAULTS.items() if fault.quick or not quick]
    tally = Tally("gcs", "; ".join(f"{k}: {GCS_FAULTS[k].what}" for k in names))
    seen: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    plain = [k for k in names if not GCS_FAULTS[k].restart]
    restarts = [k for k in names if GCS_FAULTS[k].restart]
    if plain:
        with ray_world(workdir, moto=moto) as rw:
            _trials(rw, plain, tally, seen)
    if restarts and REDIS_SERVER is None:
        for name in restarts:
            skipped[name] = ("not run: redis-server is not on the PATH (GCS fault tolerance needs a Redis; "
                             "`make chaos` installs Debian's redis-server)")
    elif restarts:
        with redis_server() as address, ray_world(workdir / "redis", redis_address=address) as rw:
            _trials(rw, restarts, tally, seen)
    # ray mode records a step as a log line and does not keep the once-per-(run, reason, notice)
    # rule of kubernetes mode's Events: a retry after the GCS came back logs the step again
    tally.extra["repeated_records"] = sum(max(0, c - 1) for t in seen.values() for c in t.get("records", {}).values())
    tally.extra.update(faults=[k for k in names if k not in skipped], skipped=skipped, trials=seen)
    return tally


def _trials(rw: RayWorld, names: list[str], tally: Tally, seen: dict[str, dict[str, Any]]) -> None:
    """Faults ``names`` one after the other in world ``rw``, then their invariants (added to ``tally``)."""
    for k, _name in enumerate(names, start=1):
        rw.add_worker(k)
    daemons = [rw.start_replica(wait=False) for _ in range(2)]
    for daemon in daemons:
        rw.w.wait_started(daemon)
    for k, name in enumerate(names, start=1):
        tally.injected += 1
        try:
            with busy(rw.cluster, rw.workers[k].node_id, detached=GCS_FAULTS[name].restart):
                seen[name] = gcs_trial(rw, k, name, step=10 * k)
        except AssertionError as e:
            tally.violations.append(f"{name}: {e}")
            continue
        tally.survived += 1
        tally.recover_s.append(seen[name]["recover_s"])
    rw.w.stop_replicas()
    for name in names:
        if name not in seen:
            continue
        before = len(tally.violations)
        check_trial(rw, name, seen[name], tally)
        if len(tally.violations) > before:
            tally.survived -= 1
    past = tally.past_redrive
    check_past_redrive(rw.w, tally)
    tally.past_redrive += past
    dead = rw.w.dead_letters()
    tally.events_lost += len(dead)
    if dead:
        tally.violations.append(f"{len(dead)} notices dead-lettered: {[m['Body'][:120] for m in dead]}")
    tally.extra["gcs_errors"] = tally.extra.get("gcs_errors", 0) + sum(
        1 for d in (*rw.w.retired, *rw.w.replicas) for line in d.lines if "ray-gcs" in json.dumps(line))
