"""An emulated Kubernetes API server over HTTP, for tests and benchmarks.

No kube-apiserver can run where the tests run, and kmock ignores label and field selectors, so this
module serves the part of the Kubernetes API that resilienced uses, over real HTTP on 127.0.0.1.
The code under test reaches it through the real kubernetes_asyncio client, exactly as it reaches EKS.

Served
    core/v1            nodes, namespaces (cluster-scoped); pods, podtemplates, events, secrets, services
    coordination.k8s.io/v1  leases          events.k8s.io/v1  events (a view of the core ones)
    custom resources   generic storage keyed by (group, plural), one line in ``RESOURCES`` per kind:
                       ray.io/v1 rayclusters, rayjobs; kueue.x-k8s.io v1beta1 + v1beta2 workloads
                       (one storage, two versions); batch.volcano.sh/v1alpha1 jobs;
                       bus.volcano.sh/v1alpha1 commands
    also               /version, /healthz, /api, /apis and the per-version resource lists

Verbs and semantics kept
    get; list with label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``,
    ``>``/``<``) and field selectors (``=``, ``==``, ``!=``; only the field labels the real server
    supports for that resource, anything else is 400 "field label not supported"), limit/continue;
    watch (``?watch=true``) from a resourceVersion out of a change history, synthetic ADDED events
    without one, ADDED/DELETED when an object starts/stops matching the selectors, BOOKMARK events
    with ``allowWatchBookmarks``, ``timeoutSeconds``, and an in-stream ERROR 410 ``Expired`` for a
    resourceVersion older than the compaction horizon; create (409 AlreadyExists, generateName);
    update/PUT (409 Conflict on a stale resourceVersion; a missing Event, Service or Lease is
    created, as the real server does); patch with ``merge-patch+json``,
    ``json-patch+json`` and ``strategic-merge-patch+json`` (built-in kinds only: custom resources
    answer 415, as the real server does), a ``metadata.resourceVersion`` in a patch is a
    precondition (409); delete with ``preconditions`` and finalizers (``deletionTimestamp``);
    the ``status`` subresource (the main resource ignores status changes and vice versa); a
    custom resource written over HTTP must name its kind (400), is pruned, defaulted and validated
    against its vendored CRD schema (422 Invalid, worded as kube-apiserver words it;
    :mod:`tests.support.crdschema` says which schema, from which release); a pod or pod template
    written over HTTP needs containers with images, a pod's spec takes only new images and added
    tolerations (422, ``ValidatePodUpdate``), an events.k8s.io Event needs a type; empty
    ``labels``/``annotations``/``finalizers``/``ownerReferences`` are not kept. One
    monotonic resourceVersion across all objects; ``uid``, ``creationTimestamp``, ``generation``
    (bumped on a change outside metadata and status); ownerReferences stored as given; Secret
    ``stringData`` folded into base64 ``data``. Optional bearer-token authentication (401) and RBAC
    (403 with the real server's message) from a list of :class:`RbacRule`.

Approximated (documented in docs/kubernetes.md)
    strategic merge knows the merge keys of the fields resilienced and its tests touch (containers,
    env, ports, volumes, volumeMounts, conditions, ownerReferences, finalizers, ...); every other list
    is replaced whole, which is also what the real server does for ``spec.taints`` and
    ``tolerations`` (no patch strategy); a merged list is ordered as the real server orders it.
    ``$patch: delete|replace`` and ``$deleteFromPrimitiveList`` are honoured, ``$setElementOrder``
    and ``$retainKeys`` ignored.  No server-side apply (415), no dryRun, no garbage collection of
    dependents, no admission plugins (no defaults: the real server gives a new Node the
    ``node.kubernetes.io/not-ready`` taint and a pod its tolerations of it), validating webhooks
    only where a test registers one (``webhooks``), validation of built-in kinds only as listed above, namespaces need not exist, and lists are always served from the
    newest state (``resourceVersion``/``resourceVersionMatch`` on a list are ignored).
    tests/kube/test_kubeapi_*.py run against the real API server too (docs/requeue.md, issue #40).

Test controls (Python, on :class:`KubeApiServer`; direct changes bypass HTTP and the request log)
    ``create``/``put``/``patch``/``delete``/``get``/``list``      change or read objects directly
    ``fail(verb=, resource=, status=500|503|429|0, times=N)``     answer matching requests with an
                                                                   error (0: drop the connection;
                                                                   aiohttp retries an idempotent
                                                                   request once after a drop, so
                                                                   ``times=2`` makes one visible)
    ``delay(seconds, verb=, resource=, times=N)``                  hold matching requests (``name=``
                                                                   matches a create by its body's name)
    ``compact()``                                                  forget the change history: a watch
                                                                   from an older RV gets 410
    ``expire_watches()``                                           compact and end every open watch
                                                                   with ERROR 410
    ``drop_watches()``                                             end every open watch cleanly
    ``send_bookmarks()``                                           a BOOKMARK on every open watch that
                                                                   asked for them
    ``requests``, ``counts()``, ``verbs_seen()``, ``reset_log()``  the request log
    ``open_watches``                                               how many watches are open
    ``stop()``                                                     close every watch and the server
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import re
import socket
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from aiohttp import web
from kubernetes_asyncio import client as k8s

from tests.support import crdschema

JsonObj = dict[str, Any]

DEFAULT_USER = "system:serviceaccount:resilienced:resilienced"


# --------------------------------------------------------------------------- resource types
# Strategic-merge list keys shared by every built-in kind (``""``: a list of primitives merged as a set).
_META_MERGE_KEYS = {"metadata.ownerReferences": "uid", "metadata.finalizers": ""}

_POD_SPEC_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containers[].env": "name",
    "containers[].ports": "containerPort",
    "containers[].volumeMounts": "mountPath",
    "initContainers[].env": "name",
    "initContainers[].ports": "containerPort",
    "initContainers[].volumeMounts": "mountPath",
    "volumes": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}


def _prefixed(prefix: str, keys: Mapping[str, str]) -> dict[str, str]:
    return {f"{prefix}.{path}": key for path, key in keys.items()}


@dataclass(frozen=True)
class ResourceType:
    """One kind the emulator serves; custom resources need only the first five fields."""

    group: str  # "" for core
    versions: tuple[str, ...]
    plural: str
    kind: str
    namespaced: bool
    status_subresource: bool = True
    builtin: bool = False  # built-in kinds accept strategic merge; custom resources answer 415
    field_labels: frozenset[str] = frozenset()  # besides metadata.name / metadata.namespace
    merge_keys: Mapping[str, str] = field(default_factory=dict)  # strategic merge: list path -> key
    storage: tuple[str, str] | None = None  # (group, plural) of the resource it is a view of
    create_on_update: bool = False  # an update (PUT) of a missing object creates it (its strategy's AllowCreateOnUpdate)

    @property
    def store(self) -> tuple[str, str]:
        """Where its objects are kept: its own (group, plural), or the resource it is a view of."""
        return self.storage or (self.group, self.plural)

    @property
    def key(self) -> str:
        """How RBAC, the request log and the test controls name it: ``pods``, ``leases.coordination.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version


_EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)

