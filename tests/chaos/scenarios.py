"""The campaign's scenarios: each injects its faults into a :class:`World` and returns its tally.

A tally is what docs/reliability.md tabulates: how many faults, how many survived, events lost,
duplicate drains, duplicate requeues, messages received past the redrive count, and the time to
recover once the fault ended. Each scenario checks its invariants itself and lists every
violation in ``violations`` (empty when the daemon held up); the tests assert that list is empty.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from collections.abc import Callable
from typing import Any

from resilienced.capacity.request import ANNOTATION_RESERVATION
from resilienced.kube.leases import DETAILS_ANNOTATION, KEY_ANNOTATION, STATE_ANNOTATION, STATE_DONE, lease_name
from tests.chaos import flood as flood_mod
from tests.chaos.world import BLOCK_TAGS, BUCKET, MAX_RECEIVES, World, expiry_notice, instance, notice, world
from tests.support.ec2blocks import Offering
from tests.support.faultproxy import aws_action, path_contains


@dataclass
class Tally:
    scenario: str
    fault: str
    injected: int = 0
    survived: int = 0
    events_lost: int = 0
    duplicate_drains: int = 0
    duplicate_requeues: int = 0
    past_redrive: int = 0
    recover_s: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- process probes
def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return count


def _probe(w: World, peaks: dict[str, int]) -> None:
    for daemon in w.replicas:
        try:
            peaks["rss_kib"] = max(peaks.get("rss_kib", 0), rss_kib(daemon.proc.pid))
            peaks["sockets"] = max(peaks.get("sockets", 0), open_sockets(daemon.proc.pid))
        except (FileNotFoundError, ProcessLookupError):
            continue


# --------------------------------------------------------------------------- run-level counts
def run_counts(w: World, n: int) -> dict[str, int]:
    """What was done to run ``trial-n``, from the emulator's request log and its Events.

    ``drains``: successful patches of its Node (the taint; its Ray head is on that Node, so no
    Ray node is drained); ``requeues``: successful writes of its RayJob; ``drained_events`` ...:
    the counts of its Draining, CheckpointDurable and Requeued Events.
    """
    requests = w.kube.call(lambda: list(w.kube.server.requests))

    def writes(resource: str, name: str, namespace: str | None) -> int:
        return sum(1 for r in requests if r.verb in ("patch", "update") and r.resource == resource
                   and r.name == name and r.namespace == namespace and 200 <= r.status < 300)

    def events(reason: str) -> int:
        return sum(e.get("count", 1) for e in w.run_events(n, reason))
    return {"drains": writes("nodes", f"node-{n}", None), "requeues": writes("rayjobs.ray.io", "train", f"trial-{n}"),
            "drained_events": events("Draining"), "durable_events": events("CheckpointDurable"),
            "requeued_events": events("Requeued")}


def check_runs(w: World, runs: list[int], tally: Tally) -> None:
    """Each run drained once and requeued once, each of its Events recorded once (a replica taking
    it over, or a retry, does not record the work again)."""
    repeated = 0
    for n in runs:
        got = run_counts(w, n)
        tally.duplicate_drains += max(0, got["drains"] - 1)
        tally.duplicate_requeues += max(0, got["requeues"] - 1)
        repeated += sum(max(0, got[k] - 1) for k in ("drained_events", "durable_events", "requeued_events"))
        verified = _verified(w, n)
        if got["drains"] != 1 or got["requeues"] != 1 or not verified:
            tally.violations.append(f"run trial-{n}/train: {got}, verified {verified}: want one drain, "
                                    "one requeue, and a done run claim with the checkpoint verified")
        if 0 in (got["drained_events"], got["durable_events"], got["requeued_events"]):
            tally.extra.setdefault("missing_events", []).append(f"trial-{n}: {got}")
    tally.extra["repeated_events"] = tally.extra.get("repeated_events", 0) + repeated
    if repeated:  # each Event is recorded once per (run, reason, notice), whoever does the work
        tally.violations.append(f"{repeated} repeated Events (Draining / CheckpointDurable / Requeued)")


def _verified(w: World, n: int) -> bool:
    """Run n's claim is done and its record says the checkpoint was verified durable."""
    leases = w.kube.call(w.kube.server.list, "leases", namespace="resilienced")
    for lease in leases:
        notes = lease["metadata"].get("annotations", {})
        if notes.get(KEY_ANNOTATION, "").endswith(f"/trial-{n}/train") and notes.get(STATE_ANNOTATION) == STATE_DONE:
            record = json.loads(notes.get(DETAILS_ANNOTATION, "{}"))
            if (record.get("durable") or {}).get("verified") is True:
                return True
    return False


