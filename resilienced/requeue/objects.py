"""The Kubernetes calls the requeuers make, as plain JSON, through :func:`resilienced.kube.api.call`.

Every write is a JSON merge patch; a patch that carries ``metadata.resourceVersion`` is
conditional (the server answers 409 Conflict when the object changed since it was read), which
is how the read-modify-write of a worker-group list stays safe without an ``update`` verb.
Errors are translated by ``kube.api`` (5xx/429/connection: BackendUnavailable; 4xx:
KubeStatusError with its status).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from kubernetes_asyncio import client as k8s

from resilienced.errors import TemporaryError
from resilienced.kube.api import MERGE_PATCH, JsonObj, KubeStatusError, call
from resilienced.model import JsonValue


@dataclass(frozen=True)
class Kind:
    """A custom resource kind: API group, version, plural."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        return f"{self.plural}.{self.group}"


RAYJOB = Kind("ray.io", "v1", "rayjobs", "RayJob")
RAYCLUSTER = Kind("ray.io", "v1", "rayclusters", "RayCluster")
VOLCANO_JOB = Kind("batch.volcano.sh", "v1alpha1", "jobs", "Job")
VOLCANO_COMMAND = Kind("bus.volcano.sh", "v1alpha1", "commands", "Command")


def workload_kind(version: str = "v1beta2") -> Kind:
    """Kueue's Workload in ``version`` (v1beta2 from Kueue 0.15, v1beta1 before; both have spec.active)."""
    if version not in ("v1beta1", "v1beta2"):
        raise ValueError(f"Kueue Workload version must be v1beta1 or v1beta2, got {version!r}")
    return Kind("kueue.x-k8s.io", version, "workloads", "Workload")


def split_key(key: str, *, what: str) -> tuple[str, str]:
    """``"namespace/name"`` -> (namespace, name); ValueError naming ``what`` otherwise."""
    namespace, sep, name = (key or "").partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"{what} must be 'namespace/name', got {key!r}")
    return namespace, name


class Objects:
    """JSON access to the objects a requeue reads and changes (one ApiClient, the caller's)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        self._custom = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def _opts(self) -> dict[str, JsonValue]:
        return {"_preload_content": False, "_request_timeout": self._timeout}

    async def get(self, kind: Kind, namespace: str, name: str) -> JsonObj:
        return await call("get", kind.resource, self._custom.get_namespaced_custom_object(
            kind.group, kind.version, namespace, kind.plural, name, **self._opts()))

    async def find(self, kind: Kind, namespace: str, name: str) -> JsonObj | None:
        """The object, or None when it does not exist (404)."""
        try:
            return await self.get(kind, namespace, name)
        except KubeStatusError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, *, label_selector: str | None = None) -> list[JsonObj]:
        kwargs = {"label_selector": label_selector} if label_selector else {}
        body = await call("list", kind.resource, self._custom.list_namespaced_custom_object(
            kind.group, kind.version, namespace, kind.plural, **kwargs, **self._opts()))
        return list(body.get("items") or [])

    async def patch(self, kind: Kind, namespace: str, name: str, patch: Mapping[str, JsonValue]) -> JsonObj:
        """A JSON merge patch (conditional when it carries ``metadata.resourceVersion``)."""
        return await call("patch", kind.resource, self._custom.patch_namespaced_custom_object(
            kind.group, kind.version, namespace, kind.plural, name, dict(patch),
            _content_type=MERGE_PATCH, **self._opts()))

    async def create(self, kind: Kind, namespace: str, body: Mapping[str, JsonValue]) -> JsonObj:
        return await call("create", kind.resource, self._custom.create_namespaced_custom_object(
            kind.group, kind.version, namespace, kind.plural, dict(body), **self._opts()))

    async def pods(self, namespace: str, *, label_selector: str) -> list[JsonObj]:
        body = await call("list", "pods", self._core.list_namespaced_pod(
            namespace, label_selector=label_selector, **self._opts()))
        return list(body.get("items") or [])

    async def delete_pod(self, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete a pod (only that incarnation when ``uid`` is given); False when already gone."""
        body = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid)) if uid else None
        try:
            await call("delete", "pods", self._core.delete_namespaced_pod(
                name, namespace, body=body, **self._opts()))
        except KubeStatusError as e:
            if e.status in (404, 409):  # gone, or already replaced by a new incarnation
                return False
            raise
        return True

    async def node(self, name: str) -> JsonObj | None:
        """A Node, or None when it is gone."""
        try:
            return await call("get", "nodes", self._core.read_node(name, **self._opts()))
        except KubeStatusError as e:
            if e.status == 404:
                return None
            raise

    async def node_labels(self, name: str) -> dict[str, str] | None:
        """A Node's labels, or None when it is gone."""
        node = await self.node(name)
        return None if node is None else dict((node.get("metadata") or {}).get("labels") or {})


async def modify(
    read: Callable[[], Awaitable[JsonObj]],
    change: Callable[[JsonObj], Mapping[str, JsonValue] | None],
    write: Callable[[Mapping[str, JsonValue]], Awaitable[JsonObj]],
    *,
    what: str,
    attempts: int = 5,
) -> tuple[JsonObj, bool]:
    """Read, compute a conditional merge patch, write; again on 409 Conflict.

    ``change(obj)`` returns the patch (without resourceVersion; it is added here) or None when
    nothing needs changing.  Returns (the object after, whether it was written).
    """
    for _ in range(attempts):
        obj = await read()
        patch = change(obj)
        if patch is None:
            return obj, False
        patch = dict(patch)
        patch["metadata"] = {**dict(patch.get("metadata") or {}),
                             "resourceVersion": obj["metadata"]["resourceVersion"]}
        try:
            return await write(patch), True
        except KubeStatusError as e:
            if e.status != 409:
                raise
    raise TemporaryError(f"{what}: still conflicting after {attempts} attempts", delay=1.0)


def annotations_of(obj: Mapping[str, JsonValue]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def labels_of(obj: Mapping[str, JsonValue]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})
