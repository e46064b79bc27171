"""The KubeRay operator (ray-operator v1.6.0) and Kueue (v0.17.0) as host processes.

KubeRay runs as its ``main.go`` allows out of cluster: a kubeconfig, no leader election, health
on a port of ours, no webhooks (they are on only with ``ENABLE_WEBHOOKS=true``).

Kueue's webhook server always runs (``cmd/kueue/main.go``: ``webhooks.Setup``), and the API
server must reach it: as kwokctl v0.8.0 runs Kueue outside a cluster
(``pkg/kwokctl/components/kueue.go``, ``kueue_config.go``, ``kueue_manifest.go``), internal
certificate management is off, the webhook serves a certificate of the plane's CA from a folder of
ours, and the webhook configurations (``config/components/webhook/manifests.yaml``) and the CRDs'
conversion point at ``https://127.0.0.1:<port>`` with that CA.  Only the webhooks of the
integrations turned on are installed (Kueue's own kinds, ``batch/job``, ``ray.io/rayjob``,
``ray.io/raycluster``): a webhook of a framework whose CRDs are absent would refuse every object
of its kind.  With internal certificate management off, ``main.go`` reads the metrics server's
certificate from the fixed ``/etc/kueue/metrics/certs/tls.{crt,key}`` and exits without it: a
pair of the plane's CA is written there when none is (the metrics server itself is off,
``bindAddress: "0"``).  ``VisibilityOnDemand`` is off (it reads certificates from ``/visibility``).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from . import build

if TYPE_CHECKING:
    from .plane import ControlPlane

KUEUE_NAMESPACE = "kueue-system"
KUEUE_FRAMEWORKS = ("batch/job", "ray.io/rayjob", "ray.io/raycluster")
#: The webhook paths kept: Kueue's own kinds and the integrations above.
_KEPT_PATHS = ("kueue-x-k8s-io", "ray-io-v1-rayjob", "ray-io-v1-raycluster", "batch-v1-job")
METRICS_CERTS = Path("/etc/kueue/metrics/certs")


def _health(port: int) -> Any:
    def check() -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status == 200

    return check


def start_kuberay(plane: ControlPlane) -> None:
    from .plane import _wait, free_port

    assert plane.workdir is not None
    kubeconfig = plane.write_kubeconfig(plane.workdir / "kuberay.kubeconfig")
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("ENABLE_WEBHOOKS", None)
    process = plane._spawn("kuberay-operator", [
        build.program("ray-operator"), "--metrics-addr=0", f"--health-probe-bind-address=127.0.0.1:{port}",
        "--enable-leader-election=false",
    ], env=env)
    _wait("/readyz", _health(port), process=process)


# --------------------------------------------------------------------------- Kueue
def _kueue_port(plane: ControlPlane) -> int:
    from .plane import free_port

    port = getattr(plane, "kueue_webhook_port", 0)
    if not port:
        port = free_port()
        plane.kueue_webhook_port = port  # type: ignore[attr-defined]
    return int(port)


def _client_config(plane: ControlPlane, path: str) -> dict[str, Any]:
    import base64

    return {"url": f"https://127.0.0.1:{_kueue_port(plane)}{path}",
            "caBundle": base64.b64encode(plane.ca.read_bytes()).decode()}


#: The CRDs Kueue v0.17.0 converts through its webhook: those whose ``webhook_in_*.yaml`` patch its
#: ``config/components/crd/kustomization.yaml`` applies (ResourceFlavor's is commented out there:
#: its webhook answers "*v1beta2.ResourceFlavor is not convertible to *v1beta1.ResourceFlavor").
CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")


def with_conversion_webhook(plane: ControlPlane, crd: dict[str, Any]) -> dict[str, Any]:
    """Kueue's CRDs of :data:`CONVERTED` convert through its webhook, as
    ``config/components/crd/patches/webhook_in_*.yaml`` set it (strategy Webhook, path /convert)."""
    spec = crd.get("spec", {})
    if spec.get("group") != "kueue.x-k8s.io" or spec.get("names", {}).get("plural") not in CONVERTED:
        return crd
    out = copy.deepcopy(crd)
    out["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
        "conversionReviewVersions": ["v1"], "clientConfig": _client_config(plane, "/convert")}}
    return out


def _metrics_certs(plane: ControlPlane) -> None:
    if (METRICS_CERTS / "tls.crt").exists() and (METRICS_CERTS / "tls.key").exists():
        return
    from .plane import StartError

    try:
        METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        pair = plane._ca.serving("kueue-metrics")  # type: ignore[attr-defined]
        for source, name in ((pair.cert, "tls.crt"), (pair.key, "tls.key")):
            fd, tmp = tempfile.mkstemp(dir=METRICS_CERTS)
            os.close(fd)
            shutil.copyfile(source, tmp)
            os.replace(tmp, METRICS_CERTS / name)
    except OSError as err:
        raise StartError(f"Kueue v0.17.0 reads its metrics certificate from {METRICS_CERTS} and exits without "
                         f"one; writing one there failed ({err}): run as root, or create tls.crt and tls.key "
                         "there") from None


def webhook_configurations(plane: ControlPlane) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, the kept webhooks pointing at its host process."""
    manifests = build.built("kueue") / "webhooks" / "manifests.yaml"
    out = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        doc = copy.deepcopy(doc)
        doc["metadata"]["name"] = "kueue-" + doc["metadata"]["name"]
        kept = []
        for hook in doc.get("webhooks", []):
            path = hook["clientConfig"]["service"]["path"]
            if any(p in path for p in _KEPT_PATHS):
                hook["clientConfig"] = _client_config(plane, path)
                kept.append(hook)
        doc["webhooks"] = kept
        out.append(doc)
    return out


def start_kueue(plane: ControlPlane) -> None:
    from .plane import _wait, free_port
    from .rest import RestError

    assert plane.workdir is not None
    admin = plane.admin
    try:
        admin.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                     "metadata": {"name": KUEUE_NAMESPACE}})
    except RestError as err:
        if err.status != 409:
            raise
    _metrics_certs(plane)
    certs = plane.workdir / "kueue-webhook-certs"
    certs.mkdir(exist_ok=True)
    pair = plane._ca.serving("kueue-webhook")  # type: ignore[attr-defined]
    shutil.copyfile(pair.cert, certs / "tls.crt")
    shutil.copyfile(pair.key, certs / "tls.key")
    health = free_port()
    config = plane.workdir / "kueue-config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": _kueue_port(plane), "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
    }))
    kubeconfig = plane.write_kubeconfig(plane.workdir / "kueue.kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    process = plane._spawn("kueue", [
        build.program("kueue"), f"--config={config}", "--feature-gates=VisibilityOnDemand=false",
        "--zap-log-level=info",
    ], env=env)
    _wait("/readyz", _health(health), process=process)
    for doc in webhook_configurations(plane):
        plural = ("mutatingwebhookconfigurations" if doc["kind"] == "MutatingWebhookConfiguration"
                  else "validatingwebhookconfigurations")
        base = f"/apis/admissionregistration.k8s.io/v1/{plural}"
        try:
            admin.request("POST", base, doc)
        except RestError as err:
            if err.status != 409:
                raise
            current = admin.request("GET", f"{base}/{doc['metadata']['name']}")
            doc["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            admin.request("PUT", f"{base}/{doc['metadata']['name']}", doc)
