"""Kubernetes Events next to the objects an operator looks at: the Node, the RayJob or RayCluster.

core/v1 Events, not events.k8s.io/v1: ``kubectl describe`` and ``kubectl get events`` show them,
field selectors on ``involvedObject.*`` find them, and the legacy ``count`` /
``firstTimestamp`` / ``lastTimestamp`` fields carry repeats without the ``series`` bookkeeping of
the newer API.  (On a real API server both APIs are views of the same objects.)  Each Event names
its object with ``uid`` and carries ``reportingComponent: resilienced.io/resilienced`` and
``reportingInstance: <replica>``.

Repeats do not spam: an Event's name is the object's name plus a hash of (object uid, type,
reason, message, replica), so the same notice recorded again (a redelivered message, a retry)
finds its Event and bumps ``count`` and ``lastTimestamp`` with a merge patch instead of adding
one.  An Event recorded ``once`` for a key (the recovery passes the interruption's event id) is
one per (object, type, reason, key) for every replica: its name hashes those only, and recording
it again (a retry, a redelivery, another replica taking the run over) leaves it as it is.  A replica remembers the counts it wrote; after a restart, or when another replica wrote it,
the create answers 409 and the Event is read once before the patch.  Verbs: create, get, patch.
Events of cluster-scoped Nodes go to the ``default`` namespace, as the kubelet's do.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes_asyncio import client as k8s

from resilienced.clock import utcnow
from resilienced.kube.api import MERGE_PATCH, KubeStatusError, call

REPORTING_CONTROLLER = "resilienced.io/resilienced"
SOURCE_COMPONENT = "resilienced"
NODE_EVENT_NAMESPACE = "default"
MESSAGE_LIMIT = 1024


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about (its ``involvedObject``)."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str | None = None  # None for cluster-scoped objects (Nodes)

    def as_json(self) -> dict[str, str]:
        ref = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}
        if self.namespace:
            ref["namespace"] = self.namespace
        return ref


def _timestamp(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Writes deduplicated core/v1 Events as one replica of resilienced."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        replica: str,
        request_timeout_s: float = 10.0,
        clock: Callable[[], datetime] = utcnow,
        remember: int = 4096,
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self.replica = replica
        self._timeout = request_timeout_s
        self._clock = clock
        self._remember = remember
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        # one writer per Event name in this replica: concurrent emits of the same Event (a burst
        # of notices for one run) queue here instead of racing create/409/get/patch and losing
        # count increments
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def event_name(self, ref: ObjectRef, *, reason: str, message: str, kind: str, once: str | None = None) -> str:
        parts = (ref.uid or ref.name, kind, reason, "once", once) if once is not None else (
            ref.uid or ref.name, kind, reason, message, self.replica)
        digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
        return f"{ref.name[:200]}.{digest}"

    async def emit(self, ref: ObjectRef, *, reason: str, message: str, warning: bool = False,
                   once: str | None = None) -> str:
        """Record (or count again) one Event about ``ref``; returns the Event's name.

        ``once``: a key (an event id) that makes this Event one per (object, type, reason, key)
        across replicas; when it exists already it is left as it is (not counted again).
        """
        kind = "Warning" if warning else "Normal"
        message = message[:MESSAGE_LIMIT]
        namespace = ref.namespace or NODE_EVENT_NAMESPACE
        name = self.event_name(ref, reason=reason, message=message, kind=kind, once=once)
        if len(self._locks) > self._remember:  # forget the locks nobody holds
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            return await self._emit(ref, namespace=namespace, name=name, reason=reason,
                                    message=message, kind=kind, once=once is not None)

    async def _emit(self, ref: ObjectRef, *, namespace: str, name: str, reason: str, message: str,
                    kind: str, once: bool) -> str:
        now = _timestamp(self._clock())
        known = self._counts.get((namespace, name))
        if known is not None and once:
            return name
        if known is not None:
            if await self._bump(namespace=namespace, name=name, count=known + 1, now=now):
                return name
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": ref.as_json(),
            "reason": reason,
            "message": message,
            "type": kind,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": SOURCE_COMPONENT},
            "reportingComponent": REPORTING_CONTROLLER,
            "reportingInstance": self.replica,
            "action": reason,
        }
        try:
            await call(verb="create", resource="events", request=self._core.create_namespaced_event(
                namespace, body, _preload_content=False, _request_timeout=self._timeout))
            self._remember_count(namespace=namespace, name=name, count=1)
            return name
        except KubeStatusError as err:
            if err.status != 409:
                raise
        if once:  # recorded already, by this replica before a restart or by another one
            self._remember_count(namespace=namespace, name=name, count=1)
            return name
        current = await call(verb="get", resource="events", request=self._core.read_namespaced_event(
            name, namespace, _preload_content=False, _request_timeout=self._timeout))
        await self._bump(namespace=namespace, name=name, count=int(current.get("count") or 1) + 1, now=now)
        return name

    async def _bump(self, *, namespace: str, name: str, count: int, now: str) -> bool:
        """Patch count and lastTimestamp; False when the Event is gone (expired: create it again)."""
        try:
            await call(verb="patch", resource="events", request=self._core.patch_namespaced_event(
                name, namespace, {"count": count, "lastTimestamp": now},
                _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=self._timeout))
        except KubeStatusError as err:
            if err.status == 404:
                self._counts.pop((namespace, name), None)
                return False
            raise
        self._remember_count(namespace=namespace, name=name, count=count)
        return True

    def _remember_count(self, *, namespace: str, name: str, count: int) -> None:
        self._counts[(namespace, name)] = count
        self._counts.move_to_end((namespace, name))
        while len(self._counts) > self._remember:
            self._counts.popitem(last=False)


def ref_for(obj: Mapping[str, object], *, api_version: str, kind: str) -> ObjectRef:
    meta = obj.get("metadata") or {}
    assert isinstance(meta, Mapping)
    return ObjectRef(
        api_version=api_version, kind=kind, name=str(meta.get("name") or ""), uid=str(meta.get("uid") or ""),
        namespace=str(meta["namespace"]) if meta.get("namespace") else None,
    )
