"""The CustomResourceDefinitions the real control plane serves.

* ray.io (RayCluster, RayJob, RayService) and kueue.x-k8s.io: the YAMLs of the very modules the
  operators are built from (``build.py`` copies KubeRay's ``ray-operator/config/crd/bases`` and
  Kueue's ``config/components/crd/bases`` into the build's ``crds/``);
* Karpenter's NodePool and EC2NodeClass, Volcano's Job and Command, the Prometheus operator's
  ServiceMonitor and PrometheusRule: built from the schemas the tests keep
  (``tests/deploy/schemas``, SOURCES.json names each upstream file and tag), with the scope and
  subresources of the upstream CRD named in each row below;
* Karpenter's NodeClaim (``karpenter.sh/v1``, cluster-scoped, status subresource, as
  kubernetes-sigs/karpenter ``pkg/apis/crds/karpenter.sh_nodeclaims.yaml`` v1.6 declares it),
  which the tests keep no schema of: served with its fields unchecked
  (``x-kubernetes-preserve-unknown-fields``).

CRDs are created, not applied client-side (KubeRay's are over a megabyte: kubectl apply's
last-applied annotation would exceed the 256 KiB limit), and waited on until ``Established``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from . import build
from .rest import RestError

if TYPE_CHECKING:
    from .plane import ControlPlane

SCHEMAS = Path(__file__).resolve().parents[2] / "deploy" / "schemas"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@dataclass(frozen=True)
class Kept:
    """A CRD made from a kept schema: (group, kind, plural, version, scope, status subresource)."""

    group: str
    kind: str
    plural: str
    version: str
    scope: str
    status: bool
    schema_file: str | None  # None: fields unchecked

    def crd(self) -> dict[str, Any]:
        schema: dict[str, Any]
        if self.schema_file is None:
            schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        else:
            schema = json.loads((SCHEMAS / self.schema_file).read_text())
        version: dict[str, Any] = {"name": self.version, "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": schema}}
        if self.status:
            version["subresources"] = {"status": {}}
        return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{self.plural}.{self.group}"},
                "spec": {"group": self.group, "scope": self.scope,
                         "names": {"kind": self.kind, "plural": self.plural, "singular": self.kind.lower(),
                                   "listKind": f"{self.kind}List"},
                         "versions": [version]}}


KEPT = (
    # aws/karpenter-provider-aws v1.14.1 pkg/apis/crds/karpenter.sh_nodepools.yaml: Cluster, status
    Kept("karpenter.sh", "NodePool", "nodepools", "v1", "Cluster", True, "karpenter.sh/NodePool_v1.json"),
    # ... karpenter.k8s.aws_ec2nodeclasses.yaml: Cluster, status
    Kept("karpenter.k8s.aws", "EC2NodeClass", "ec2nodeclasses", "v1", "Cluster", True,
         "karpenter.k8s.aws/EC2NodeClass_v1.json"),
    # kubernetes-sigs/karpenter pkg/apis/crds/karpenter.sh_nodeclaims.yaml (v1.6): Cluster, status
    Kept("karpenter.sh", "NodeClaim", "nodeclaims", "v1", "Cluster", True, None),
    # volcano-sh/volcano v1.15.1 config/crd/volcano/bases/batch.volcano.sh_jobs.yaml: Namespaced, status
    Kept("batch.volcano.sh", "Job", "jobs", "v1alpha1", "Namespaced", True, "batch.volcano.sh/Job_v1alpha1.json"),
    # ... bus.volcano.sh_commands.yaml: Namespaced, no subresources
    Kept("bus.volcano.sh", "Command", "commands", "v1alpha1", "Namespaced", False,
         "bus.volcano.sh/Command_v1alpha1.json"),
    # prometheus-operator v0.93.0 example/prometheus-operator-crd: Namespaced, no subresources
    Kept("monitoring.coreos.com", "ServiceMonitor", "servicemonitors", "v1", "Namespaced", False,
         "monitoring.coreos.com/ServiceMonitor_v1.json"),
    Kept("monitoring.coreos.com", "PrometheusRule", "prometheusrules", "v1", "Namespaced", False,
         "monitoring.coreos.com/PrometheusRule_v1.json"),
)


def module_crds(component: str) -> list[dict[str, Any]]:
    """The CRDs a built component's modules ship (``build.py`` copied them into ``crds/``)."""
    folder = build.built(component) / "crds"
    out = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                out.append(doc)
    return out


def all_crds() -> list[dict[str, Any]]:
    return [*module_crds("kuberay"), *module_crds("kueue"), *(k.crd() for k in KEPT)]


def install_crds(plane: ControlPlane, crds: list[dict[str, Any]] | None = None) -> list[str]:
    """Create each CRD (a 409 replaces it) and wait until every one is Established; their names."""
    names = []
    for crd in crds if crds is not None else all_crds():
        if "kueue" in plane.components:
            from .operators import with_conversion_webhook

            crd = with_conversion_webhook(plane, crd)
        name = crd["metadata"]["name"]
        try:
            plane.admin.request("POST", CRD_PATH, crd)
        except RestError as err:
            if err.status != 409:
                raise RuntimeError(f"the API server refused the CRD {name}: {err}") from None
            current = plane.admin.request("GET", f"{CRD_PATH}/{name}")
            crd = {**crd, "metadata": {**crd["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
            plane.admin.request("PUT", f"{CRD_PATH}/{name}", crd)
        names.append(name)

    def established() -> bool:
        for name in names:
            conditions = (plane.admin.request("GET", f"{CRD_PATH}/{name}").get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
        return True

    plane.wait_for(f"the CRDs {names} Established", established)
    return names