def check_past_redrive(w: World, tally: Tally) -> None:
    over = [d for d in w.decisions() if d.get("receive_count", 0) > MAX_RECEIVES]
    tally.past_redrive = len(over)
    if over:
        tally.violations.append(f"{len(over)} decisions past receive {MAX_RECEIVES}: {over[:3]}")


# --------------------------------------------------------------------------- scenario 3
#: --stale-after-seconds of the flood's replicas (the default, 300 s, is shorter than the time moto
#: takes to pass a 5,000-message flood: the runs' notices would be judged stale before their turn)
FLOOD_STALE_AFTER_S = 3600


def scenario_flood(workdir: Path, *, total: int, runs: int, moto: Any = None) -> Tally:
    """Scenario 3 (see tests/chaos/flood.py for the mix)."""
    plan = flood_mod.build(total, runs=runs)
    tally = Tally("flood", f"{total} messages, {len(plan.valid_ids)} valid events; replica SIGKILLed halfway",
                  injected=total)
    peaks: dict[str, int] = {}
    with world(workdir, moto=moto) as w:
        for n in plan.runs:
            w.seed_run(n)
        # The notices are stamped when the flood is built, and moto takes minutes over thousands of
        # messages (docs/reliability.md, scenario 3): the replicas judge a notice stale only an hour
        # after its deadline, so the runs' notices are still acted on when their turn comes (the
        # mix's stale and future notices are 3 days old and 6 h ahead: still judged stale).
        a, _b = [w.start_replica("--stale-after-seconds", str(FLOOD_STALE_AFTER_S), wait=False)
                 for _ in range(2)]
        for daemon in (a, _b):
            w.wait_started(daemon)
        now = datetime.now(timezone.utc)
        for n in plan.runs:  # the trainers' saves after the notices' time, in S3 before they are read
            w.put_checkpoint(n, step=7, saved=now)
        w.send(plan.bodies)

        def handled() -> int:
            _probe(w, peaks)
            return w.decided()
        w.wait(lambda: handled() >= total // 2, timeout=1800, what="half the flood to be handled", every=0.5)
        w.kill(a)
        killed_at = time.monotonic()

        tally.extra["bad"] = sum(1 for v in plan.label.values() if v == "bad")

        def drained() -> bool:
            _probe(w, peaks)
            return w.queue_counts() == (0, 0)
        w.wait(drained, timeout=1800, what="the queue to be empty", every=1.0)
        tally.recover_s.append(round(time.monotonic() - killed_at, 1))
        w.stop_replicas()
        dead = w.dead_letters()
        _check_flood(w, plan, dead, tally)
        check_runs(w, plan.runs, tally)
        check_past_redrive(w, tally)
        tally.extra.update(peak_rss_mib=round(peaks.get("rss_kib", 0) / 1024, 1),
                           peak_open_sockets=peaks.get("sockets", 0), dead_lettered=len(dead),
                           decisions=len(w.decisions()))
    tally.survived = total - tally.events_lost - len([v for v in tally.violations if v.startswith("bad")])
    return tally


def done_claims(w: World, prefix: str) -> set[str]:
    """Keys of the claims in state done (the Leases in the daemon namespace)."""
    leases = w.kube.call(w.kube.server.list, "leases", namespace="resilienced")
    notes = [lease["metadata"].get("annotations", {}) for lease in leases]
    return {n[KEY_ANNOTATION] for n in notes
            if n.get(KEY_ANNOTATION, "").startswith(prefix) and n.get(STATE_ANNOTATION) == STATE_DONE}


#: messages one replica can hold unsettled: --concurrency (10) handled, a batch of 10 waiting
IN_FLIGHT_BOUND = 20


def _check_flood(w: World, plan: flood_mod.Flood, dead: list[dict[str, Any]], tally: Tally) -> None:
    dead_bodies = Counter(m["Body"] for m in dead)
    for body, count in dead_bodies.items():
        if plan.label.get(body) != "bad":
            tally.events_lost += count
            tally.violations.append(f"valid message dead-lettered: {body[:200]}")
    missing = [b for b, label in plan.label.items() if label == "bad" and b not in dead_bodies]
    if missing:
        tally.violations.append(f"bad messages not in the DLQ: {len(missing)}, e.g. {missing[0][:200]!r} "
                                f"(queue now {w.queue_counts()}, DLQ {w.queue_counts(w.dlq_url)}, "
                                f"as (visible, in flight); {len(dead)} read from the DLQ)")
    decisions = w.decisions()
    final = Counter(d["event_id"] for d in decisions if d.get("outcome") in flood_mod.FINAL)
    seen = {d["event_id"] for d in decisions}
    # an event is claimed by its event claim, or (one run hit: issue #45) by its run's claim
    claimed = done_claims(w, "event/") | {"event/" + k.split("/")[1] for k in done_claims(w, "run/")}
    unlogged, unclaimed = 0, []
    for event_id in plan.valid_ids:
        if final[event_id] > 1:
            tally.violations.append(f"event {event_id} decided {final[event_id]} times")
        elif final[event_id] == 0 and event_id not in seen:
            if f"event/{event_id}" in claimed:  # done, but SIGKILLed between the delete and the log line
                unlogged += 1
            elif event_id in plan.run_ids:  # it hit a job: it is claimed before any work, so lost
                tally.events_lost += 1
                tally.violations.append(f"event {event_id} hit a job and has neither a decision nor a done claim")
            else:  # no claim to show for it (not actionable: stale, future, no Node)
                unclaimed.append(event_id)
    # The queue is empty and the DLQ holds only bad messages, so every valid message was deleted,
    # which a replica does only once its work is done: an event without a decision line was
    # decided by the killed replica, which died before writing the line. At most what one replica
    # has in flight (``--concurrency`` 10, and a received batch of 10 waiting for a slot).
    if unlogged + len(unclaimed) > IN_FLIGHT_BOUND:
        tally.events_lost += len(unclaimed)
        tally.violations.append(f"{unlogged + len(unclaimed)} events without a decision line, more than one "
                                f"replica has in flight ({IN_FLIGHT_BOUND}); without a done claim: {unclaimed[:5]}")
    tally.extra.update(decided_but_unlogged=unlogged, unlogged_without_claim=len(unclaimed))
    unexplained = [d for d in decisions if d.get("outcome") in flood_mod.BAD and not d.get("reason")]
    if unexplained:
        tally.violations.append(f"{len(unexplained)} bad messages without a logged reason")
    why = {d["message_id"]: d.get("reason") or "" for d in decisions if d.get("outcome") in flood_mod.BAD}
    tally.extra["dlq_by_reason"] = dict(Counter(
        _reason_kind(why[m["MessageId"]]) if m["MessageId"] in why else "no decision line" for m in dead
    ).most_common())


def _reason_kind(reason: str) -> str:
    """A logged reason without its particulars (quoted values, numbers, the parenthesised detail):
    what the DLQ contents are grouped by."""
    reason = re.sub(r"\s*\(.*$", "", reason.splitlines()[0] if reason else "")
    reason = re.sub(r"'[^']*'?|\"[^\"]*\"?", "…", reason)
    return re.sub(r"\b\d+\b", "N", reason)[:100] or "(empty)"


# --------------------------------------------------------------------------- scenario 1
#: where a replica dies: the hold that keeps it there (verb, resource) and the condition to kill on
PHASES = ("claimed", "drained", "durability-wait", "requeued")


def _holder(w: World, n: int) -> Any:
    """The replica holding run ``trial-n``'s claim (by the HOSTNAME prefix of its holder identity):
    its run claim, or its move claim, which a followed run's handling holds from its start, standing
    for the run claim (docs/reliability.md, "Fewer claims per run")."""
    leases = w.kube.call(w.kube.server.list, "leases", namespace="resilienced")
    for lease in leases:
        notes = lease["metadata"].get("annotations", {})
        key = notes.get(KEY_ANNOTATION, "")
        if notes.get(STATE_ANNOTATION) != "done" and (
                key == f"move/trial-{n}/train" or key.startswith("run/") and key.endswith(f"/trial-{n}/train")):
            holder = lease["spec"].get("holderIdentity", "")
            for daemon in w.replicas:
                if holder.startswith(daemon.hostname + ":"):
                    return daemon
    return None


def _arm(w: World, phase: str, *, run_key: str) -> Any:
    server = w.kube.server
    if phase == "claimed":  # the run is claimed; its Node's taint is held
        return w.kube.call(server.delay, 3600, verb="patch", resource="nodes")
    if phase == "drained":  # drained (tainted); the Draining Event is held
        return w.kube.call(server.delay, 3600, verb="create", resource="events")
    if phase == "requeued":  # the run claim's write is held: it is written done after the requeue (a create,
        # under the move claim; an update completing it for a run led under its run claim)
        w.kube.call(server.delay, 3600, verb="update", resource="leases", name=lease_name(run_key))
        return w.kube.call(server.delay, 3600, verb="create", resource="leases", name=lease_name(run_key))
    return None  # durability-wait: nothing held; no checkpoint yet


def _reached(w: World, n: int, phase: str, hold: Any) -> bool:
    if phase == "durability-wait":
        return bool(w.run_events(n, "Draining"))
    if phase == "requeued":
        return bool(w.run_events(n, "Requeued")) and hold.hits > 0
    return hold.hits > 0


def kill_trial(w: World, n: int, phase: str, *, pause: float) -> float:
    """One notice for run n; SIGKILL its handler at ``phase``; the seconds until it is whole again."""
    w.seed_run(n)
    event = notice_for(n)
    hold = _arm(w, phase, run_key=f"run/{event['id']}/trial-{n}/train")
    if phase != "durability-wait":
        w.put_checkpoint(n, step=3, saved=datetime.now(timezone.utc) + timedelta(seconds=1))
    w.send([json.dumps(event)])
    w.wait(lambda: _reached(w, n, phase, hold), timeout=120, what=f"trial {n} to reach {phase}")
    time.sleep(pause)  # a different timing inside the phase each repeat (the hold keeps it there)
    victim = _holder(w, n)
    if victim is None:
        raise AssertionError(f"trial {n}: no live replica holds the run's claim at {phase}")
    w.kill(victim)
    w.kube.call(w.kube.server.clear_faults)
    ended = time.monotonic()
    if phase == "durability-wait":
        w.put_checkpoint(n, step=3, saved=datetime.now(timezone.utc))
    w.start_replica(wait=False)  # the pod is restarted, as its Deployment would (the other replica goes on)
    w.wait(lambda: run_counts(w, n)["requeued_events"] >= 1 and w.queue_counts() == (0, 0),
           timeout=float(os.environ.get("CHAOS_TRIAL_TIMEOUT", "900")), what=f"trial {n} ({phase}) to be requeued and its message deleted")
    return time.monotonic() - ended


def notice_for(n: int) -> dict[str, Any]:
    return notice(n, event_id=str(uuid.uuid4()), when=datetime.now(timezone.utc))


def _finish(w: World, trials: list[int], tally: Tally) -> None:
    """Stop the replicas; count drains, requeues, receives past the redrive count, dead letters."""
    w.stop_replicas()
    check_runs(w, trials, tally)
    check_past_redrive(w, tally)
    dead = w.dead_letters()
    tally.events_lost = len(dead)
    if dead:
        tally.violations.append(f"{len(dead)} notices dead-lettered: {[m['Body'][:120] for m in dead]}")


def scenario_kill(workdir: Path, *, repeats: int, moto: Any = None) -> Tally:
    """Scenario 1: each phase ``repeats`` times, with a different pause inside the phase each time."""
    tally = Tally("kill", "SIGKILL of the replica holding the run, at " + ", ".join(PHASES))
    trials: list[int] = []
    with world(workdir, moto=moto) as w:
        w.start_replicas(2)
        for r in range(repeats):
            for k, phase in enumerate(PHASES):
                n = 1 + r * len(PHASES) + k
                trials.append(n)
                tally.injected += 1
                try:
                    took = kill_trial(w, n, phase, pause=0.3 * r)
                except AssertionError as e:
                    tally.violations.append(f"trial {n} ({phase}): {e}")
                    continue
                tally.survived += 1
                tally.recover_s.append(round(took, 1))
        _finish(w, trials, tally)
    return tally


# --------------------------------------------------------------------------- scenario 2
def _sqs(*actions: str) -> Any:
    return aws_action(*actions)


#: fault name -> (how it is injected, arm(world) -> rule with ``hits``/``times``); ``quick``: in --quick
#: (one fault per backend: SQS, S3, EC2, the Kubernetes API and its watches; the full form runs all)
BACKEND_FAULTS: dict[str, tuple[str, Callable[[World], Any], bool]] = {
    "sqs-503": ("proxy: 503 ServiceUnavailable on 12 SQS ReceiveMessage/DeleteMessage",
                lambda w: w.kube.call(w.aws_proxy.fail, 503, code="ServiceUnavailable", times=12,
                                      match=_sqs("ReceiveMessage", "DeleteMessage")), True),
    "sqs-reset": ("proxy: connection reset on 8 SQS requests",
                  lambda w: w.kube.call(w.aws_proxy.reset, times=8, match=_sqs(
                      "ReceiveMessage", "DeleteMessage", "ChangeMessageVisibility")), False),
    "s3-500": ("proxy: 500 InternalError on 10 S3 requests",
               lambda w: w.kube.call(w.aws_proxy.fail, 500, times=10, match=path_contains(f"/{BUCKET}")), True),
    "s3-stall": ("proxy: 2 S3 requests held 35 s (past the 30 s read timeout)",
                 lambda w: w.kube.call(w.aws_proxy.stall, 35, times=2, match=path_contains(f"/{BUCKET}")), False),
    "ec2-throttle": ("proxy: RequestLimitExceeded (HTTP 503) on 6 DescribeCapacityReservations (no block)",
                     lambda w: w.kube.call(w.aws_proxy.fail, 503, code="RequestLimitExceeded", times=6,
                                           match=aws_action("DescribeCapacityReservations")), False),
    "sqs-throttle": ("proxy: 400 RequestThrottled (SQS's JSON error) on 12 SQS ReceiveMessage/DeleteMessage/"
                     "ChangeMessageVisibility",
                     lambda w: w.kube.call(w.aws_proxy.fail, 400, code="RequestThrottled", style="json", times=12,
                                           match=_sqs("ReceiveMessage", "DeleteMessage",
                                                      "ChangeMessageVisibility")), False),
    "sqs-stall": ("proxy: 2 SQS ReceiveMessage held 45 s (past the 40 s read timeout of the SQS client)",
                  lambda w: w.kube.call(w.aws_proxy.stall, 45, times=2, match=_sqs("ReceiveMessage")), False),
    "s3-throttle": ("proxy: 503 SlowDown (S3's error) on 10 S3 requests",
                    lambda w: w.kube.call(w.aws_proxy.fail, 503, code="SlowDown", style="s3", times=10,
                                          match=path_contains(f"/{BUCKET}")), False),
    "s3-reset": ("proxy: connection reset on 6 S3 requests",
                 lambda w: w.kube.call(w.aws_proxy.reset, times=6, match=path_contains(f"/{BUCKET}")), False),
    "kube-500-node": ("emulator: 500 on 4 Node patches", lambda w: w.kube.call(
        w.kube.server.fail, verb="patch", resource="nodes", status=500, times=4), False),
    "kube-429-rayjob": ("emulator: 429 Retry-After 1 on 4 RayJob patches", lambda w: w.kube.call(
        w.kube.server.fail, verb="patch", resource="rayjobs.ray.io", status=429, retry_after=1, times=4), True),
    "kube-drop-lease": ("emulator: connection dropped on 4 Lease creates", lambda w: w.kube.call(
        w.kube.server.fail, verb="create", resource="leases", status=0, times=4), False),
    "kube-stall-events": ("emulator: 2 Event creates held 70 s", lambda w: w.kube.call(
        w.kube.server.delay, 70, verb="create", resource="events", times=2), False),
}


# EC2 with Capacity Blocks. The scenario's replicas run with BLOCK_FLAGS (one interruption makes
# a pool's Spot unreliable; a block with room first; buying on) against Karpenter's
# NodePool/EC2NodeClass (world.py): a run either goes to a block with room that the EC2NodeClass
# lists ("block"), or, with no block with room, to a block it buys from the one offering ("buy"),
# or leaves its expiring block for another ("expiry"); see EC2_SETUP and tests/support/ec2blocks.py.
#: fault kind -> (HTTP status, EC2 error code); "reset": the connection closed with no answer
_EC2_FAULTS = {"503": (503, "RequestLimitExceeded"), "500": (500, "InternalError"), "reset": (0, "")}
#: the EC2 call each group of faults hits, the world it needs, and how often it is injected: a
#: Describe call is retried by botocore (3 retries: 4 requests a call), so 6 faults fail one call
#: of the daemon (and 2 requests of the next); PurchaseCapacityBlock is sent once per attempt
#: (resilienced/capacity/ec2.py), so 2
_EC2_CALLS = {"instances": ("DescribeInstances", "expiry", 6),
              "reservations": ("DescribeCapacityReservations", "block", 6),
              "offerings": ("DescribeCapacityBlockOfferings", "buy", 6),
              "purchase": ("PurchaseCapacityBlock", "buy", 2)}
#: fault name -> "block" | "buy" | "expiry" (what the trial sets up in the EC2 stand-in, and
#: checks after; "expiry": the run is on a block about to end, whose instances the daemon asks EC2
#: for, and moves to another block with room)
EC2_SETUP: dict[str, str] = {}


def _ec2_fault(action: str, kind: str, times: int) -> Callable[[World], Any]:
    status, code = _EC2_FAULTS[kind]
    if kind == "reset":
        return lambda w: w.kube.call(w.aws_proxy.reset, times=times, match=aws_action(action))
    return lambda w: w.kube.call(w.aws_proxy.fail, status, code=code, style="ec2", times=times,
                                 match=aws_action(action))


for _call, (_action, _setup, _times) in _EC2_CALLS.items():
    for _kind, (_status, _code) in _EC2_FAULTS.items():
        _name = f"ec2-{_call}-{_kind}"
        _how = "connection reset" if _kind == "reset" else f"{_status} {_code}"
        _world = {"block": "a Capacity Block with room", "buy": "no block with room, one offering to buy",
                  "expiry": "the run's block expiring, another with room"}[_setup]
        BACKEND_FAULTS[_name] = (f"proxy: {_how} on {_times} {_action} ({_world})",
                                 _ec2_fault(_action, _kind, _times), _name == "ec2-reservations-503")
        EC2_SETUP[_name] = _setup
BACKEND_FAULTS["ec2-reservations-stall"] = (
    "proxy: 2 DescribeCapacityReservations held 35 s, past the 30 s read timeout (a Capacity Block with room)",
    lambda w: w.kube.call(w.aws_proxy.stall, 35, times=2, match=aws_action("DescribeCapacityReservations")), False)
EC2_SETUP["ec2-reservations-stall"] = "block"
BACKEND_FAULTS["ec2-purchase-answer-lost"] = (
    "proxy: PurchaseCapacityBlock served (the block bought), then the connection reset before the answer "
    "(no block with room, one offering to buy)",
    lambda w: w.kube.call(w.aws_proxy.lose, times=1, match=aws_action("PurchaseCapacityBlock")), False)
EC2_SETUP["ec2-purchase-answer-lost"] = "buy"

#: what scenario 2's replicas run with: Spot of a pool is unreliable after one interruption, and a
#: block is bought (for real, within the cap) when no block has room; bought blocks carry the tags
#: the EC2NodeClass selects on; a run waiting for a block just bought is retried after 1 s; a block
#: with room goes before Spot (a run leaving an expiring block need not have seen an interruption)
BLOCK_FLAGS = ("--interruption-threshold", "1", "--prefer-blocks", "true",
               "--purchase-blocks", "true", "--price-cap", "5000",
               "--purchase-dry-run", "false", "--wait-retry", "1s",
               "--purchase-tags", ",".join(f"{k}={v}" for k, v in BLOCK_TAGS.items()))
OFFERING_FEE = "3120.00"


def ec2_setup(w: World, name: str, n: int) -> dict[str, Any]:
    """Before trial ``name``: every block so far is full (the runs requeued onto it hold it), no
    offering; then a block with room ("block"), one offering ("buy"), or a block holding run n's
    instance that ends in 40 min and a block with room ("expiry"). What to check after."""
    setup = EC2_SETUP.get(name)

    def prepare() -> dict[str, Any]:
        for block in w.ec2.blocks:
            block.available = 0
        w.ec2.offerings.clear()
        out: dict[str, Any] = {"setup": setup, "purchases_before": len(w.ec2.purchases)}
        if setup == "expiry":  # run n's instance is in a block ending in 40 min (the warning's lead)
            old = w.ec2.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=1, available=0,
                                  hours=40 / 60, tags=BLOCK_TAGS, instances=[instance(n)])
            out.update(old_block=old.reservation_id, old_end=old.end)
        if setup in ("block", "expiry"):
            out["block"] = w.ec2.add_block(instance_type="p5.48xlarge", availability_zone="us-east-1a", total=4,
                                           hours=48, tags=BLOCK_TAGS).reservation_id
        elif setup == "buy":
            w.ec2.offerings.append(Offering(f"cb-{len(w.ec2.purchases) + 1:017x}", "p5.48xlarge", "us-east-1a",
                                            OFFERING_FEE))
        return out
    return w.kube.call(prepare)


