"""A small synchronous client of the real API server (TLS with the plane's CA, a bearer token).

The tests' own set-up and checks (namespaces, CRDs, seeding objects, reading what the daemon
wrote) use it; the daemon itself always goes through kubernetes_asyncio.  An answer of 400 and
above raises :class:`RestError` with the server's Status message.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

JsonObj = dict[str, Any]

#: group (""/"apps"/...) and plural of the kinds the tests write, by (apiVersion, kind).
CORE_PLURALS = {
    "Namespace": "namespaces", "Node": "nodes", "Pod": "pods", "Service": "services", "Secret": "secrets",
    "ConfigMap": "configmaps", "ServiceAccount": "serviceaccounts", "Event": "events",
    "PersistentVolumeClaim": "persistentvolumeclaims",
}


class RestError(Exception):
    def __init__(self, status: int, reason: str, body: JsonObj) -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"{status} {reason}: {body.get('message', body)}")


class Rest:
    """``request(method, path, body)`` against ``url`` with ``token``, verified by ``ca``."""

    def __init__(self, url: str, *, token: str, ca: Path, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._ssl = ssl.create_default_context(cafile=str(ca))

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                query: dict[str, str] | None = None) -> JsonObj:
        url = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                decoded = json.loads(raw or b"{}")
            except ValueError:
                decoded = {"message": raw.decode(errors="replace")}
            raise RestError(err.code, err.reason, decoded) from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            return {"text": raw.decode(errors="replace")}

    def text(self, path: str) -> str:
        """A plain GET (``/readyz``, ``/version``)."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=self._ssl, timeout=self.timeout) as resp:
            return resp.read().decode()

    # ------------------------------------------------------------------ objects by kind
    @staticmethod
    def base(api_version: str) -> str:
        return f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"

    def path(self, api_version: str, plural: str, *, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
        out = self.base(api_version)
        if namespace:
            out += f"/namespaces/{namespace}"
        out += f"/{plural}"
        if name:
            out += f"/{name}"
        if sub:
            out += f"/{sub}"
        return out

    def plural(self, api_version: str, kind: str) -> str:
        if "/" not in api_version and kind in CORE_PLURALS:
            return CORE_PLURALS[kind]
        found = self.request("GET", self.base(api_version))
        for resource in found.get("resources", []):
            if resource.get("kind") == kind and "/" not in resource["name"]:
                return str(resource["name"])
        raise KeyError(f"{api_version} serves no kind {kind}")

    def create(self, obj: JsonObj) -> JsonObj:
        meta = obj.get("metadata", {})
        plural = self.plural(obj["apiVersion"], obj["kind"])
        return self.request("POST", self.path(obj["apiVersion"], plural, namespace=meta.get("namespace")), obj)

    def apply_status(self, obj: JsonObj) -> JsonObj:
        """Write ``obj``'s status through the status subresource (a merge patch)."""
        meta = obj["metadata"]
        plural = self.plural(obj["apiVersion"], obj["kind"])
        return self.request("PATCH", self.path(obj["apiVersion"], plural, namespace=meta.get("namespace"),
                                               name=meta["name"], sub="status"),
                            {"status": obj["status"]}, content_type="application/merge-patch+json")
