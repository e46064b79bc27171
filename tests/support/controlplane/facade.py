"""The emulator's object API (tests/support/kubeapi.py ``KubeApiServer``) over the real control plane.

:class:`RealKubeApi` lets a test written against the emulator play its scenario on the real API
server: ``create``, ``seed``, ``put``, ``get``, ``list``, ``patch``, ``delete`` go through the
plane's admin :class:`~tests.support.controlplane.rest.Rest` client; ``api_client()``,
``configuration()``, ``url`` and ``write_kubeconfig`` hand out the plane's own.  A resource is
named as the emulator names it (``pods``, ``leases``, ``rayclusters.ray.io``,
``workloads.kueue.x-k8s.io``) and found through discovery (``/api/v1``, ``/apis``): its group, the
group's preferred version, its scope, whether it has a ``status`` subresource.

What differs from the emulator, on purpose:

* a write with a ``status`` goes through the ``status`` subresource too (the real main resource
  ignores a status; the emulator's direct controls write it in one go);
* the namespaces the tests use (``NAMESPACES``, and any an object names) are created when missing
  and kept (a terminating namespace refuses new objects, and the plane is shared by the process);
* the test controls that only an emulator has (faults, delays, compaction, the request log,
  ``open_watches``) are absent: a test that needs them runs on the emulator only.

``close()`` deletes what was made while it was open: every object of the swept kinds (``SWEPT``,
and every kind the facade wrote) in its namespaces, and every Node, that was not there when it
opened (a test's own writes through ``api_client()`` too), finalizers removed first, one by one,
and waits until each is gone, so that the next test can reuse the names.  The controllers of the
plane run meanwhile: kwok keeps a created Node Ready (status changes), KubeRay reconciles a
RayCluster, the node-lifecycle and garbage collectors do their work.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .rest import RestError

if TYPE_CHECKING:
    from .plane import ControlPlane

JsonObj = dict[str, Any]

#: The namespaces the emulator's tests name (the emulator needs none to exist).
NAMESPACES = ("default", "ml", "ops", "other")
#: What ``close()`` removes besides the kinds written through the facade (custom resources first:
#: their dependents, made by the operators, go with them).
SWEPT = ("rayjobs.ray.io", "rayclusters.ray.io", "workloads.kueue.x-k8s.io", "jobs.batch.volcano.sh",
         "commands.bus.volcano.sh", "pods", "events", "secrets", "leases", "nodes")
PATCH_TYPES = {"merge": "application/merge-patch+json", "json": "application/json-patch+json",
               "strategic": "application/strategic-merge-patch+json"}
GONE_TIMEOUT_S = 30.0
#: The taints the node-lifecycle controller takes off a Node once it is Ready.
_NOT_READY = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
#: The TTL controller's annotation on every Node (its one write to a new Node).
_TTL_ANNOTATION = "node.alpha.kubernetes.io/ttl"
#: The garbage collector's own finalizers (a deletion in progress), left in place.
_GC_FINALIZERS = ("foregroundDeletion", "orphan")


@dataclass(frozen=True)
class Resource:
    """One served resource as discovery tells it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    status: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