def check_ec2(w: World, n: int, name: str, expect: dict[str, Any], tally: Tally) -> None:
    """The run went onto the block ("block", "expiry": the one with room, nothing bought; "buy":
    the one bought, once), as its RayJob's worker groups and reservation annotation say."""
    if expect.get("setup") is None:
        return
    purchases = w.kube.call(lambda: list(w.ec2.purchases[expect["purchases_before"]:]))
    job = w.kube.call(w.kube.server.get, "rayjobs.ray.io", "train", namespace=f"trial-{n}") or {}
    notes = job.get("metadata", {}).get("annotations", {})
    groups = job.get("spec", {}).get("rayClusterSpec", {}).get("workerGroupSpecs", [])
    selectors = [g.get("template", {}).get("spec", {}).get("nodeSelector", {}) for g in groups]
    want = expect.get("block") if expect["setup"] in ("block", "expiry") else (purchases[0]["reservation_id"] if purchases else None)
    on = {s.get("karpenter.k8s.aws/capacity-reservation-id") for s in selectors}
    record = {"purchases": len(purchases), "annotation": notes.get(ANNOTATION_RESERVATION),
              "worker_selector_reservations": sorted(map(str, on))}
    tally.extra.setdefault("ec2", {})[name] = record
    if expect["setup"] == "buy" and len(purchases) != 1:
        tally.violations.append(f"{name}: {len(purchases)} Capacity Blocks bought for one run, want 1: {purchases}")
    if expect["setup"] in ("block", "expiry") and purchases:
        tally.violations.append(f"{name}: bought {len(purchases)} blocks although one had room: {purchases}")
    if want is None or on != {want} or record["annotation"] != want:
        tally.violations.append(f"{name}: the run's worker groups are not placed on {want}: {record}")


