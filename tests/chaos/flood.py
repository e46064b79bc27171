"""Scenario 3: a flood of notices mixed with bad input, two replicas, one SIGKILLed halfway.

The mix (of ``total`` messages): 20 % duplicates of valid notices (same event id; every third
with a changed body), 10 % malformed, 10 % forged, 5 % stale or future timestamps, the rest
valid notices for many instances, a few of which run a job (``runs``). Each message is labelled
with what it must become: ``valid`` (decided exactly once, never dead-lettered) or ``bad`` (in
the DLQ after the redrive count, its reason logged).
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from tests.chaos.world import ACCOUNT, REGION, instance, notice

#: final outcomes of a handled event (``duplicate`` and ``retry`` are not decisions of the event)
FINAL = {"done", "not_actionable", "failed", "ignored"}
BAD = {"invalid", "undecodable"}


@dataclass
class Flood:
    bodies: list[str] = field(default_factory=list)
    label: dict[str, str] = field(default_factory=dict)  # body -> valid | bad
    valid_ids: set[str] = field(default_factory=set)
    runs: list[int] = field(default_factory=list)  # trial numbers whose instance has a job
    run_ids: set[str] = field(default_factory=set)  # event ids of the notices that hit a job

    def add(self, body: str, label: str, event_id: str | None = None) -> None:
        self.bodies.append(body)
        self.label[body] = label
        if label == "valid" and event_id:
            self.valid_ids.add(event_id)


def _malformed(rng: random.Random, n: int, now: datetime) -> str:
    good = json.dumps(notice(10_000 + n, event_id=str(uuid.UUID(int=rng.getrandbits(128))), when=now))
    choices = [
        lambda: "not json at all " + str(n),
        lambda: good[: len(good) // 2],  # truncated
        lambda: json.dumps({**json.loads(good), "detail": {"instance-id": 12345, "pad": "x" * 200_000}}),
        lambda: json.dumps({**json.loads(good), "detail": ["wrong", "type"]}),
        lambda: json.dumps({**json.loads(good), "time": 17}),
        lambda: json.dumps({"Type": "Notification", "Message": "{garbage " + str(n), "TopicArn": "arn:x"}),
        lambda: json.dumps({"Type": "Notification", "Message": json.dumps([1, 2, n])}),
        lambda: "\x00\x01binary\x02" + str(n),
    ]
    return choices[n % len(choices)]()


def _forged(rng: random.Random, n: int, now: datetime) -> str:
    event_id = str(uuid.UUID(int=rng.getrandbits(128)))
    base = notice(20_000 + n, event_id=event_id, when=now)
    choices = [
        lambda: {**base, "account": "999999999999"},
        lambda: {**base, "source": "custom.attacker"},
        lambda: {**base, "id": f"../../{n}\n{{\"x\":1}}"},
        lambda: {**base, "detail": {"instance-id": f"i-0123'; DROP TABLE {n};--", "instance-action": "terminate"}},
        lambda: {**base, "region": "../etc/passwd"},
    ]
    return json.dumps(choices[n % len(choices)]())


def build(total: int, *, runs: int, seed: int = 14) -> Flood:
    rng = random.Random(seed)
    now = datetime.now(timezone.utc)
    flood = Flood(runs=list(range(1, runs + 1)))
    n_dup, n_bad, n_forged, n_odd = total // 5, total // 10, total // 10, total // 20
    n_valid = total - n_dup - n_bad - n_forged - n_odd
    originals: list[dict[str, Any]] = []
    for k in range(n_valid):
        target = flood.runs[k] if k < runs else 1_000 + k  # the first ones hit a job, the rest no Node
        event = notice(target, event_id=str(uuid.UUID(int=rng.getrandbits(128))), when=now)
        originals.append(event)
        flood.add(json.dumps(event), "valid", event["id"])
        if k < runs:
            flood.run_ids.add(event["id"])
    for k in range(n_dup):
        event = dict(rng.choice(originals))
        if k % 3 == 0:  # a changed body under the same event id
            event["resources"] = [f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{event['detail']['instance-id']}"]
        flood.add(json.dumps(event) + " " * (k % 7 + 1), "valid", event["id"])  # distinct bodies
    for k in range(n_odd):
        when = now - timedelta(days=3) if k % 2 else now + timedelta(hours=6)
        event = notice(5_000 + k, event_id=str(uuid.UUID(int=rng.getrandbits(128))), when=when)
        flood.add(json.dumps(event), "valid", event["id"])
    for k in range(n_bad):
        flood.add(_malformed(rng, k, now) + " " * (k // 8), "bad")
    for k in range(n_forged):
        flood.add(_forged(rng, k, now) + " " * (k // 5), "bad")
    rng.shuffle(flood.bodies)
    return flood
