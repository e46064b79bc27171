"""``resilienced status``: what the daemon did, read back from where it records it.

Every run the daemon handles for an event ends in a done claim ``run/<event id>/<run>`` whose
details are the run's record (:mod:`resilienced.ops.run_record`): in kubernetes mode a Lease in
``--claims-namespace`` (annotation ``resilienced.io/details``), in ray mode a record in the Ray
cluster's GCS KV.  ``status`` lists them, one row per (event, run): time, kind, instance(s),
run, outcome, the run's stage since the requeue (its follow-up, :mod:`resilienced.followup.rules`:
``admitted``, ``scheduled``, ``joined``, ``training``, or how it ended: ``resumed``, ``stuck``,
``superseded``), checkpoint step, durable or not, steps lost, the recovery's ledger (``LOST``
GPU-hours, ``PREMIUM`` USD over Spot, ``GOODPUT``: :mod:`resilienced.ops.ledger`), capacity.  It only reads: one Lease list (the
``list`` verb the daemon's Role already has: claims and follow-ups are Leases side by side), or
GCS KV key listings and gets.

The mode comes from ``--mode`` (env ``RESILIENCED_MODE``, as the daemon's ConfigMap sets it, so
``kubectl exec deploy/resilienced -- resilienced status`` works in the pod), or from
``--kubeconfig`` / ``--ray-address`` when given.  Done claims are kept for the dedupe window
(``--dedupe-seconds``, 24 h), so that is as far back as ``status`` sees.

Exit status: 0 (also when there is nothing to show), 2 on a usage error, 1 when the claim store
does not answer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from resilienced.clock import parse_time, utcnow
from resilienced import log
from resilienced.errors import ConfigError, RecordError
from resilienced.model import JsonValue
from resilienced.ops.run_record import RUN_PREFIX, RunRecord
from resilienced.settings import Mode, ModeSettings

MODE_FLAGS = ("mode", "kubeconfig", "kube_context", "claims_namespace", "ray_address",
              "ray_token_file")
#: Table columns: (title, summary field).
COLUMNS = (("TIME", "time"), ("KIND", "kind"), ("INSTANCES", "instances"), ("RUN", "run"),
           ("OUTCOME", "outcome"), ("STAGE", "stage"), ("STEP", "checkpoint_step"), ("DURABLE", "durable"),
           ("STEPS_LOST", "steps_lost"), ("LOST", "lost_gpu_hours"), ("PREMIUM", "premium_usd"),
           ("GOODPUT", "goodput"), ("CAPACITY", "capacity"), ("EVENT", "event_id"))
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    parser.add_argument("--since", metavar="AGE|TIME", type=since,
                        help="only what was done in the last AGE (90s, 30m, 2h, 7d) or after an "
                             "ISO-8601 TIME")
    ModeSettings.add_arguments(parser, only=MODE_FLAGS)


def since(value: str, *, now: datetime | None = None) -> datetime:
    """The cutoff a ``--since`` value means (argparse type: a ValueError is a usage error)."""
    now = now or utcnow()
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*", value)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])
    try:
        moment = parse_time(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an age (90s, 30m, 2h, 7d) or an ISO-8601 time, got {value!r}") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} has no time zone (add Z or +00:00)")
    return moment


def mode_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> ModeSettings:
    """The mode to read from: --kubeconfig or --ray-address decide, else --mode / its env."""
    mode = ModeSettings.from_args(args, environ)
    if getattr(args, "kubeconfig", None) and getattr(args, "ray_address", None):
        raise ConfigError("--ray-address", "give --kubeconfig (kubernetes mode) or --ray-address "
                                           "(ray mode), not both")
    if getattr(args, "kubeconfig", None):
        mode = dataclasses.replace(mode, mode=Mode.KUBERNETES)
    elif getattr(args, "ray_address", None):
        mode = dataclasses.replace(mode, mode=Mode.RAY)
    if mode.mode is Mode.PLAN:
        raise ConfigError("--mode", "status reads the claims of kubernetes or ray mode: give --mode "
                                    "kubernetes (or --kubeconfig) or --ray-address")
    mode.validate()
    return mode


async def records(mode: ModeSettings) -> tuple[list[tuple[str, dict[str, JsonValue]]], list[dict[str, JsonValue]]]:
    """(claim key, details) of every done run claim in the mode's claim store, and every follow-up."""
    if mode.mode is Mode.KUBERNETES:
        from resilienced.kube.api import connect
        from resilienced.kube.followup_store import KubeFollowUps
        from resilienced.kube.leases import KubeLeaseClaims

        api = await connect(kubeconfig=mode.kubeconfig, context=mode.kube_context)
        try:  # one list: the claims and the follow-ups are Leases of the daemon, side by side
            store = KubeLeaseClaims(api, namespace=mode.claims_namespace)
            leases = await store.leases()
            claims = await store.done(RUN_PREFIX, leases=leases)
            follow_ups = KubeFollowUps.records_in(leases)
        finally:
            await api.close()
    else:
        from resilienced.ray.claims import RayKvClaims
        from resilienced.ray.followup_store import RayKvFollowUps
        from resilienced.ray.gcs import RayGcs
        from resilienced.app.runtime import read_token

        ray = RayGcs(mode.ray_address, token=read_token(mode.ray_token_file))
        claims = await RayKvClaims(kv=ray).done(RUN_PREFIX)
        follow_ups = await RayKvFollowUps(kv=ray).all()
    return [(claim.key, dict(claim.details)) for claim in claims], [record for record, _ in follow_ups]