RESOURCES: tuple[ResourceType, ...] = (
    ResourceType(
        "", ("v1",), "nodes", "Node", namespaced=False, builtin=True,
        field_labels=frozenset({"spec.unschedulable"}),
        merge_keys={"status.conditions": "type", "status.addresses": "type", "spec.podCIDRs": ""},
    ),
    ResourceType("", ("v1",), "namespaces", "Namespace", namespaced=False, builtin=True,
                 field_labels=frozenset({"status.phase"})),
    ResourceType(
        "", ("v1",), "pods", "Pod", namespaced=True, builtin=True,
        field_labels=frozenset({
            "spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
            "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName",
        }),
        merge_keys={**_prefixed("spec", _POD_SPEC_MERGE_KEYS), "status.conditions": "type"},
    ),
    # Events, Services and Leases are created by an update of a missing one, whatever resourceVersion
    # it carries (kubernetes v1.37.2 pkg/registry/core/event, core/service, coordination/lease
    # strategy.go ``AllowCreateOnUpdate``: true; every other kind here: 404)
    ResourceType("", ("v1",), "events", "Event", namespaced=True, status_subresource=False,
                 builtin=True, field_labels=_EVENT_FIELDS, create_on_update=True),
    # The pod spec's patch strategies without a pod's immutability (kubernetes v1.37.2
    # pkg/registry/core/podtemplate: no status, every field of the template may change).
    ResourceType("", ("v1",), "podtemplates", "PodTemplate", namespaced=True, status_subresource=False,
                 builtin=True, merge_keys=_prefixed("template.spec", _POD_SPEC_MERGE_KEYS)),
    ResourceType("", ("v1",), "secrets", "Secret", namespaced=True, status_subresource=False,
                 builtin=True, field_labels=frozenset({"type"})),
    ResourceType("", ("v1",), "services", "Service", namespaced=True, builtin=True,
                 merge_keys={"spec.ports": "port"}, create_on_update=True),
    ResourceType("coordination.k8s.io", ("v1",), "leases", "Lease", namespaced=True,
                 status_subresource=False, builtin=True, create_on_update=True),
    # One storage with core/v1 events, converted field by field (kubernetes v1.37.2
    # pkg/apis/events/v1/conversion.go; pkg/registry/core/rest/storage_core.go serves both from it).
    ResourceType(
        "events.k8s.io", ("v1",), "events", "Event", namespaced=True, status_subresource=False,
        builtin=True, storage=("", "events"), create_on_update=True,
        field_labels=frozenset(
            {f.replace("involvedObject.", "regarding.") for f in _EVENT_FIELDS if "involvedObject" in f}
            | {"reason", "reportingController", "type"}
        ),
    ),
    # custom resources: one line each
    ResourceType("ray.io", ("v1",), "rayclusters", "RayCluster", namespaced=True),
    ResourceType("ray.io", ("v1",), "rayjobs", "RayJob", namespaced=True),
    ResourceType("kueue.x-k8s.io", ("v1beta1", "v1beta2"), "workloads", "Workload", namespaced=True),
    ResourceType("batch.volcano.sh", ("v1alpha1",), "jobs", "Job", namespaced=True),
    ResourceType("bus.volcano.sh", ("v1alpha1",), "commands", "Command", namespaced=True,
                 status_subresource=False),
)


# --------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An answer with a ``Status`` body, as the real server writes it."""

    def __init__(
        self, code: int, message: str, *, reason: str | None = None, details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or _REASONS.get(code, "InternalError")
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def status(self) -> JsonObj:
        return status_body(self.code, reason=self.reason, message=self.message, details=self.details)

    def response(self) -> web.Response:
        return web.json_response(self.status(), status=self.code, headers=self.headers)


def status_body(code: int, *, reason: str, message: str, details: Mapping[str, Any] | None = None) -> JsonObj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": dict(details or {}),
        "code": code,
    }


_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
    409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType", 422: "Invalid",
    429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout",
}


def _not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, f'{rtype.key} "{name}" not found',
                    details={"name": name, "group": rtype.group, "kind": rtype.plural})


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


# --------------------------------------------------------------------------- selectors
_LABEL_KEY = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class _LabelRequirement:
    key: str
    op: str  # in, notin, exists, !exists, gt, lt
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if not present:
            return False
        try:
            number, bound = int(value or ""), int(next(iter(self.values)))
        except ValueError:
            return False
        return number > bound if self.op == "gt" else number < bound


class LabelSelector:
    """A parsed ``labelSelector`` query parameter (the Kubernetes label selector grammar)."""

    def __init__(self, text: str | None) -> None:
        self.requirements: list[_LabelRequirement] = []
        for part in _split_top_level(text or ""):
            self.requirements.append(self._parse(part))

    @staticmethod
    def _check_key(key: str) -> str:
        if not _LABEL_KEY.match(key):
            raise _bad(f"unable to parse requirement: invalid label key {key!r}")
        return key

    @staticmethod
    def _check_value(value: str) -> str:
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise _bad(f"unable to parse requirement: invalid label value {value!r}")
        return value

    def _parse(self, part: str) -> _LabelRequirement:
        if part.startswith("!"):
            return _LabelRequirement(self._check_key(part[1:].strip()), "!exists")
        m = re.match(r"^(\S+)\s+(in|notin)\s*\((.*)\)$", part)
        if m:
            values = frozenset(self._check_value(v.strip()) for v in m.group(3).split(","))
            return _LabelRequirement(self._check_key(m.group(1)), m.group(2), values)
        m = re.match(r"^([^=!<>\s]+)\s*(==|!=|=|>|<)\s*(\S*)$", part)
        if m:
            key, op, value = self._check_key(m.group(1)), m.group(2), m.group(3)
            if op in ("<", ">"):
                if not re.match(r"^-?\d+$", value):
                    raise _bad(f"unable to parse requirement: for 'gt', 'lt' operators, the value must be an integer: {value!r}")
                return _LabelRequirement(key, "gt" if op == ">" else "lt", frozenset({value}))
            value = self._check_value(value)
            return _LabelRequirement(key, "notin" if op == "!=" else "in", frozenset({value}))
        if re.match(r"^\S+$", part):
            return _LabelRequirement(self._check_key(part), "exists")
        raise _bad(f"unable to parse requirement: {part!r}")

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    if path == "source":  # core/v1 Event: the source component
        path = "source.component"
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping):
            node = None
            break
        node = node.get(part)
    if isinstance(node, bool):
        return "true" if node else "false"
    if node is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    return str(node)


class FieldSelector:
    """A parsed ``fieldSelector``: only the field labels the real server supports for that resource."""

    def __init__(self, text: str | None, rtype: ResourceType) -> None:
        self.terms: list[tuple[str, bool, str]] = []  # (field, equal, value)
        allowed = {"metadata.name", "metadata.namespace"} | set(rtype.field_labels)
        for part in _split_top_level(text or ""):
            m = re.match(r"^([^=!]+?)\s*(==|!=|=)\s*(.*)$", part)
            if not m:
                raise _bad(f"invalid selector: {part!r}; can't understand {part!r}")
            name = m.group(1).strip()
            if name not in allowed:
                raise _bad(f'field label not supported: {name}')
            self.terms.append((name, m.group(2) != "!=", m.group(3).strip()))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        return all((_field_value(obj, f) == v) == eq for f, eq, v in self.terms)

    def name(self) -> str | None:
        for f, eq, v in self.terms:
            if f == "metadata.name" and eq:
                return v
        return None


# --------------------------------------------------------------------------- patches
def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, tokens: list[str], *, path: str) -> Any:
    node = doc
    for tok in tokens:
        if isinstance(node, dict) and tok in node:
            node = node[tok]
        elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
            node = node[int(tok)]
        else:
            raise ApiError(422, f"jsonpatch: path {path!r} does not exist")
    return node