class _Once:
    """A one-shot fault (watch 410): its ``hits`` reach ``times`` once it has been applied."""

    def __init__(self, apply: Callable[[], None]) -> None:
        apply()
        self.hits = self.times = 1


BACKEND_FAULTS["kube-watch-410"] = (
    "emulator: every watch ended with ERROR 410 Gone (history compacted), then a new run appears",
    lambda w: _Once(lambda: w.kube.call(w.kube.server.expire_watches)), True)


#: faults armed until spent before the trial's notice is sent: a receive held while the notice
#: waits (otherwise a replica in its long poll at the arming takes the notice first, and the stall
#: hits a receive after the work is done)
HELD_BEFORE_THE_NOTICE = ("sqs-stall",)

#: the faults during which a replica may say it is not ready: /readyz is about the queue (SQS)
UNREADY_OK = ("sqs-",)


def fault_trial(w: World, n: int, name: str, expect: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """Arm ``name``, send a notice for a new run n; once the fault is spent, the seconds to recover.

    Also what the replicas' ``/readyz`` said while the fault lasted (polled), and after.
    ``expect`` (:func:`ec2_setup`) with an ``old_block``: the run is on that block and the notice
    is its expiration warning.
    """
    rule = BACKEND_FAULTS[name][1](w)
    if name in HELD_BEFORE_THE_NOTICE:  # every replica's receive held before the notice is there
        w.wait(lambda: rule.hits >= rule.times, timeout=60, what=f"{name}: every replica's receive held")
    old = (expect or {}).get("old_block")
    w.seed_run(n, reservation=old)
    w.put_checkpoint(n, step=3, saved=datetime.now(timezone.utc) + timedelta(seconds=1))
    now = datetime.now(timezone.utc)
    event = notice_for(n) if old is None else expiry_notice(
        old, end=(expect or {})["old_end"], event_id=f"{old}-approaching-expiry", when=now)
    w.send([json.dumps(event)])
    seen: list[tuple[int, str]] = []

    def spent() -> bool:
        seen.extend(w.readyz(d) for d in w.replicas)
        return rule.hits >= rule.times
    w.wait(spent, timeout=600, what=f"fault {name} to be spent", every=0.2)
    ended = time.monotonic()
    ready: list[float] = []  # when every replica first said ready after the fault ended

    def all_ready() -> bool:
        if not ready and all(w.readyz(d)[0] == 200 for d in w.replicas):
            ready.append(time.monotonic() - ended)
        return bool(ready)

    def recovered() -> bool:
        all_ready()
        return run_counts(w, n)["requeued_events"] >= 1 and w.queue_counts() == (0, 0)
    w.wait(recovered, timeout=float(os.environ.get("CHAOS_TRIAL_TIMEOUT", "900")),
           what=f"trial {n} ({name}) to be requeued and its message deleted")
    took = time.monotonic() - ended
    unready = [(status, reason) for status, reason in seen if status != 200]
    # a replica whose last receive failed says so until its next receive, after its backoff
    try:
        w.wait(all_ready, timeout=120, what=f"every replica ready again after {name}", every=0.2)
        ready_again: float | None = round(ready[0], 1)
    except AssertionError:
        ready_again = None
    return took, {"polls": len(seen), "unready": len(unready), "reasons": sorted({r[:160] for _, r in unready})[:3],
                  "ready_again_s": ready_again, "injected": rule.hits}


def check_readyz(name: str, readyz: dict[str, Any], tally: Tally) -> None:
    """Unready only for a queue fault, and then saying why; ready again once it is over (the time
    from the fault's end to every replica ready is ``ready_again_s``)."""
    if readyz["unready"] and not name.startswith(UNREADY_OK):
        tally.violations.append(f"{name}: /readyz said not ready during a fault of another backend: {readyz}")
    if any(not reason for reason in readyz["reasons"]):
        tally.violations.append(f"{name}: /readyz said not ready without a reason: {readyz}")
    if readyz["ready_again_s"] is None:
        tally.violations.append(f"{name}: /readyz not ready 120 s after the fault ended: {readyz}")


def select_faults(*, quick: bool, only: list[str] | None = None) -> list[str]:
    """The faults to run: the --quick subset or all; ``only``: those whose name starts with one of
    these (``--faults`` of the campaign, e.g. ``ec2-`` or ``ec2-purchase-answer-lost``)."""
    names = [k for k, (_, _, in_quick) in BACKEND_FAULTS.items() if in_quick or not quick]
    if only:
        names = [k for k in BACKEND_FAULTS if any(k.startswith(prefix) for prefix in only)]
        if not names:
            raise ValueError(f"no backend fault starts with {only}; the faults: {', '.join(BACKEND_FAULTS)}")
    return names


def scenario_backends(workdir: Path, *, quick: bool, moto: Any = None, only: list[str] | None = None) -> Tally:
    """Scenario 2: each backend fault once (the --quick subset, or all, or ``only``), two replicas
    with BLOCK_FLAGS against Karpenter's objects (a fault not about EC2 sees no block, no offering)."""
    names = select_faults(quick=quick, only=only)
    tally = Tally("backends", "; ".join(f"{k}: {BACKEND_FAULTS[k][0]}" for k in names))
    trials: list[int] = []
    with world(workdir, moto=moto, karpenter=True) as w:
        w.start_replicas(2, *BLOCK_FLAGS)
        for k, name in enumerate(names, start=1):
            trials.append(k)
            tally.injected += 1
            expect = ec2_setup(w, name, k)
            try:
                took, readyz = fault_trial(w, k, name, expect)
            except AssertionError as e:
                tally.violations.append(f"{name}: {e}")
                continue
            tally.recover_s.append(round(took, 1))
            tally.survived += 1
            tally.extra.setdefault("readyz", {})[name] = readyz
            tally.extra.setdefault("injected", {})[name] = readyz.pop("injected")
            check_readyz(name, readyz, tally)
            violations = len(tally.violations)
            check_ec2(w, k, name, expect, tally)
            if len(tally.violations) > violations:
                tally.survived -= 1
        _finish(w, trials, tally)
        tally.extra["faults"] = names
        tally.extra["purchases"] = w.kube.call(lambda: len(w.ec2.purchases))
        tally.extra["ec2_calls_answered"] = w.kube.call(lambda: dict(w.ec2.calls))  # by the stand-in, faults not counted
    return tally