def stage_of(record: Mapping[str, JsonValue]) -> str:
    """A follow-up's stage as status shows it: the stage while followed, else how it ended."""
    state = record.get("state") or "following"
    return str(record.get("stage")) if state == "following" else str(state)


def rows(found: Sequence[tuple[str, Mapping[str, JsonValue]]], *, after: datetime | None = None,
         follow_ups: Sequence[Mapping[str, JsonValue]] = ()) -> list[dict[str, JsonValue]]:
    """One summary per record, oldest first; ``after``: only those done at or after it.

    A record whose steps are not of the form the daemon writes is left out, with a warning naming
    its claim and the field (``resilienced.errors.RecordError``).  A row whose (event, run) has a follow-up gets its ``stage``, ``training_again_s`` (notice ->
    the first step trained again, once resumed) and ``fallbacks`` (the moves made); others
    ``stage`` None (not followed: the follow-up is off, or the run was not placed).
    """
    followed = {(r.get("event_id"), r.get("run")): r for r in follow_ups}
    out = []
    for key, details in found:
        try:
            row = RunRecord.from_json(details).summary(key=key)
        except RecordError as e:  # one record of the wrong form hides no other (stderr names it)
            log.get("resilienced.status").warning("unreadable run record", key=key, error=str(e))
            continue
        record = followed.get((row["event_id"], row["run"]))
        row["stage"] = stage_of(record) if record else None
        row["training_again_s"] = _training_again(record) if record else None
        row["fallbacks"] = list((record or {}).get("fallbacks") or [])
        row.update(ledger_cells(record, event_id=row["event_id"]))
        moment = _parse(row["time"])
        if after is not None and (moment is None or moment < after):
            continue
        out.append(row)
    return sorted(out, key=lambda r: (r["time"] or "", r["run"] or ""))


def ledger_cells(record: Mapping[str, JsonValue] | None, *, event_id: object) -> dict[str, JsonValue]:
    """The row's ledger (``resilienced.ops.ledger``, kept in the follow-up record once its recovery ended):
    ``LOST`` in GPU-hours, ``PREMIUM`` in USD over Spot, the run's ``GOODPUT``; ``ledger`` the whole (``--json``)."""
    found = next((led for led in reversed(list((record or {}).get("ledgers") or []))  # type: ignore[arg-type]
                  if led.get("event_id") == event_id), None)
    if found is None:
        return {"lost_gpu_hours": None, "premium_usd": None, "goodput": None, "ledger": None}
    lost = found.get("lost_gpu_seconds")
    premium = found.get("premium_usd")
    return {"lost_gpu_hours": None if lost is None else round(float(lost) / 3600, 3),  # type: ignore[arg-type]
            "premium_usd": None if premium is None else round(float(premium), 2),  # type: ignore[arg-type]
            "goodput": found.get("goodput"), "ledger": found}


def _training_again(record: Mapping[str, JsonValue]) -> float | None:
    trained = _parse((record.get("reached") or {}).get("training"))
    notice = _parse(record.get("notice_at"))
    return None if trained is None or notice is None else round((trained - notice).total_seconds(), 3)


def _parse(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return parse_time(value)
    except ValueError:
        return None


def main(args: argparse.Namespace) -> int:
    from resilienced.app.replay import table

    mode = mode_settings(args, os.environ)
    log.configure(level="warning", stream=sys.stderr)
    found, follow_ups = asyncio.run(records(mode))
    shown = rows(found, after=args.since, follow_ups=follow_ups)
    if not shown:
        print("no runs handled" + (" since then" if args.since else "") + " (done claims are "
              "kept for --dedupe-seconds)", file=sys.stderr)
    elif args.json:
        sys.stdout.writelines(json.dumps(row, default=str) + "\n" for row in shown)
    else:
        sys.stdout.write(table(shown, COLUMNS))
    return 0
