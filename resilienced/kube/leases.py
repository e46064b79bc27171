"""Cross-replica claims on coordination.k8s.io/v1 Leases (``ports.ClaimStore`` in kubernetes mode).

One Lease per claim key, in one namespace, named ``resilienced-<first 20 hex of sha256(key)>``
(keys are free text; the full key is in the annotation ``resilienced.io/claim-key``)::

    acquire   create the Lease (holderIdentity, leaseDurationSeconds, acquireTime, renewTime,
              annotation resilienced.io/state: held)                      -> the Claim
              409 AlreadyExists: read it:
                state done                                                  -> None
                held by the caller (same holder: one delivery keeping its claim alive while it
                  works)                                                    -> renewed (update
                  with the read resourceVersion: renewTime, leaseDurationSeconds); 409 -> None
                held by another and renewTime + leaseDurationSeconds ahead  -> None (a holder is
                  one delivery, ``<replica>/<message id>``: two deliveries of one event never
                  share a holder)
                held but expired                                            -> take it over by an
                  update carrying the read resourceVersion (leaseTransitions + 1); 409 -> None
    complete  mark done (state done, details as JSON in resilienced.io/details), by update with
              resourceVersion; a 409 re-reads and retries; a vanished Lease is created done;
              nothing when it is done already or another holder's Lease is live (the caller
              lost the claim: the new holder decides)
    release   delete the Lease with uid + resourceVersion preconditions, only when the caller
              holds it and it is not done (a done claim must outlive its holder)
    get       read it back as a Claim (None for a held Lease past its duration: free)

The writer's copy: the store keeps the Lease each of its own writes returned while the claim is
held by the writer (bounded, :data:`MINE_MAX`).  A renewal, a completion or a release by that
holder first writes against that copy's resourceVersion: one request (an update, or a delete with
uid and resourceVersion preconditions), no create answered 409 and no read.  It succeeds only when
nobody wrote the Lease since, so the claim is still the holder's; a 409 or 404 drops the copy and
goes the way above (issue #45: a renewal had cost a create answered 409, a read and an update).

The rules are the ``ports.ClaimStore`` contract (tests/intake/test_claim_contract.py runs it
against this store on the emulated API server).

    done      list the Leases labelled ``app.kubernetes.io/managed-by=resilienced`` and return the
              done ones whose key starts with a prefix (``resilienced status``; read only)
    sweep     list the Leases labelled ``app.kubernetes.io/managed-by=resilienced`` and delete
              the done ones last renewed before a cutoff (the dedupe window), with uid and
              resourceVersion preconditions; held ones are never swept

Verbs: create, get, update, delete, list on leases in that namespace.  Done Leases stay for the
dedupe window (that is what makes a redelivered event a duplicate); the daemon sweeps older ones.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone

from kubernetes_asyncio import client as k8s

from resilienced import retry
from resilienced.clock import parse_time, utcnow
from resilienced.errors import BackendUnavailable
from resilienced.kube.api import BACKEND, KubeStatusError, call
from resilienced.log import get as get_logger
from resilienced.model import JsonValue
from resilienced.ports import Claim

log = get_logger(__name__)

KEY_ANNOTATION = "resilienced.io/claim-key"
STATE_ANNOTATION = "resilienced.io/state"
DETAILS_ANNOTATION = "resilienced.io/details"
MANAGED_BY = {"app.kubernetes.io/managed-by": "resilienced"}
STATE_HELD = "held"
STATE_DONE = "done"
_RETRIES = 5  # reads of a Lease that keeps changing under complete() (resilienced.retry)
MINE_MAX = 4096  # the writer's copies kept (a claim lost or left to lapse is never settled here)


def lease_name(key: str) -> str:
    """The Lease name for a claim key: ``resilienced-`` + 20 hex digits of its SHA-256."""
    return "resilienced-" + hashlib.sha256(key.encode()).hexdigest()[:20]


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return parse_time(value)
    except ValueError:
        return None


class KubeLeaseClaims:
    """ClaimStore on Leases in ``namespace``; ``clock`` is injectable so tests need not sleep."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        namespace: str,
        request_timeout_s: float = 10.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._api = k8s.CoordinationV1Api(api_client)
        self.namespace = namespace
        self._timeout = request_timeout_s
        self._clock = clock
        #: Lease name -> the Lease as our last write left it, while held by its holder (module doc).
        self._mine: OrderedDict[str, dict[str, JsonValue]] = OrderedDict()

    # ------------------------------------------------------------------ helpers
    def _keep(self, lease: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        """Remember ``lease`` (what our write returned) as the writer's copy; returned as given."""
        if lease is not None:
            name = lease["metadata"]["name"]
            self._mine[name] = lease
            self._mine.move_to_end(name)
            while len(self._mine) > MINE_MAX:
                self._mine.popitem(last=False)
        return lease

    def _copy(self, key: str, holder: str) -> dict[str, JsonValue] | None:
        """The writer's copy of ``key``'s Lease when ``holder`` holds it as our last write left it
        (taken out: the caller writes against it and keeps what it gets back)."""
        lease = self._mine.get(lease_name(key))
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != holder:
            return None
        return self._mine.pop(lease_name(key))

    async def _read(self, name: str) -> dict[str, JsonValue] | None:
        try:
            return await call(verb="get", resource="leases", request=self._api.read_namespaced_lease(
                name, self.namespace, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status == 404:
                return None
            raise

    async def _replace(self, lease: Mapping[str, JsonValue]) -> dict[str, JsonValue] | None:
        """Update with the resourceVersion it carries; None when someone changed it first (409)."""
        name = lease["metadata"]["name"]
        try:
            return await call(verb="update", resource="leases", request=self._api.replace_namespaced_lease(
                name, self.namespace, dict(lease), _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status in (404, 409):
                return None
            raise

    def _expired(self, lease: Mapping[str, JsonValue]) -> bool:
        spec = lease.get("spec") or {}
        renewed = _parse_time(spec.get("renewTime")) or _parse_time(spec.get("acquireTime"))
        duration = spec.get("leaseDurationSeconds")
        if renewed is None or not isinstance(duration, int):
            return True
        return renewed + timedelta(seconds=duration) <= self._clock()

    @staticmethod
    def _claim(key: str, lease: Mapping[str, JsonValue]) -> Claim:
        notes = (lease.get("metadata") or {}).get("annotations") or {}
        try:
            details = json.loads(notes.get(DETAILS_ANNOTATION) or "{}")
        except ValueError:
            details = {"unreadable": notes.get(DETAILS_ANNOTATION)}
        return Claim(
            key=notes.get(KEY_ANNOTATION, key),
            holder=(lease.get("spec") or {}).get("holderIdentity") or "",
            state=notes.get(STATE_ANNOTATION, STATE_HELD),
            details=details if isinstance(details, dict) else {"value": details},
        )

    def _body(self, key: str, *, holder: str, ttl_seconds: float, state: str,
              details: Mapping[str, JsonValue] | None = None) -> dict[str, JsonValue]:
        now = _micro_time(self._clock())
        notes = {KEY_ANNOTATION: key, STATE_ANNOTATION: state}
        if details is not None:
            notes[DETAILS_ANNOTATION] = json.dumps(dict(details), sort_keys=True, default=str)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": lease_name(key), "namespace": self.namespace, "labels": dict(MANAGED_BY),
                         "annotations": notes},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": max(1, math.ceil(ttl_seconds)),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }

    async def _create(self, body: Mapping[str, JsonValue]) -> dict[str, JsonValue] | None:
        """Create; None when it exists already (409)."""
        try:
            return await call(verb="create", resource="leases", request=self._api.create_namespaced_lease(
                self.namespace, dict(body), _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status == 409:
                return None
            raise

    # ------------------------------------------------------------------ ClaimStore
    async def acquire(self, key: str, *, holder: str, ttl_seconds: float) -> Claim | None:
        body = self._body(key, holder=holder, ttl_seconds=ttl_seconds, state=STATE_HELD)
        mine = self._copy(key, holder)
        if mine is not None:  # a renewal: one update against our last write (module doc)
            renewed = self._keep(await self._replace(self._renewed(mine, body)))
            if renewed is not None:
                return self._claim(key, renewed)
        created = self._keep(await self._create(body))
        if created is not None:
            return self._claim(key, created)
        current = await self._read(lease_name(key))
        if current is None:  # deleted between our create and read: one more try
            created = self._keep(await self._create(body))
            return self._claim(key, created) if created is not None else None
        notes = (current.get("metadata") or {}).get("annotations") or {}
        if notes.get(STATE_ANNOTATION) == STATE_DONE:
            return None
        spec = current.get("spec") or {}
        if spec.get("holderIdentity") == holder:  # the holder renews its own claim
            renewed = self._keep(await self._replace(self._renewed(current, body)))
            return self._claim(key, renewed) if renewed is not None else None
        if not self._expired(current):
            return None
        takeover = {
            **current,
            "metadata": {**current["metadata"],
                         "annotations": {**notes, KEY_ANNOTATION: key, STATE_ANNOTATION: STATE_HELD}},
            "spec": {**body["spec"], "leaseTransitions": int(spec.get("leaseTransitions") or 0) + 1},
        }
        replaced = self._keep(await self._replace(takeover))
        if replaced is None:
            return None
        log.info("claim taken over (expired)", key=key, previous=spec.get("holderIdentity"), holder=holder)
        return self._claim(key, replaced)

    @staticmethod
    def _renewed(lease: Mapping[str, JsonValue], body: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
        """``lease`` (held by the renewing holder) with ``body``'s renewTime and duration."""
        spec = lease.get("spec") or {}
        return {**lease, "spec": {**spec, "renewTime": body["spec"]["renewTime"],
                                  "leaseDurationSeconds": body["spec"]["leaseDurationSeconds"]}}

    async def get(self, key: str) -> Claim | None:
        lease = await self._read(lease_name(key))
        if lease is None:
            return None
        claim = self._claim(key, lease)
        if claim.state != STATE_DONE and self._expired(lease):
            return None  # its holder did not renew it: free (the next acquire takes it over)
        return claim

    async def complete(self, key: str, *, holder: str, details: Mapping[str, JsonValue]) -> None:
        mine = self._copy(key, holder)
        if mine is not None and await self._replace(self._done(mine, holder=holder, details=details)) is not None:
            return  # nobody wrote it since our last write: ours, held (module doc)
        async for _ in retry.attempts(_RETRIES):  # a 409: read the other writer's Lease again
            current = await self._read(lease_name(key))
            if current is None:
                if await self._create(self._body(key, holder=holder, ttl_seconds=1, state=STATE_DONE, details=details)):
                    return
                continue
            notes = (current.get("metadata") or {}).get("annotations") or {}
            if notes.get(STATE_ANNOTATION) == STATE_DONE:
                return
            if (current.get("spec") or {}).get("holderIdentity") != holder and not self._expired(current):
                return  # taken over after our TTL ran out: the new holder decides
            if await self._replace(self._done(current, holder=holder, details=details)) is not None:
                return
        raise BackendUnavailable(BACKEND, f"complete claim {key}: the Lease kept changing")

    def _done(self, lease: Mapping[str, JsonValue], *, holder: str,
              details: Mapping[str, JsonValue]) -> dict[str, JsonValue]:
        """``lease`` marked done by ``holder`` with ``details``."""
        notes = (lease.get("metadata") or {}).get("annotations") or {}
        return {
            **lease,
            "metadata": {**lease["metadata"], "annotations": {
                **notes, STATE_ANNOTATION: STATE_DONE,
                DETAILS_ANNOTATION: json.dumps(dict(details), sort_keys=True, default=str)}},
            "spec": {**(lease.get("spec") or {}), "holderIdentity": holder, "renewTime": _micro_time(self._clock())},
        }

    async def _delete(self, lease: Mapping[str, JsonValue]) -> bool:
        """Delete ``lease`` on condition that its uid and resourceVersion still match; False: it
        changed or went since (409, 404)."""
        meta = lease["metadata"]
        options = {"preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}}
        try:
            await call(verb="delete", resource="leases", request=self._api.delete_namespaced_lease(
                meta["name"], self.namespace, body=options, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status not in (404, 409):
                raise
            return False
        return True

    async def release(self, key: str, *, holder: str) -> None:
        mine = self._copy(key, holder)
        if mine is not None and await self._delete(mine):
            return  # nobody wrote it since our last write: ours, held (module doc)
        current = await self._read(lease_name(key))
        if current is None:
            return
        notes = (current.get("metadata") or {}).get("annotations") or {}
        if notes.get(STATE_ANNOTATION) == STATE_DONE or (current.get("spec") or {}).get("holderIdentity") != holder:
            return
        await self._delete(current)

    async def _list(self) -> list[dict[str, JsonValue]]:
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        listed = await call(verb="list", resource="leases", request=self._api.list_namespaced_lease(
            self.namespace, label_selector=selector, _preload_content=False, _request_timeout=self._timeout))
        return list(listed.get("items") or [])

    async def leases(self) -> list[dict[str, JsonValue]]:
        """Every Lease labelled ``app.kubernetes.io/managed-by=resilienced`` (the claims and the
        follow-ups of ``resilienced.kube.followup_store``): one list call, for ``resilienced status``."""
        return await self._list()

    async def done(self, prefix: str = "", *, leases: list[dict[str, JsonValue]] | None = None) -> list[Claim]:
        """Every done claim whose key starts with ``prefix`` (one list call, none when ``leases``
        are given; changes nothing)."""
        found = []
        for lease in leases if leases is not None else await self._list():
            notes = (lease.get("metadata") or {}).get("annotations") or {}
            key = notes.get(KEY_ANNOTATION) or ""
            if notes.get(STATE_ANNOTATION) == STATE_DONE and key.startswith(prefix):
                found.append(self._claim(key, lease))
        return found

    async def sweep(self, *, older_than: timedelta) -> int:
        """Delete done claims last renewed more than ``older_than`` ago; return how many."""
        cutoff = self._clock() - older_than
        removed = 0
        for lease in await self._list():
            meta = lease.get("metadata") or {}
            if (meta.get("annotations") or {}).get(STATE_ANNOTATION) != STATE_DONE:
                continue
            renewed = _parse_time((lease.get("spec") or {}).get("renewTime"))
            if renewed is None or renewed >= cutoff:
                continue
            options = {"preconditions": {"uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}}
            try:
                await call(verb="delete", resource="leases", request=self._api.delete_namespaced_lease(
                    meta["name"], self.namespace, body=options, _preload_content=False,
                    _request_timeout=self._timeout))
                removed += 1
            except KubeStatusError as err:
                if err.status not in (404, 409):  # gone already, or changed since the list
                    raise
        return removed