def _json_add(doc: Any, path: str, *, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _walk(doc, tokens[:-1], path=path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise ApiError(422, f"jsonpatch: index out of range in {path!r}")
    else:
        raise ApiError(422, f"jsonpatch: cannot add at {path!r}")
    return doc


def _json_remove(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise ApiError(422, "jsonpatch: cannot remove the root")
    parent = _walk(doc, tokens[:-1], path=path)
    last = tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise ApiError(422, f"jsonpatch: remove: path {path!r} does not exist")


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(operations, list):
        raise _bad("json patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise _bad(f"invalid json patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _json_add(doc, path, value=copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _json_remove(doc, path)
        elif kind == "replace":
            doc, _ = _json_remove(doc, path)
            doc = _json_add(doc, path, value=copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = op.get("from", "")
            if kind == "move":
                doc, value = _json_remove(doc, source)
            else:
                value = copy.deepcopy(_walk(doc, _pointer(source), path=source))
            doc = _json_add(doc, path, value=value)
        elif kind == "test":
            if _walk(doc, _pointer(path), path=path) != op.get("value"):
                raise ApiError(422, f"jsonpatch: test operation for path {path!r} failed")
        else:
            raise _bad(f"unknown json patch operation {kind!r}")
    return doc


class _Delete:
    pass


_DELETE = _Delete()


def strategic_merge_patch(target: Any, patch: Any, *, merge_keys: Mapping[str, str], path: str = "") -> Any:
    """Strategic merge patch for built-in kinds; lists without a known merge key are replaced whole."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return _DELETE
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name) or [] if x not in (value or [])]
            continue
        sub = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, merge_keys=merge_keys, path=sub)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, merge_keys=merge_keys, path=sub)
        else:
            result[key] = value
    return result


def _merge_list(current: Any, patch: list[Any], *, merge_keys: Mapping[str, str], path: str) -> list[Any]:
    key = merge_keys.get(path)
    if key is None:
        return [item for item in copy.deepcopy(patch) if item != {"$patch": "replace"}]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    result = list(current) if isinstance(current, list) else []
    if key == "":  # primitives, merged as a set
        for item in patch:
            if item not in result:
                result.append(item)
        return _element_order(result, patch, result_before=current, key=key)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise _bad(f"strategic merge: element of {path} has no merge key {key!r}")
        index = next((i for i, cur in enumerate(result) if isinstance(cur, dict) and cur.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
            continue
        if index is None:
            result.append(copy.deepcopy({k: v for k, v in item.items() if k != "$patch"}))
        else:
            result[index] = strategic_merge_patch(result[index], item, merge_keys=merge_keys, path=f"{path}[]")
    return _element_order(result, [i for i in patch if i.get("$patch") != "delete"], result_before=current, key=key)


def _element_order(merged: list[Any], patch: list[Any], *, result_before: Any, key: str) -> list[Any]:
    """The order the real server gives a merged list (k8s.io/apimachinery v0.37.2
    pkg/util/strategicpatch/patch.go ``mergeSlice``: ``normalizeElementOrder`` and
    ``mergeSortedSlice``): the patch's elements in the patch's order, the others in the server's,
    interleaved where both were there before, a new element ahead of the server's that follow."""
    def ident(item: Any) -> Any:
        return item.get(key) if key and isinstance(item, dict) else item

    patched = [ident(i) for i in patch]
    server = [ident(i) for i in (result_before if isinstance(result_before, list) else [])]
    mine = sorted((m for m in merged if ident(m) in patched), key=lambda m: patched.index(ident(m)))
    theirs = [m for m in merged if ident(m) not in patched]
    out: list[Any] = []
    while mine or theirs:
        if theirs and (not mine or (ident(theirs[0]) in server and ident(mine[0]) in server
                                    and server.index(ident(theirs[0])) < server.index(ident(mine[0])))):
            out.append(theirs.pop(0))
        else:
            out.append(mine.pop(0))
    return out


# --------------------------------------------------------------------------- what kube-apiserver checks
# The rules below are kube-apiserver v1.37.2's, as the real control plane (tests/support/controlplane)
# answers them; tests/kube/test_kubeapi_*.py run against both servers (docs/requeue.md, issue #40).

def _invalid(rtype: ResourceType, name: str, errors: Sequence[tuple[str, str, str]]) -> ApiError:
    """422 Invalid as the real server words field errors ``(field, cause reason, message)``: one
    error as it is, several in brackets (k8s.io/apimachinery v0.37.2 pkg/util/validation/field
    ``ErrorList.ToAggregate``); a custom resource is named ``Kind.group``."""
    texts = [f"{f}: {m}" if f else m for f, _, m in errors]
    what = f"{rtype.kind}.{rtype.group}" if not rtype.builtin else rtype.kind
    details: JsonObj = {"name": name, "kind": rtype.kind,
                        "causes": [{"reason": r, "message": m, "field": f} for f, r, m in errors]}
    if rtype.group:
        details["group"] = rtype.group
    return ApiError(422, f'{what} "{name}" is invalid: ' + (texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"),
                    details=details)


def _required(path: str) -> tuple[str, str, str]:
    return (path, "FieldValueRequired", "Required value")


def _containers_errors(spec: Any, path: str) -> list[tuple[str, str, str]]:
    """A pod spec needs containers, each with a name and an image (kubernetes v1.37.2
    pkg/apis/core/validation/validation.go ``validateContainers``)."""
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    if not containers:
        return [_required(f"{path}.containers")]
    return [_required(f"{path}.containers[{i}].{key}") for i, c in enumerate(containers)
            for key in ("name", "image") if not (isinstance(c, Mapping) and c.get(key))]


#: kubernetes v1.37.2 pkg/apis/core/validation/validation.go ``ValidatePodUpdate`` (the real
#: message goes on with a diff of the two specs).
_POD_UPDATABLE = ("pod updates may not change fields other than `spec.containers[*].image`,"
                  "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions "
                  "to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                  "previously negative)")


def _pod_update_errors(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """What ``ValidatePodUpdate`` refuses in a change of a pod's spec: adding or removing a
    container, changing an existing toleration, any change but an image, an added toleration,
    ``activeDeadlineSeconds``, a negative grace period set to 1 or a removed scheduling gate.
    (Approximated: the additions a scheduling-gated pod may make to its node selector and affinity.)"""
    for key in ("containers", "initContainers"):
        if len(old.get(key) or []) != len(new.get(key) or []):
            return [(f"spec.{key}", "FieldValueForbidden", "Forbidden: pod updates may not add or remove containers")]
    errors = []

    def loose(tolerations: Any) -> list[Any]:
        return [{k: v for k, v in t.items() if k != "tolerationSeconds"} for t in tolerations or []]

    if any(t not in loose(new.get("tolerations")) for t in loose(old.get("tolerations"))):
        errors.append(("spec.tolerations", "FieldValueForbidden",
                       "Forbidden: existing toleration can not be modified except its tolerationSeconds"))
    munged = copy.deepcopy(dict(new))
    for key in ("containers", "initContainers"):
        for mine, theirs in zip(munged.get(key) or [], old.get(key) or []):
            if isinstance(mine, dict) and isinstance(theirs, Mapping):
                mine.pop("image", None)
                if "image" in theirs:
                    mine["image"] = theirs["image"]
    changeable = ["activeDeadlineSeconds", "tolerations"]
    if (old.get("terminationGracePeriodSeconds") or 0) < 0 and new.get("terminationGracePeriodSeconds") == 1:
        changeable.append("terminationGracePeriodSeconds")
    gates = new.get("schedulingGates") or []
    if all(g in (old.get("schedulingGates") or []) for g in gates):
        changeable.append("schedulingGates")
    for key in changeable:
        munged.pop(key, None)
        if key in old:
            munged[key] = copy.deepcopy(old[key])
    if munged != dict(old):
        errors.append(("spec", "FieldValueForbidden", f"Forbidden: {_POD_UPDATABLE}"))
    return errors


#: core/v1 Event field -> events.k8s.io/v1 Event field (kubernetes v1.37.2 pkg/apis/events/v1/conversion.go).
_EVENT_V1_FIELDS = {"involvedObject": "regarding", "message": "note", "reportingComponent": "reportingController",
                    "source": "deprecatedSource", "firstTimestamp": "deprecatedFirstTimestamp",
                    "lastTimestamp": "deprecatedLastTimestamp", "count": "deprecatedCount"}
_EVENT_CORE_FIELDS = {v: k for k, v in _EVENT_V1_FIELDS.items()}


def _view(rtype: ResourceType, obj: JsonObj) -> JsonObj:
    """A stored object as ``rtype`` serves it: an events.k8s.io/v1 Event is a core Event renamed."""
    if rtype.storage != ("", "events"):
        return obj
    return {**{_EVENT_V1_FIELDS.get(k, k): v for k, v in obj.items()},
            "apiVersion": rtype.api_version(rtype.versions[0]), "kind": rtype.kind}


def _stored(rtype: ResourceType, obj: JsonObj) -> JsonObj:
    """The inverse of :func:`_view`: an object written through ``rtype`` as it is kept."""
    if rtype.storage != ("", "events"):
        return obj
    return {**{_EVENT_CORE_FIELDS.get(k, k): v for k, v in obj.items()}, "apiVersion": "v1", "kind": "Event"}


def _schema_default(value: Any, schema: Mapping[str, Any]) -> None:
    """Fill in the schema's ``default`` of every absent field, outside in, in place (k8s.io/
    apiextensions-apiserver v0.37.2 pkg/apiserver/schema/defaulting/algorithm.go ``Default``)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, prop in props.items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
        for key, item in value.items():
            sub = props.get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), Mapping):
                sub = schema["additionalProperties"]
            if sub is not None:
                _schema_default(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _schema_default(item, schema["items"])


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {str: "string", float: "number", dict: "object", list: "array"}.get(type(value), "null")


def _go_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else ("null" if value is None else str(value))


def _schema_error(error: Any) -> tuple[str, str, str]:
    """A jsonschema error worded as kube-openapi v0.37 words a CRD schema violation
    (k8s.io/kube-openapi pkg/validation/errors; apiextensions-apiserver pkg/apiserver/validation)."""
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    rule, want, value = error.validator, error.validator_value, error.instance
    if rule == "required":
        missing = next((k for k in want if k not in (value or {})), "")
        return _required(f"{path}.{missing}" if path else missing)
    if rule == "type":
        got = _json_type(value)
        return (path, "FieldValueTypeInvalid", f'Invalid value: "{got}": {path} in body must be of type '
                f'{want if isinstance(want, str) else " or ".join(want)}: "{got}"')
    if rule == "enum":
        return (path, "FieldValueNotSupported",
                f"Unsupported value: {_go_value(value)}: supported values: " + ", ".join(_go_value(v) for v in want))
    if rule == "maxItems":
        return (path, "FieldValueTooMany", f"Too many: {len(value)}: must have at most {want} items")
    said = {"minimum": f"should be greater than or equal to {want}", "maximum": f"should be less than or equal to {want}",
            "minItems": f"should have at least {want} items", "minLength": f"should be at least {want} chars long",
            "maxLength": f"should be at most {want} chars long", "pattern": f"should match '{want}'"}.get(rule)
    shown = len(value) if rule == "minItems" else value
    return (path, "FieldValueInvalid", f"Invalid value: {_go_value(shown)}: {path} in body {said}" if said
            else f"Invalid value: {_go_value(shown)}: {error.message}")


# --------------------------------------------------------------------------- request log, faults, RBAC
@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered (``status`` is the HTTP status it started to answer with)."""

    verb: str  # get list watch create update patch delete (Kubernetes authorization verbs)
    resource: str  # "pods", "rayclusters.ray.io", "rayjobs.ray.io/status"
    group: str
    plural: str
    subresource: str | None
    namespace: str | None
    name: str | None
    status: int
    label_selector: str | None = None
    field_selector: str | None = None
    content_type: str | None = None


@dataclass(frozen=True)
class _Call:
    """One request, resolved: the verb and what it is about."""

    verb: str
    rtype: ResourceType
    version: str
    namespace: str | None
    name: str | None
    sub: str | None


@dataclass
class _Rule:
    verb: str | None
    resource: str | None
    namespace: str | None
    name: str | None
    times: int | None
    hits: int = 0

    def applies(self, call: _Call) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.verb is not None and self.verb != call.verb:
            return False
        if self.resource is not None:
            suffix = f"/{call.sub}" if call.sub else ""
            if self.resource not in (call.rtype.key + suffix, call.rtype.plural + suffix):
                return False
        if self.namespace is not None and self.namespace != call.namespace:
            return False
        return self.name is None or self.name == call.name


@dataclass
class Fault(_Rule):
    """Answer matching requests with ``status`` (0: drop the connection without an answer)."""

    status: int = 500
    retry_after: int | None = None
    message: str = "injected by the test"


@dataclass
class Delay(_Rule):
    """Hold matching requests ``seconds`` before answering (to provoke client timeouts)."""

    seconds: float = 0.0


@dataclass(frozen=True)
class RbacRule:
    """One RBAC PolicyRule, bound cluster-wide (``namespace=None``) or in one namespace."""

    verbs: frozenset[str]
    api_groups: frozenset[str]
    resources: frozenset[str]
    resource_names: frozenset[str] = frozenset()
    namespace: str | None = None

    def allows(self, *, verb: str, group: str, resource: str, namespace: str | None, name: str | None) -> bool:
        if self.namespace is not None and self.namespace != namespace:
            return False
        if not ({verb, "*"} & self.verbs and {group, "*"} & self.api_groups and {resource, "*"} & self.resources):
            return False
        return not self.resource_names or (name is not None and name in self.resource_names)


# --------------------------------------------------------------------------- watches
@dataclass(frozen=True)
class _Change:
    rv: int
    store: tuple[str, str]
    type: str  # ADDED MODIFIED DELETED
    obj: JsonObj
    old: JsonObj | None


class _Signal:
    def __init__(self, name: str, rv: int = 0) -> None:
        self.name = name
        self.rv = rv


@dataclass(eq=False)
class _Watcher:
    rtype: ResourceType
    version: str
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)

    def visible(self, obj: JsonObj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(_view(self.rtype, obj))


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _without_rv(obj: Mapping[str, Any]) -> JsonObj:
    return {**obj, "metadata": {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}}


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


# --------------------------------------------------------------------------- the server
class KubeApiServer:
    """The emulated API server: ``await start()``, point a kubernetes_asyncio client at ``url``.

    ``token``: when set, every request must carry ``Authorization: Bearer <token>`` (else 401).
    ``rbac``: when set, a request no rule allows is answered 403, as the real server words it.
    ``history``: how many changes are kept for watches that resume from a resourceVersion; a
    resume from before the oldest kept change gets ERROR 410 (``compact()`` forces it).
    ``bookmark_interval``: seconds between BOOKMARK events on watches that asked for them
    (``None``: only when a test calls ``send_bookmarks()``).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        user: str = DEFAULT_USER,
        rbac: Sequence[RbacRule] | None = None,
        history: int = 10_000,
        bookmark_interval: float | None = None,
        resources: Iterable[ResourceType] = RESOURCES,
    ) -> None:
        self.token = token
        self.user = user
        self.rbac = list(rbac) if rbac is not None else None
        self.bookmark_interval = bookmark_interval
        self._history_limit = history
        self._types: dict[tuple[str, str], ResourceType] = {}
        self._by_kind: dict[tuple[str, str], ResourceType] = {}
        self._stores: dict[tuple[str, str], dict[tuple[str, str], JsonObj]] = {}
        for rtype in resources:
            self.register(rtype)
        self._rv = 1
        self._compacted = 0  # a watch may resume from any RV >= this
        self._history: deque[_Change] = deque()
        self._watchers: set[_Watcher] = set()
        self._faults: list[Fault] = []
        self._delays: list[Delay] = []
        self.requests: list[RequestRecord] = []
        #: validating admission webhooks of the controllers a test plays (tests/requeue/kueue_sim.py
        #: registers Kueue's): each is called with (kind, new object, old object or None) on a
        #: write over HTTP of a main resource and refuses it by raising :class:`ApiError`
        self.webhooks: list[Callable[[ResourceType, JsonObj, JsonObj | None], None]] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def register(self, rtype: ResourceType) -> None:
        """Serve one more kind (custom resources: ``ResourceType(group, (version,), plural, Kind, namespaced=True)``)."""
        self._types[(rtype.group, rtype.plural)] = rtype
        self._by_kind[(rtype.group, rtype.kind)] = rtype
        self._stores.setdefault(rtype.store, {})

    async def start(self) -> KubeApiServer:
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        """End every open watch, then close the server (idempotent)."""
        self._stopping.set()
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(_Signal("stop"))
        for _ in range(100):
            if not self._watchers:
                break
            await asyncio.sleep(0.02)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> KubeApiServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self, *, token: str | None = None) -> k8s.Configuration:
        """A kubernetes_asyncio Configuration pointing at this server (with the server's token)."""
        config = k8s.Configuration(host=self.url)
        bearer = token if token is not None else self.token
        if bearer:
            config.api_key = {"BearerToken": bearer}
            config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def api_client(self, *, token: str | None = None) -> k8s.ApiClient:
        """A new kubernetes_asyncio ApiClient for this server; the caller closes it."""
        return k8s.ApiClient(self.configuration(token=token))

    def kubeconfig(self, *, namespace: str = "default", context: str = "emulated") -> JsonObj:
        user: JsonObj = {"token": self.token} if self.token else {}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": user}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
        }

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig file for CLI tests (``KUBECONFIG=<path>``)."""
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig(namespace=namespace)))
        return path

    # ------------------------------------------------------------------ test controls
    def fail(
        self, *, verb: str | None = None, resource: str | None = None, status: int = 500,
        times: int | None = 1, namespace: str | None = None, name: str | None = None,
        retry_after: int | None = None, message: str = "injected by the test",
    ) -> Fault:
        """Answer the next ``times`` matching requests with ``status`` (``None`` times: until cleared)."""
        fault = Fault(verb, resource, namespace, name, times, status=status, retry_after=retry_after, message=message)
        self._faults.append(fault)
        return fault

    def delay(
        self, seconds: float, *, verb: str | None = None, resource: str | None = None,
        times: int | None = 1, namespace: str | None = None, name: str | None = None,
    ) -> Delay:
        """Hold the next ``times`` matching requests for ``seconds`` before answering."""
        delay = Delay(verb, resource, namespace, name, times, seconds=seconds)
        self._delays.append(delay)
        return delay

    def clear_faults(self) -> None:
        self._faults.clear()
        self._delays.clear()

    def compact(self) -> None:
        """Forget the change history: a watch resuming from an older resourceVersion gets 410."""
        self._history.clear()
        self._compacted = self._rv

    def expire_watches(self) -> None:
        """Compact, and end every open watch with an in-stream ERROR 410 Expired."""
        self.compact()
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(_Signal("expire"))

    def drop_watches(self) -> None:
        """End every open watch cleanly (as at the server's timeout); clients resume from their RV."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(_Signal("stop"))

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK (current resourceVersion) on every open watch that allowed bookmarks."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(_Signal("bookmark", self._rv))

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    @property
    def resource_version(self) -> int:
        return self._rv

    def counts(self) -> Counter[tuple[str, str]]:
        """Requests so far per (verb, resource), e.g. ``counts()[("list", "pods")]``."""
        return Counter((r.verb, r.resource) for r in self.requests)

    def verbs_seen(self) -> set[tuple[str, str, str]]:
        """(apiGroup, resource[/subresource], verb) of every request so far: what RBAC must allow."""
        return {(r.group, r.plural + (f"/{r.subresource}" if r.subresource else ""), r.verb) for r in self.requests}

    def reset_log(self) -> None:
        self.requests.clear()

    # ------------------------------------------------------------------ direct access (no HTTP)
    def resource_type(self, resource: str) -> ResourceType:
        """Look a kind up by ``plural.group`` (``rayclusters.ray.io``) or by an unambiguous plural."""
        matches = [t for t in self._types.values() if resource in (t.key, t.plural)]
        exact = [t for t in matches if t.key == resource]
        if exact:
            return exact[0]
        if len(matches) != 1:
            raise KeyError(f"unknown or ambiguous resource {resource!r}")
        return matches[0]

    def _type_of(self, obj: Mapping[str, Any]) -> ResourceType:
        api_version = obj.get("apiVersion", "")
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        rtype = self._by_kind.get((group, obj.get("kind", "")))
        if rtype is None:
            raise KeyError(f"no resource for {api_version} {obj.get('kind')}")
        return rtype

    def create(self, obj: Mapping[str, Any]) -> JsonObj:
        """Create an object (``apiVersion`` + ``kind`` say which resource) as an outside actor would."""
        rtype = self._type_of(obj)
        version = obj["apiVersion"].rsplit("/", 1)[-1]
        created = self._create(rtype, copy.deepcopy(dict(obj)), namespace=obj.get("metadata", {}).get("namespace"))
        return self._serve(created, rtype, version=version)

    def seed(self, *objects: Mapping[str, Any]) -> list[JsonObj]:
        """Create several objects (``put`` semantics: an existing one is replaced)."""
        return [self.put(obj) for obj in objects]

    def put(self, obj: Mapping[str, Any]) -> JsonObj:
        """Create, or replace whatever is there (no resourceVersion check), status included."""
        rtype = self._type_of(obj)
        meta = obj.get("metadata", {})
        current = self._stores[rtype.store].get((meta.get("namespace") or "", meta.get("name", "")))
        if current is None:
            return self.create(obj)
        new = copy.deepcopy(dict(obj))
        new["metadata"] = {**new.get("metadata", {}), "resourceVersion": current["metadata"]["resourceVersion"]}
        return self._update(rtype, current, new=new, status_only=None)

    def get(self, resource: str, name: str, *, namespace: str | None = None) -> JsonObj | None:
        rtype = self.resource_type(resource)
        obj = self._stores[rtype.store].get((namespace or "", name))
        return copy.deepcopy(_view(rtype, obj)) if obj is not None else None

    def list(self, resource: str, *, namespace: str | None = None, label_selector: str | None = None) -> list[JsonObj]:
        rtype = self.resource_type(resource)
        labels = LabelSelector(label_selector)
        return [
            copy.deepcopy(_view(rtype, o)) for (ns, _), o in sorted(self._stores[rtype.store].items())
            if (namespace is None or ns == namespace) and labels.matches(o["metadata"].get("labels"))
        ]

    def patch(self, resource: str, name: str, body: Any, *, namespace: str | None = None, kind: str = "merge") -> JsonObj:
        """Patch an object (``kind``: merge | json | strategic), status included, as an outside actor."""
        rtype = self.resource_type(resource)
        current = self._current(rtype, namespace=namespace, name=name)
        new = self._apply_patch(rtype, current, patch=body, kind=kind)
        return self._update(rtype, current, new=new, status_only=None)

    def delete(self, resource: str, name: str, *, namespace: str | None = None) -> None:
        rtype = self.resource_type(resource)
        self._delete(rtype, self._current(rtype, namespace=namespace, name=name), preconditions=None)

    # ------------------------------------------------------------------ storage core
    def _current(self, rtype: ResourceType, *, namespace: str | None, name: str) -> JsonObj:
        obj = self._stores[rtype.store].get((namespace or "", name))
        if obj is None:
            raise _not_found(rtype, name)
        return obj

    def _commit(self, rtype: ResourceType, *, kind: str, obj: JsonObj, old: JsonObj | None) -> JsonObj:
        """Give ``obj`` the next resourceVersion, store (or drop) it, and tell the watches."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        store_key = rtype.store
        key = (obj["metadata"].get("namespace") or "", obj["metadata"]["name"])
        if kind == "DELETED":
            self._stores[store_key].pop(key, None)
        else:
            self._stores[store_key][key] = obj
        change = _Change(self._rv, store_key, kind, obj, old)
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self._compacted = self._history.popleft().rv
        for watcher in self._watchers:
            if watcher.rtype.store == store_key:
                watcher.queue.put_nowait(change)
        return obj

    def _create(self, rtype: ResourceType, obj: JsonObj, *, namespace: str | None,
                schema_version: str | None = None) -> JsonObj:
        obj = _stored(rtype, obj)
        meta = obj.setdefault("metadata", {})
        if rtype.namespaced:
            body_ns = meta.get("namespace")
            if namespace and body_ns and body_ns != namespace:
                raise _bad("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = namespace or body_ns or "default"
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise ApiError(422, f"{rtype.kind} is invalid: metadata.name: Required value: "
                                    "name or generateName is required")
        name = meta["name"]
        if len(name) > 253 or not _NAME.match(name):
            raise ApiError(422, f'{rtype.kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": '
                                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                "characters, '-' or '.'")
        store = self._stores[rtype.store]
        if (meta.get("namespace") or "", name) in store:
            raise ApiError(409, f'{rtype.key} "{name}" already exists', reason="AlreadyExists",
                           details={"name": name, "group": rtype.group, "kind": rtype.plural})
        meta.pop("resourceVersion", None)
        meta.pop("deletionTimestamp", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        obj.setdefault("apiVersion", rtype.api_version(rtype.versions[0]))
        obj.setdefault("kind", rtype.kind)
        self._normalise(rtype, obj)
        if schema_version is not None:
            self._validate(rtype, _view(rtype, obj))
            obj = self._admit(rtype, obj, version=schema_version)
            for webhook in self.webhooks:
                webhook(rtype, obj, None)
        return self._commit(rtype, kind="ADDED", obj=obj, old=None)

    @staticmethod
    def _defaulted(rtype: ResourceType, obj: JsonObj, *, version: str) -> JsonObj:
        """A custom resource as its CRD schema stores it: pruned, its defaults filled in (a copy)."""
        schema = None if rtype.builtin else crdschema.schema_for(rtype.api_version(version), rtype.kind)
        if schema is None:
            return obj
        pruned = crdschema.prune(copy.deepcopy(obj), schema, root=True)
        _schema_default(pruned, {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items()
                                                          if k != "metadata"}})
        return pruned

    @classmethod
    def _admit(cls, rtype: ResourceType, obj: JsonObj, *, version: str) -> JsonObj:
        """A custom resource written over HTTP: pruned, then validated against its CRD schema (422)."""
        schema = None if rtype.builtin else crdschema.schema_for(rtype.api_version(version), rtype.kind)
        if schema is None:
            return obj
        pruned = cls._defaulted(rtype, obj, version=version)
        body = {k: v for k, v in pruned.items() if k != "metadata"}
        checked = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
        found = sorted({_schema_error(e) for e in jsonschema.Draft7Validator(checked).iter_errors(body)})
        if found:
            raise _invalid(rtype, obj["metadata"].get("name", ""), found)
        return pruned

    @staticmethod
    def _validate(rtype: ResourceType, obj: JsonObj, *, old: JsonObj | None = None) -> None:
        """A built-in kind written over HTTP: what kube-apiserver v1.37.2 refuses of the fields the
        tests write (pods and pod templates need containers with images, a pod's spec hardly
        changes, an events.k8s.io Event has a type); 422 Invalid."""
        if not rtype.builtin or rtype.group not in ("", "events.k8s.io"):
            return
        errors: list[tuple[str, str, str]] = []
        if rtype.plural == "pods" and old is None:
            errors = _containers_errors(obj.get("spec"), "spec")
        elif rtype.plural == "pods":
            errors = _pod_update_errors(old.get("spec") or {}, obj.get("spec") or {})
        elif rtype.plural == "podtemplates":
            errors = _containers_errors((obj.get("template") or {}).get("spec"), "template.spec")
        elif rtype.group == "events.k8s.io" and old is None and obj.get("type") not in ("Normal", "Warning"):
            # pkg/apis/core/validation/events.go ValidateEventCreate: type is Normal or Warning
            errors = [("type", "FieldValueInvalid", f'Invalid value: {_go_value(obj.get("type") or "")}: has invalid value: ')]
        if errors:
            raise _invalid(rtype, obj["metadata"].get("name", ""), errors)

    @staticmethod
    def _normalise(rtype: ResourceType, obj: JsonObj) -> None:
        # ObjectMeta's maps and lists are omitempty: an empty one is not stored (kubernetes
        # v1.37.2 staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/types.go), for custom resources too
        meta = obj.get("metadata") or {}
        for key in ("labels", "annotations", "finalizers", "ownerReferences"):
            if key in meta and not meta[key]:
                del meta[key]
        if rtype.group == "" and rtype.plural == "secrets" and obj.get("stringData"):
            data = obj.setdefault("data", {}) or {}
            for key, value in obj.pop("stringData").items():
                data[key] = base64.b64encode(str(value).encode()).decode()
            obj["data"] = data

    @staticmethod
    def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}

    def _update(self, rtype: ResourceType, current: JsonObj, *, new: JsonObj, status_only: bool | None,
                schema_version: str | None = None) -> JsonObj:
        """Store ``new`` in place of ``current`` with the server's rules.

        ``status_only``: True for the status subresource (only ``status`` is taken), False for the
        main resource of a kind with a status subresource (``status`` is kept), None to take all.
        ``schema_version``: the version of an HTTP request; a custom resource is then pruned and
        validated against that version's CRD schema (``crdschema``), 422 when invalid.
        """
        new = _stored(rtype, new)
        meta_in = new.get("metadata") or {}
        stale = meta_in.get("resourceVersion")
        if stale not in (None, "") and stale != current["metadata"]["resourceVersion"]:
            name = current["metadata"]["name"]
            raise ApiError(
                409,
                f'Operation cannot be fulfilled on {rtype.key} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                details={"name": name, "group": rtype.group, "kind": rtype.plural},
            )
        for fixed in ("name", "namespace"):
            if meta_in.get(fixed) not in (None, "") and meta_in.get(fixed) != current["metadata"].get(fixed):
                raise _bad(f"metadata.{fixed} does not match the object being updated")
        if status_only:
            result = copy.deepcopy(current)
            if "status" in new:
                result["status"] = copy.deepcopy(new["status"])
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(new)
            if status_only is False and rtype.status_subresource:
                if "status" in current:
                    result["status"] = copy.deepcopy(current["status"])
                else:
                    result.pop("status", None)
            meta = result.setdefault("metadata", {})
            for fixed in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "generation"):
                if fixed in current["metadata"]:
                    meta[fixed] = current["metadata"][fixed]
                else:
                    meta.pop(fixed, None)
            result["apiVersion"] = current["apiVersion"]
            result["kind"] = current["kind"]
            self._normalise(rtype, result)
            if self._spec_part(result) != self._spec_part(current):
                meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if schema_version is not None:
            if not status_only:
                self._validate(rtype, _view(rtype, result), old=_view(rtype, current))
            result = self._admit(rtype, result, version=schema_version)
            if not status_only and self.webhooks:
                # the real server hands a webhook the old object as stored: written through it, so
                # defaulted; one a test seeded directly is defaulted here the same way
                old = self._defaulted(rtype, current, version=schema_version)
                for webhook in self.webhooks:
                    webhook(rtype, result, old)
        if _without_rv(result) == _without_rv(current):
            return copy.deepcopy(current)  # a no-op write keeps its resourceVersion, as on the real server
        meta = result["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._commit(rtype, kind="DELETED", obj=result, old=current)
        return self._commit(rtype, kind="MODIFIED", obj=result, old=current)

    def _delete(self, rtype: ResourceType, current: JsonObj, *, preconditions: Mapping[str, Any] | None) -> JsonObj:
        meta = current["metadata"]
        for field_name, attr in (("uid", "uid"), ("resourceVersion", "resourceVersion")):
            wanted = (preconditions or {}).get(field_name)
            if wanted and wanted != meta.get(attr):
                raise ApiError(409, f"Precondition failed: {field_name.upper() if field_name == 'uid' else 'ResourceVersion'} "
                               f"in precondition: {wanted}, {field_name} in object meta: {meta.get(attr)}")
        result = copy.deepcopy(current)
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                result["metadata"]["deletionTimestamp"] = _now()
                return self._commit(rtype, kind="MODIFIED", obj=result, old=current)
            return result
        return self._commit(rtype, kind="DELETED", obj=result, old=current)

    def _apply_patch(self, rtype: ResourceType, current: JsonObj, *, patch: Any, kind: str) -> JsonObj:
        current = _view(rtype, current)
        if kind == "merge":
            if not isinstance(patch, dict):
                raise _bad("merge patch must be a JSON object")
            return merge_patch(current, patch)
        if kind == "json":
            try:
                return json_patch(current, patch)
            except ApiError as err:
                # kube-apiserver v1.37.2 staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go:
                # a patch that does not apply is a 422 whose message names no cause
                if err.code != 422:
                    raise
                raise ApiError(422, "the server rejected our request due to an error in our request") from err
        if kind == "strategic":
            if not rtype.builtin:
                raise ApiError(415, 'the body of the request was in an unknown format - accepted media types include: '
                               'application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml')
            if not isinstance(patch, dict):
                raise _bad("strategic merge patch must be a JSON object")
            keys = {**_META_MERGE_KEYS, **rtype.merge_keys}
            result = strategic_merge_patch(current, patch, merge_keys=keys)
            return result if isinstance(result, dict) else {}
        raise ApiError(415, f"unsupported patch type {kind!r}")

    def _serve(self, obj: JsonObj, rtype: ResourceType, *, version: str, in_list: bool = False) -> JsonObj:
        """The object as served at ``version`` (built-in list items carry no kind/apiVersion)."""
        obj = _view(rtype, obj)
        if in_list and rtype.builtin:
            return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
        api_version = rtype.api_version(version)
        if obj.get("apiVersion") != api_version:
            return {**obj, "apiVersion": api_version}
        return obj

    # ------------------------------------------------------------------ HTTP
    def _resolve(self, request: web.Request) -> _Call:
        """The resource, version, namespace, name, subresource and verb a request is about."""
        not_found = ApiError(404, "the server could not find the requested resource")
        parts = [p for p in request.path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise not_found
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            candidate = self._types.get((group, rest[2]))
            if candidate is not None and candidate.namespaced:
                namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise not_found
        rtype = self._types.get((group, rest[0]))
        if rtype is None or version not in rtype.versions:
            raise not_found
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (rtype.namespaced and name is not None and namespace is None) or (not rtype.namespaced and namespace):
            raise not_found
        if sub is not None and not (sub == "status" and rtype.status_subresource):
            raise not_found
        return _Call(verb=self._verb(request.method, name=name, query=request.query), rtype=rtype,
                     version=version, namespace=namespace, name=name, sub=sub)

    async def _named(self, request: web.Request, call: _Call) -> _Call:
        """``call`` as the test controls match it: a create names the object of its body (the URL
        has none), so ``delay``/``fail`` with ``name=`` can hold the create of one object."""
        if call.verb != "create" or call.name is not None or not (self._delays or self._faults):
            return call
        try:
            body = await request.json()  # aiohttp keeps the body: the dispatch reads it again
        except ValueError:
            return call
        name = ((body.get("metadata") or {}).get("name") if isinstance(body, dict) else None) or None
        return replace(call, name=name) if isinstance(name, str) else call

    @staticmethod
    def _verb(method: str, *, name: str | None, query: Mapping[str, str]) -> str:
        if method == "GET":
            if name is not None:
                return "get"
            return "watch" if _truthy(query.get("watch")) else "list"
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
        if verb:
            return verb
        if method == "DELETE":
            return "delete" if name is not None else "deletecollection"
        raise ApiError(405, f"method {method} is not allowed")

    def _authorize(self, request: web.Request, call: _Call) -> None:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized")
        if self.rbac is None:
            return
        rtype = call.rtype
        resource = rtype.plural + (f"/{call.sub}" if call.sub else "")
        if any(r.allows(verb=call.verb, group=rtype.group, resource=resource, namespace=call.namespace, name=call.name)
               for r in self.rbac):
            return
        scope = f'in the namespace "{call.namespace}"' if call.namespace else "at the cluster scope"
        subject = f'{rtype.key} "{call.name}"' if call.name else rtype.key
        raise ApiError(403, f'{subject} is forbidden: User "{self.user}" cannot {call.verb} resource "{resource}" '
            f'in API group "{rtype.group}" {scope}', details={"name": call.name or "", "group": rtype.group, "kind": rtype.plural})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in ("/healthz", "/readyz", "/livez"):
            return web.Response(text="ok")
        if path == "/version":
            return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-resilienced-emulator"})
        discovery = self._discovery(path)
        if discovery is not None:
            return web.json_response(discovery)
        record: dict[str, Any] = {}
        try:
            call = self._resolve(request)
            query = request.query
            record = {
                "verb": call.verb, "resource": call.rtype.key + (f"/{call.sub}" if call.sub else ""),
                "group": call.rtype.group, "plural": call.rtype.plural, "subresource": call.sub,
                "namespace": call.namespace, "name": call.name,
                "label_selector": query.get("labelSelector"), "field_selector": query.get("fieldSelector"),
                "content_type": request.headers.get("Content-Type") if request.method in ("PATCH", "PUT", "POST") else None,
            }
            self._authorize(request, call)
            matched = await self._named(request, call)
            for delay in self._delays:
                if delay.applies(matched):
                    delay.hits += 1
                    try:
                        await asyncio.wait_for(self._stopping.wait(), delay.seconds)
                    except TimeoutError:
                        pass
                    break
            for fault in self._faults:
                if fault.applies(matched):
                    fault.hits += 1
                    if fault.status == 0:
                        self._log(record, status=0)
                        if request.transport is not None:
                            request.transport.close()
                        return web.Response(status=500)
                    headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                    raise ApiError(fault.status, fault.message, headers=headers)
            if call.verb == "watch":
                self._log(record, status=200)
                return await self._watch(request, call)
            response = await self._dispatch(request, call)
            self._log(record, status=response.status)
            return response
        except asyncio.CancelledError:
            if record and record["verb"] != "watch":
                self._log(record, status=499)  # the client went away before the answer
            raise
        except ApiError as err:
            if record:
                self._log(record, status=err.code)
            return err.response()

    def _log(self, record: Mapping[str, Any], *, status: int) -> None:
        self.requests.append(RequestRecord(status=status, **record))

    def _discovery(self, path: str) -> JsonObj | None:
        parts = [p for p in path.split("/") if p]
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if parts == ["apis"]:
            groups: dict[str, list[str]] = {}
            for t in self._types.values():
                if t.group:
                    for v in t.versions:
                        if v not in groups.setdefault(t.group, []):
                            groups[t.group].append(v)
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                 "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}} for g, vs in groups.items()]}
        if parts == ["api", "v1"] or (len(parts) == 3 and parts[0] == "apis"):
            group, version = ("", "v1") if parts[0] == "api" else (parts[1], parts[2])
            listed = [t for t in self._types.values() if t.group == group and version in t.versions]
            if not listed:
                return None
            verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
            resources = []
            for t in listed:
                resources.append({"name": t.plural, "singularName": t.kind.lower(), "namespaced": t.namespaced,
                                  "kind": t.kind, "verbs": verbs})
                if t.status_subresource:
                    resources.append({"name": f"{t.plural}/status", "singularName": "", "namespaced": t.namespaced,
                                      "kind": t.kind, "verbs": ["get", "patch", "update"]})
            return {"kind": "APIResourceList", "apiVersion": "v1",
                    "groupVersion": f"{group}/{version}" if group else version, "resources": resources}
        return None

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw or b"null")
        except ValueError as err:
            raise _bad(f"the request body is not JSON: {err}") from err

    async def _dispatch(self, request: web.Request, call: _Call) -> web.Response:
        rtype, version, namespace, name = call.rtype, call.version, call.namespace, call.name or ""
        status_only = True if call.sub == "status" else (False if rtype.status_subresource else None)
        if call.verb == "get":
            return web.json_response(self._serve(self._current(rtype, namespace=namespace, name=name), rtype, version=version))
        if call.verb == "list":
            return web.json_response(self._list(call, request.query))
        if call.verb == "create":
            if call.sub is not None:
                raise ApiError(405, "create is not allowed on a subresource")
            body = await self._body(request)
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            self._check_kind(rtype, version=version, body=body)
            body = copy.deepcopy(body)
            if rtype.status_subresource:
                body.pop("status", None)  # status is written through the subresource only
            created = self._create(rtype, body, namespace=namespace, schema_version=version)
            return web.json_response(self._serve(created, rtype, version=version), status=201)
        if call.verb == "update":
            body = await self._body(request)
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            self._check_kind(rtype, version=version, body=body)
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise _bad("the name of the object does not match the name on the URL")
            if (rtype.create_on_update and call.sub is None
                    and (namespace or "", name) not in self._stores[rtype.store]):
                body = copy.deepcopy(body)
                body.setdefault("metadata", {}).update(name=name)
                body["metadata"].pop("resourceVersion", None)
                created = self._create(rtype, body, namespace=namespace, schema_version=version)
                return web.json_response(self._serve(created, rtype, version=version), status=201)
            current = self._current(rtype, namespace=namespace, name=name)
            updated = self._update(rtype, current, new=body, status_only=status_only, schema_version=version)
            return web.json_response(self._serve(updated, rtype, version=version))
        if call.verb == "patch":
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            kind = {
                "application/merge-patch+json": "merge",
                "application/json-patch+json": "json",
                "application/strategic-merge-patch+json": "strategic",
            }.get(content_type)
            if kind is None:
                raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: "
                               "application/json-patch+json, application/merge-patch+json, "
                               f"application/strategic-merge-patch+json (got {content_type!r})")
            body = await self._body(request)
            current = self._current(rtype, namespace=namespace, name=name)
            patched = self._apply_patch(rtype, current, patch=body, kind=kind)
            precondition = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
            patched.setdefault("metadata", {})["resourceVersion"] = precondition or current["metadata"]["resourceVersion"]
            updated = self._update(rtype, current, new=patched, status_only=status_only, schema_version=version)
            return web.json_response(self._serve(updated, rtype, version=version))
        if call.verb == "delete":
            body = await self._body(request) if request.can_read_body else None
            preconditions = (body or {}).get("preconditions") if isinstance(body, dict) else None
            current = self._current(rtype, namespace=namespace, name=name)
            result = self._delete(rtype, current, preconditions=preconditions)
            if result["metadata"].get("deletionTimestamp") and result["metadata"].get("finalizers"):
                return web.json_response(self._serve(result, rtype, version=version))
            return web.json_response({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": rtype.group, "kind": rtype.plural, "uid": result["metadata"]["uid"]},
            })
        raise ApiError(405, f"{call.verb} is not supported by the emulator")

    @staticmethod
    def _check_kind(rtype: ResourceType, *, version: str, body: Mapping[str, Any]) -> None:
        if not rtype.builtin:  # decoded as unstructured: kubernetes v1.37.2 apimachinery unstructured.go
            for key, said in (("kind", "Kind"), ("apiVersion", "apiVersion")):
                if not body.get(key):
                    raise _bad(f"the object provided is unrecognized (must be of type {rtype.kind}): "
                               f"Object '{said}' is missing in '{json.dumps(body)}'")
        if body.get("kind") not in (None, "", rtype.kind):
            raise _bad(f"the kind of the object ({body.get('kind')}) does not match the URL ({rtype.kind})")
        if body.get("apiVersion") not in (None, "", rtype.api_version(version)):
            raise _bad(f"the apiVersion of the object ({body.get('apiVersion')}) does not match the URL ({rtype.api_version(version)})")

    def _selected(self, rtype: ResourceType, *, namespace: str | None, labels: LabelSelector,
                  fields: FieldSelector) -> list[tuple[tuple[str, str], JsonObj]]:
        name = fields.name()
        store = self._stores[rtype.store]
        if name is not None and namespace is not None:
            obj = store.get((namespace, name))
            candidates = [((namespace, name), obj)] if obj is not None else []
        else:
            candidates = sorted(store.items())
        return [
            (key, obj) for key, obj in candidates
            if (namespace is None or key[0] == namespace)
            and labels.matches(obj["metadata"].get("labels")) and fields.matches(_view(rtype, obj))
        ]

    def _list(self, call: _Call, query: Mapping[str, str]) -> JsonObj:
        rtype, version, namespace = call.rtype, call.version, call.namespace
        labels = LabelSelector(query.get("labelSelector"))
        fields = FieldSelector(query.get("fieldSelector"), rtype)
        items = self._selected(rtype, namespace=namespace, labels=labels, fields=fields)
        list_rv = self._rv
        token = query.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                after, list_rv = tuple(state["after"]), int(state["rv"])
            except (ValueError, KeyError, TypeError) as err:
                raise _bad("continue key is not valid") from err
            if list_rv < self._compacted:
                raise ApiError(410, "The provided continue parameter is too old to display a consistent list "
                                    "result. You can start a new list without the continue parameter.")
            items = [(k, o) for k, o in items if k > after]
        meta: JsonObj = {"resourceVersion": str(list_rv)}
        limit = int(query.get("limit") or 0)
        if limit > 0 and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"after": list(items[-1][0]), "rv": list_rv}).encode()).decode()
            meta["remainingItemCount"] = remaining
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version(version),
            "metadata": meta,
            "items": [self._serve(o, rtype, version=version, in_list=True) for _, o in items],
        }

    async def _watch(self, request: web.Request, call: _Call) -> web.StreamResponse:
        rtype, version, namespace, query = call.rtype, call.version, call.namespace, request.query
        watcher = _Watcher(rtype, version, namespace, LabelSelector(query.get("labelSelector")),
                           FieldSelector(query.get("fieldSelector"), rtype), _truthy(query.get("allowWatchBookmarks")))
        rv_param = query.get("resourceVersion") or ""
        initial: list[tuple[str, JsonObj]] = []
        expired = False
        # No await between reading the state and registering: no change can slip between the two.
        if rv_param in ("", "0"):
            initial = [("ADDED", o) for _, o in self._selected(rtype, namespace=namespace, labels=watcher.labels, fields=watcher.fields)]
        else:
            try:
                since = int(rv_param)
            except ValueError as err:
                raise _bad(f"invalid resource version {rv_param!r}") from err
            if since < self._compacted:
                expired = True
            else:
                for change in self._history:
                    if change.rv > since and change.store == rtype.store:
                        event = self._event_for(watcher, change)
                        if event is not None:
                            initial.append(event)
        self._watchers.add(watcher)
        timeout = float(query.get("timeoutSeconds") or 0) or None
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        next_bookmark = loop.time() + self.bookmark_interval if self.bookmark_interval else None
        try:
            await response.prepare(request)
            if expired:
                await self._send_error_410(response, rv_param)
                return response
            for kind, obj in initial:
                await self._send(response, kind=kind, obj=self._serve(obj, rtype, version=version))
            while not self._stopping.is_set():
                now = loop.time()
                waits = [0.5] + [t - now for t in (deadline, next_bookmark) if t is not None]
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), max(0.0, min(waits)))
                except TimeoutError:
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        break
                    if next_bookmark is not None and now >= next_bookmark:
                        next_bookmark = now + (self.bookmark_interval or 0)
                        if watcher.bookmarks:
                            await self._send_bookmark(response, rtype=rtype, version=version, rv=self._rv)
                    if request.transport is None or request.transport.is_closing():
                        break
                    continue
                if isinstance(item, _Signal):
                    if item.name == "stop":
                        break
                    if item.name == "expire":
                        await self._send_error_410(response, rv_param)
                        break
                    if item.name == "bookmark" and watcher.bookmarks:
                        await self._send_bookmark(response, rtype=rtype, version=version, rv=item.rv)
                    continue
                event = self._event_for(watcher, item)
                if event is not None:
                    await self._send(response, kind=event[0], obj=self._serve(event[1], rtype, version=version))
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    @staticmethod
    def _event_for(watcher: _Watcher, change: _Change) -> tuple[str, JsonObj] | None:
        now_visible = watcher.visible(change.obj)
        if change.type == "MODIFIED":
            was_visible = change.old is not None and watcher.visible(change.old)
            if now_visible and was_visible:
                return "MODIFIED", change.obj
            if now_visible:
                return "ADDED", change.obj
            if was_visible:
                return "DELETED", change.obj
            return None
        return (change.type, change.obj) if now_visible else None

    @staticmethod
    async def _send(response: web.StreamResponse, *, kind: str, obj: JsonObj) -> None:
        await response.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())

    async def _send_bookmark(self, response: web.StreamResponse, *, rtype: ResourceType, version: str, rv: int) -> None:
        await self._send(response, kind="BOOKMARK", obj={"kind": rtype.kind, "apiVersion": rtype.api_version(version),
                                                          "metadata": {"resourceVersion": str(rv)}})

    async def _send_error_410(self, response: web.StreamResponse, rv: str) -> None:
        await self._send(response, kind="ERROR", obj=status_body(
            410, reason="Expired", message=f"too old resource version: {rv or 0} ({self._compacted})"))