class _Discovery:
    """Resources by ``plural[.group]`` and by (apiVersion, kind), read once per plane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.admin = plane.admin
        self._groups: dict[str, str] | None = None  # group -> preferred version
        self._versions: dict[str, list[Resource]] = {}  # apiVersion -> resources

    def _resources(self, api_version: str) -> list[Resource]:
        if api_version not in self._versions:
            found = self.admin.request("GET", self.admin.base(api_version))
            group, _, version = api_version.rpartition("/")
            names = {r["name"] for r in found.get("resources", [])}
            self._versions[api_version] = [
                Resource(group, version, r["name"], r["kind"], bool(r["namespaced"]), f"{r['name']}/status" in names)
                for r in found.get("resources", []) if "/" not in r["name"]]
        return self._versions[api_version]

    def groups(self) -> dict[str, str]:
        if self._groups is None:
            found = self.admin.request("GET", "/apis")
            self._groups = {g["name"]: g["preferredVersion"]["version"] for g in found.get("groups", [])}
        return self._groups

    def resource(self, name: str) -> Resource:
        plural, _, group = name.partition(".")
        if not group:
            core = [r for r in self._resources("v1") if r.plural == plural]
            if core:
                return core[0]
            matches = [r for g, v in self.groups().items() for r in self._resources(f"{g}/{v}") if r.plural == plural]
            if len(matches) != 1:
                raise KeyError(f"unknown or ambiguous resource {name!r}")
            return matches[0]
        version = self.groups().get(group)
        if version is None:
            raise KeyError(f"the API server serves no group {group!r}")
        for r in self._resources(f"{group}/{version}"):
            if r.plural == plural:
                return r
        raise KeyError(f"{group}/{version} serves no {plural!r}")

    def of(self, obj: Mapping[str, Any]) -> Resource:
        for r in self._resources(obj["apiVersion"]):
            if r.kind == obj["kind"]:
                return r
        raise KeyError(f"{obj['apiVersion']} serves no kind {obj['kind']}")


_DISCOVERIES: dict[str, _Discovery] = {}


class RealKubeApi:
    """See the module docstring.  ``RealKubeApi(plane)``; ``close()`` at the end."""

    def __init__(self, plane: ControlPlane, *, namespaces: Iterable[str] = NAMESPACES,
                 swept: Iterable[str] = SWEPT) -> None:
        self.plane = plane
        self.admin = plane.admin
        self.discovery = _DISCOVERIES.setdefault(plane.url, _Discovery(plane))
        self.namespaces: set[str] = set()
        for namespace in namespaces:
            self.ensure_namespace(namespace)
        self._swept = [self.discovery.resource(name) for name in swept]
        self._before = {r: self._uids(r) for r in self._swept}
        #: resourceVersions of the states the facade's own writes made, names of what it deleted:
        #: a watch's events of the test's own doing (kwok and the controllers write too)
        self.written: set[str] = set()
        self.deleted: set[str] = set()

    # ------------------------------------------------------------------ what the emulator offers
    @property
    def url(self) -> str:
        return self.plane.url

    def configuration(self, *, token: str | None = None) -> Any:
        return self.plane.configuration(token=token)

    def api_client(self, *, token: str | None = None) -> Any:
        return self.plane.api_client(token=token)

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        return self.plane.write_kubeconfig(path, namespace=namespace)

    def resource_type(self, resource: str) -> Resource:
        return self.discovery.resource(resource)

    def create(self, obj: Mapping[str, Any]) -> JsonObj:
        """Create ``obj`` (its status through the status subresource, where it has one)."""
        rtype = self.discovery.of(obj)
        body = copy.deepcopy(dict(obj))
        status = body.pop("status", None)
        namespace = self._namespace_of(rtype, body)
        self._sweep(rtype)
        made = self._wrote(self.admin.request("POST", self.admin.path(obj["apiVersion"], rtype.plural,
                                                                        namespace=namespace), body))
        if status and rtype.status:
            made = self._write_status(rtype, made, status)
        if rtype.key == "nodes":
            made = self._settled(made)
        return made

    def seed(self, *objects: Mapping[str, Any]) -> list[JsonObj]:
        return [self.put(obj) for obj in objects]

    def put(self, obj: Mapping[str, Any]) -> JsonObj:
        """Create, or replace what is there (its current resourceVersion), status included."""
        rtype = self.discovery.of(obj)
        body = copy.deepcopy(dict(obj))
        namespace = self._namespace_of(rtype, body)
        current = self.get(rtype.key, body["metadata"]["name"], namespace=namespace)
        if current is None:
            return self.create(body)
        status = body.pop("status", None)
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        path = self.admin.path(obj["apiVersion"], rtype.plural, namespace=namespace, name=body["metadata"]["name"])
        made = self._wrote(self.admin.request("PUT", path, body))
        if status and rtype.status:
            made = self._write_status(rtype, made, status)
        return made

    def get(self, resource: str, name: str, *, namespace: str | None = None) -> JsonObj | None:
        rtype = self.discovery.resource(resource)
        try:
            return self.admin.request("GET", self._path(rtype, namespace, name))
        except RestError as err:
            if err.status == 404:
                return None
            raise

    def list(self, resource: str, *, namespace: str | None = None, label_selector: str | None = None) -> list[JsonObj]:
        rtype = self.discovery.resource(resource)
        query = {"labelSelector": label_selector} if label_selector else None
        items = self.admin.request("GET", self._path(rtype, namespace), query=query).get("items", [])
        return sorted(items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    def patch(self, resource: str, name: str, body: Any, *, namespace: str | None = None, kind: str = "merge") -> JsonObj:
        """Patch an object (``kind``: merge | json | strategic); a ``status`` in a merge or strategic
        patch goes through the status subresource, as the emulator's direct patch writes it."""
        rtype = self.discovery.resource(resource)
        self._sweep(rtype)
        path = self._path(rtype, namespace, name)
        if kind != "json" and isinstance(body, Mapping) and "status" in body and rtype.status:
            rest = {k: v for k, v in body.items() if k != "status"}
            if rest:
                self._wrote(self.admin.request("PATCH", path, rest, content_type=PATCH_TYPES[kind]))
            return self._wrote(self.admin.request("PATCH", path + "/status", {"status": body["status"]},
                                                  content_type=PATCH_TYPES[kind]))
        return self._wrote(self.admin.request("PATCH", path, body, content_type=PATCH_TYPES[kind]))

    def delete(self, resource: str, name: str, *, namespace: str | None = None) -> None:
        """Delete at once (a pod's grace period 0: no kubelet is asked to stop it)."""
        rtype = self.discovery.resource(resource)
        self.admin.request("DELETE", self._path(rtype, namespace, name),
                           {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        self.deleted.add(name)

    def caused(self, kind: str, name: str, resource_version: str) -> bool:
        """Whether a watch event (type, object name, resourceVersion) shows one of the facade's
        own writes rather than one of kwok's or a controller's."""
        return resource_version in self.written or (kind == "DELETED" and name in self.deleted)

    # ------------------------------------------------------------------ namespaces and clean-up
    def ensure_namespace(self, namespace: str) -> None:
        if namespace in self.namespaces:
            return
        try:
            self.admin.request("POST", "/api/v1/namespaces",
                               {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        except RestError as err:
            if err.status != 409:
                raise
        self.namespaces.add(namespace)

    def close(self) -> None:
        """Delete what was made while open (see the module docstring) and wait until it is gone."""
        deleted: list[tuple[Resource, JsonObj]] = []
        for rtype in self._swept:
            before = self._before.get(rtype, set())
            for obj in self._mine(rtype):
                if obj["metadata"]["uid"] not in before:
                    deleted.append((rtype, obj))
                    self._remove(rtype, obj)
        deadline = time.monotonic() + GONE_TIMEOUT_S
        left = deleted
        while left and time.monotonic() < deadline:
            left = [(r, o) for r, o in left if self._still_there(r, o)]
            if left:
                time.sleep(0.05)
        assert not left, f"still there {GONE_TIMEOUT_S:.0f} s after their deletion: " + ", ".join(
            f"{r.key} {o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for r, o in left)

    # ------------------------------------------------------------------ internals
    def _namespace_of(self, rtype: Resource, body: JsonObj) -> str | None:
        meta = body.setdefault("metadata", {})
        if not rtype.namespaced:
            meta.pop("namespace", None)
            return None
        namespace = meta.setdefault("namespace", "default")
        self.ensure_namespace(namespace)
        return str(namespace)

    def _path(self, rtype: Resource, namespace: str | None, name: str | None = None) -> str:
        return self.admin.path(rtype.api_version, rtype.plural,
                               namespace=namespace if rtype.namespaced else None, name=name)

    def _write_status(self, rtype: Resource, made: JsonObj, status: Any) -> JsonObj:
        path = self._path(rtype, made["metadata"].get("namespace"), made["metadata"]["name"]) + "/status"
        return self._wrote(self.admin.request("PATCH", path, {"status": status}, content_type=PATCH_TYPES["merge"]))

    def _wrote(self, obj: JsonObj) -> JsonObj:
        self.written.add(str(obj.get("metadata", {}).get("resourceVersion", "")))
        return obj

    def _settled(self, node: JsonObj) -> JsonObj:
        """A new Node once the plane is done with it: the ``node.kubernetes.io/not-ready`` taint the
        TaintNodesByCondition admission plugin puts on every new Node, kwok's Ready status and the
        node-lifecycle controller's removal of that taint (tests/support/controlplane/world.py
        ``World.nodes``) and the TTL controller's ``node.alpha.kubernetes.io/ttl`` annotation
        (pkg/controller/ttl/ttl_controller.go, v1.37.2); kwok's next heartbeat is 20 to 45 s away
        (its node-heartbeat stage)."""
        name = node["metadata"]["name"]

        def settled() -> JsonObj | None:
            found = self.get("nodes", name)
            if found is None:
                return None
            conditions = (found.get("status") or {}).get("conditions") or []
            taints = (found.get("spec") or {}).get("taints") or []
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            ttl = _TTL_ANNOTATION in (found["metadata"].get("annotations") or {})
            return found if ready and ttl and not any(t["key"] in _NOT_READY for t in taints) else None

        return dict(self.plane.wait_for(f"Node {name} Ready and untainted", settled, timeout=GONE_TIMEOUT_S))

    def _sweep(self, rtype: Resource) -> None:
        """Remember a kind written through the facade (what was there before it stays)."""
        if rtype not in self._before:
            self._swept.insert(0, rtype)
            self._before[rtype] = self._uids(rtype)

    def _mine(self, rtype: Resource) -> list[JsonObj]:
        """Every object of ``rtype`` in the facade's namespaces (all, for a cluster-scoped kind)."""
        found = self.admin.request("GET", self.admin.path(rtype.api_version, rtype.plural)).get("items", [])
        return [o for o in found if not rtype.namespaced or o["metadata"].get("namespace") in self.namespaces]

    def _uids(self, rtype: Resource) -> set[str]:
        return {o["metadata"]["uid"] for o in self._mine(rtype)}

    def _remove(self, rtype: Resource, obj: JsonObj) -> None:
        meta = obj["metadata"]
        path = self._path(rtype, meta.get("namespace"), meta["name"])
        try:
            kept = [f for f in meta.get("finalizers") or () if f in _GC_FINALIZERS]
            if len(kept) != len(meta.get("finalizers") or ()):
                self.admin.request("PATCH", path, {"metadata": {"finalizers": kept or None}},
                                   content_type=PATCH_TYPES["merge"])
            # Foreground: what an operator made for it (KubeRay's pods) is gone before it is
            self.admin.request("DELETE", path, {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                                                "propagationPolicy": "Foreground",
                                                "preconditions": {"uid": meta["uid"]}})
        except RestError as err:
            if err.status not in (404, 409):  # gone already, or another object of that name
                raise

    def _still_there(self, rtype: Resource, obj: JsonObj) -> bool:
        meta = obj["metadata"]
        try:
            found = self.admin.request("GET", self._path(rtype, meta.get("namespace"), meta["name"]))
        except RestError as err:
            if err.status == 404:
                return False
            raise
        if found["metadata"]["uid"] != meta["uid"]:
            return False
        if found["metadata"].get("finalizers") and found["metadata"].get("deletionTimestamp"):
            # a finalizer put back since (not the garbage collector's own): take it off again
            if any(f not in _GC_FINALIZERS for f in found["metadata"]["finalizers"]):
                self._remove(rtype, found)
        return True


# --------------------------------------------------------------------------- the tests' two servers
EMULATOR, REAL = "emulator", "real"


def server_params() -> list[Any]:
    """A ``kubeapi`` fixture's params: the emulator (the module's layer) and the real API server
    (``cluster``: ``make test`` runs it in the cluster process, the fast layers deselect it)."""
    import pytest

    return [pytest.param(EMULATOR), pytest.param(REAL, marks=pytest.mark.cluster)]


def emulator_only() -> Any:
    """A test that needs the emulator's own controls (faults, compaction, the request log,
    ``open_watches``...): its ``kubeapi`` is the emulator's only."""
    import pytest

    return pytest.mark.parametrize("kubeapi", [EMULATOR], indirect=True)


@asynccontextmanager
async def serve(request: Any) -> AsyncIterator[Any]:
    """The server ``request.param`` names: a fresh emulator, or a :class:`RealKubeApi` over the
    process's control plane (the ``control_plane`` fixture), closed afterwards."""
    if request.param == EMULATOR:
        from tests.support.kubeapi import KubeApiServer

        async with KubeApiServer() as server:
            yield server
        return
    from tests.support import layers

    plane = request.getfixturevalue("control_plane")
    layers.started("cluster", "the real control plane")
    real = RealKubeApi(plane)
    try:
        yield real
    finally:
        real.close()


__all__ = ["EMULATOR", "NAMESPACES", "REAL", "SWEPT", "RealKubeApi", "Resource", "emulator_only", "serve",
           "server_params"]
