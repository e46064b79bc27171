"""Validate custom resources against the vendored CRD schemas (tests/deploy/schemas/).

The schemas are the ``openAPIV3Schema`` of each CRD at a pinned release (``SOURCES.json`` says
which; ``vendor_crds.py`` refreshes them), descriptions removed.  Validation is strict like
``kubectl apply --validate=strict``: an object schema that lists its properties rejects any
other, unless it says ``x-kubernetes-preserve-unknown-fields`` or gives
``additionalProperties``.  CEL rules (``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema

from .tools import SCHEMAS


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: (value if key == "enum" else
                 {k: _strict(v) for k, v in value.items()} if key == "properties" else _strict(value))
           for key, value in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def sources() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the SOURCES.json record of its vendored schema."""
    return {(r["apiVersion"], r["kind"]): r for r in json.loads((SCHEMAS / "SOURCES.json").read_text())}


@cache
def validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    record = sources()[(api_version, kind)]
    schema = _strict(json.loads((SCHEMAS / record["file"]).read_text()))
    return jsonschema.Draft7Validator(schema)


def errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of a custom resource ("" path = the object itself)."""
    found = validator(obj["apiVersion"], obj["kind"]).iter_errors(obj)
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in found)
