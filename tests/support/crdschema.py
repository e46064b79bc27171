"""What the API server does with a custom resource write, per the CRD's structural schema.

The schemas are the vendored ``openAPIV3Schema`` of each CRD at a pinned release, kept in
``tests/deploy/schemas/`` (``SOURCES.json`` names repository, tag, path and blob of each;
``tests/deploy/vendor_crds.py`` refreshes them): KubeRay v1.7.0 RayJob/RayCluster v1, Kueue
v0.19.2 Workload v1beta2 and v0.14.8 Workload v1beta1, Volcano v1.15.1 Job/Command v1alpha1.

The rules, as kube-apiserver applies them to a CRD write (kubernetes/kubernetes
``staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/customresource_handler.go``, v1.33):

* **pruning** (``pkg/apiserver/schema/pruning/algorithm.go``): a field the schema does not
  declare is dropped, unless ``x-kubernetes-preserve-unknown-fields`` (or
  ``additionalProperties``) covers it; ``apiVersion``, ``kind`` and ``metadata`` at the root are
  kept.  Without ``fieldValidation=Strict`` this is silent (a warning header at most): the
  default the kubernetes_asyncio client gets.
* **nulls** (``pkg/apiserver/schema/defaulting/prunenulls.go``): a ``null`` in a field that is
  not ``nullable: true`` is dropped before validation.
* **validation** (``pkg/apiserver/validation``): type, enum, required, minimum/maximum,
  pattern, min/maxItems, min/maxLength ... against the schema; any violation is ``422 Invalid``
  and nothing is stored.  CEL rules (``x-kubernetes-validations``) are not evaluated here.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).resolve().parents[1] / "deploy" / "schemas"
_ROOT_KEEP = frozenset({"apiVersion", "kind", "metadata"})


@cache
def _records() -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["apiVersion"], r["kind"]): r for r in json.loads((SCHEMAS / "SOURCES.json").read_text())}


@cache
def schema_for(api_version: str, kind: str) -> dict[str, Any] | None:
    """The vendored schema of ``kind`` at ``api_version`` (None when none is vendored)."""
    record = _records().get((api_version, kind))
    return json.loads((SCHEMAS / record["file"]).read_text()) if record else None


def source_of(api_version: str, kind: str) -> str | None:
    """``owner/repo@tag:path`` the schema was taken from."""
    record = _records().get((api_version, kind))
    return f"{record['repo']}@{record['tag']}:{record['path']}" if record else None


def prune(value: Any, schema: dict[str, Any], *, root: bool = False) -> Any:
    """``value`` with undeclared fields and non-nullable nulls removed (a new object)."""
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        out = {}
        for key, item in value.items():
            sub = (props or {}).get(key) if props is not None else None
            if sub is None and isinstance(extra, dict):
                sub = extra
            if root and key in _ROOT_KEEP:
                out[key] = item
            elif sub is not None:
                if item is None and not sub.get("nullable"):
                    continue
                out[key] = prune(item, sub)
            elif keep_unknown or (props is None and extra is None):
                out[key] = item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(item, schema["items"]) for item in value]
    return value


@cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator | None:
    schema = schema_for(api_version, kind)
    if schema is None:
        return None
    checked = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
    return jsonschema.Draft7Validator(checked)


def admit(obj: dict[str, Any], *, api_version: str, kind: str) -> tuple[dict[str, Any], list[str]]:
    """(the object as it would be stored, its violations as ``path: message``).

    Without a vendored schema the object is taken as it is.  Metadata is the API server's own
    business (checked by the emulator itself).
    """
    schema, validator = schema_for(api_version, kind), _validator(api_version, kind)
    if schema is None or validator is None:
        return obj, []
    pruned = prune(obj, schema, root=True)
    body = {k: v for k, v in pruned.items() if k != "metadata"}
    found = sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
                   for e in validator.iter_errors(body))
    return pruned, found
