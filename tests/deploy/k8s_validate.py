"""Run with the tools environment's Python: validate Kubernetes objects with kubernetes-validate.

stdin: a JSON list of objects; argv: Kubernetes versions (e.g. 1.33.0 1.37.0).  stdout: a JSON
list with one entry per (object, version): ``{"index", "version", "kind", "name", "result"}``
where result is ``"ok"``, ``"no-schema"`` (not a built-in kind) or the validation error.
Strict: a field the schema does not know is an error, as ``kubectl apply --validate=strict``.
"""

import json
import sys

import kubernetes_validate

out = []
for index, obj in enumerate(json.load(sys.stdin)):
    for version in sys.argv[1:]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            result = "ok"
        except kubernetes_validate.SchemaNotFoundError:
            result = "no-schema"
        except kubernetes_validate.ValidationError as e:
            result = f"{'.'.join(str(p) for p in e.path)}: {e.message}"
        out.append({"index": index, "version": version, "kind": obj.get("kind"),
                    "name": (obj.get("metadata") or {}).get("name"), "result": result})
json.dump(out, sys.stdout)
