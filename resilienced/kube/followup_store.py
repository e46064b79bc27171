"""Kubernetes mode: each run's follow-up (``resilienced.followup.rules.FollowUp``) in a Lease.

The follow-up of a requeued run lives next to the run claims, in ``--claims-namespace``: one
coordination.k8s.io/v1 Lease per run, named ``resilienced-fu-<first 20 hex of sha256(run)>``,
labelled ``app.kubernetes.io/managed-by=resilienced`` and ``resilienced.io/record=follow-up``,
the record as JSON in the annotation ``resilienced.io/follow-up`` and the run in
``resilienced.io/run``.  A write is a merge patch carrying the resourceVersion the record was read
at, a precondition (409: someone wrote it first: :meth:`put` returns None), so two replicas never
both record one move; a create that meets 409 AlreadyExists returns None too.  Not an update
(PUT): kube-apiserver creates a Lease that a PUT names and does not find (v1.37.2
pkg/registry/coordination/lease/strategy.go ``AllowCreateOnUpdate``), so a write at the version of
a record another replica had deleted brought the record back; a patch of a missing Lease is 404
(found on the real API server, issue #40: tests/ray/test_followup_contract.py).  The Lease's spec is not used
as a lease (the per-run move claim is a run claim, ``resilienced.kube.leases``).

Verbs: create, get, patch, delete, list on leases in that namespace (the daemon's Role has them,
with update for its claims).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from kubernetes_asyncio import client as k8s

from resilienced.kube.api import MERGE_PATCH, KubeStatusError, call
from resilienced.kube.leases import MANAGED_BY
from resilienced.log import get as get_logger
from resilienced.model import JsonValue

log = get_logger(__name__)

RECORD_ANNOTATION = "resilienced.io/follow-up"
RUN_ANNOTATION = "resilienced.io/run"
KIND_LABEL = {"resilienced.io/record": "follow-up"}


def lease_name(run: str) -> str:
    return "resilienced-fu-" + hashlib.sha256(run.encode()).hexdigest()[:20]


class KubeFollowUps:
    """``ports.FollowUpStore`` on Leases in ``namespace``."""

    def __init__(self, api_client: k8s.ApiClient, *, namespace: str, request_timeout_s: float = 10.0) -> None:
        self._api = k8s.CoordinationV1Api(api_client)
        self.namespace = namespace
        self._timeout = request_timeout_s

    @staticmethod
    def _record(lease: Mapping[str, JsonValue]) -> tuple[dict[str, JsonValue], str] | None:
        meta = lease.get("metadata") or {}
        try:
            record = json.loads((meta.get("annotations") or {}).get(RECORD_ANNOTATION) or "")
            if not isinstance(record, dict):
                raise ValueError(f"not a JSON object but {type(record).__name__}")
        except ValueError as e:  # skipped, and said, as the Ray KV store does (ray/followup_store.py)
            log.warning("follow-up record unreadable", lease=meta.get("name"), error=str(e))
            return None
        return record, str(meta.get("resourceVersion"))

    async def get(self, run: str) -> tuple[dict[str, JsonValue], str] | None:
        try:
            lease = await call(verb="get", resource="leases", request=self._api.read_namespaced_lease(
                lease_name(run), self.namespace, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status == 404:
                return None
            raise
        return self._record(lease)

    def _body(self, run: str, record: Mapping[str, JsonValue], version: str | None) -> dict[str, JsonValue]:
        meta: dict[str, JsonValue] = {
            "name": lease_name(run), "namespace": self.namespace, "labels": {**MANAGED_BY, **KIND_LABEL},
            "annotations": {RUN_ANNOTATION: run,
                            RECORD_ANNOTATION: json.dumps(dict(record), sort_keys=True, default=str)}}
        if version is not None:
            meta["resourceVersion"] = version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": "follow-up"}}

    async def put(self, run: str, record: Mapping[str, JsonValue], *, version: str | None) -> str | None:
        body = self._body(run, record, version)
        try:
            if version is None:
                written = await call(verb="create", resource="leases", request=self._api.create_namespaced_lease(
                    self.namespace, body, _preload_content=False, _request_timeout=self._timeout))
            else:
                written = await call(verb="patch", resource="leases", request=self._api.patch_namespaced_lease(
                    lease_name(run), self.namespace, {"metadata": body["metadata"], "spec": body["spec"]},
                    _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status in (404, 409):
                return None
            raise
        return str((written.get("metadata") or {}).get("resourceVersion"))

    @classmethod
    def records_in(cls, leases: list[dict[str, JsonValue]]) -> list[tuple[dict[str, JsonValue], str]]:
        """The follow-ups among ``leases`` (a list of the daemon's Leases, as ``status`` reads them)."""
        return [r for r in (cls._record(lease) for lease in leases
                            if ((lease.get("metadata") or {}).get("labels") or {}).items() >= KIND_LABEL.items())
                if r is not None]

    async def all(self) -> list[tuple[dict[str, JsonValue], str]]:
        selector = ",".join(f"{k}={v}" for k, v in {**MANAGED_BY, **KIND_LABEL}.items())
        listed = await call(verb="list", resource="leases", request=self._api.list_namespaced_lease(
            self.namespace, label_selector=selector, _preload_content=False, _request_timeout=self._timeout))
        return [r for r in (self._record(lease) for lease in listed.get("items") or []) if r is not None]

    async def delete(self, run: str, *, version: str) -> bool:
        """Delete the record if it is still at ``version``; whether it was deleted."""
        options = {"preconditions": {"resourceVersion": version}}
        try:
            await call(verb="delete", resource="leases", request=self._api.delete_namespaced_lease(
                lease_name(run), self.namespace, body=options, _preload_content=False,
                _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status in (404, 409):
                return False
            raise
        return True
