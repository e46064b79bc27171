"""Refresh the vendored CRD schemas under tests/deploy/schemas/ (run by hand, not by the tests).

Each CRD is read from a local git mirror of its project at a release tag; the served version's
``openAPIV3Schema`` is written as JSON with every ``description`` removed (they are ~85 % of the
bytes and validate nothing).  ``SOURCES`` pins what was taken; ``schemas/SOURCES.json`` records
it with the blob id so a reader can check the copy.

    python tests/deploy/vendor_crds.py MIRRORS   # MIRRORS/<owner>+<repo>/repo: git clones
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent / "schemas"

#: (owner/repo, tag, path of the CRD in the repo, versions to keep)
SOURCES = [
    ("ray-project/kuberay", "v1.7.0", "ray-operator/config/crd/bases/ray.io_rayjobs.yaml", ["v1"]),
    ("ray-project/kuberay", "v1.7.0", "ray-operator/config/crd/bases/ray.io_rayclusters.yaml", ["v1"]),
    ("kubernetes-sigs/kueue", "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_workloads.yaml", ["v1beta2"]),
    # v1beta1 as Kueue v0.14 serves it (its last release serving only v1beta1)
    ("kubernetes-sigs/kueue", "v0.14.8", "config/components/crd/bases/kueue.x-k8s.io_workloads.yaml", ["v1beta1"]),
    ("kubernetes-sigs/kueue", "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_clusterqueues.yaml", ["v1beta2"]),
    ("kubernetes-sigs/kueue", "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_localqueues.yaml", ["v1beta2"]),
    ("kubernetes-sigs/kueue", "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_resourceflavors.yaml", ["v1beta2"]),
    ("aws/karpenter-provider-aws", "v1.14.1", "pkg/apis/crds/karpenter.sh_nodepools.yaml", ["v1"]),
    ("aws/karpenter-provider-aws", "v1.14.1", "pkg/apis/crds/karpenter.k8s.aws_ec2nodeclasses.yaml", ["v1"]),
    ("volcano-sh/volcano", "v1.15.1", "config/crd/volcano/bases/batch.volcano.sh_jobs.yaml", ["v1alpha1"]),
    ("volcano-sh/volcano", "v1.15.1", "config/crd/volcano/bases/bus.volcano.sh_commands.yaml", ["v1alpha1"]),
    ("prometheus-operator/prometheus-operator", "v0.93.0",
     "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml", ["v1"]),
    ("prometheus-operator/prometheus-operator", "v0.93.0",
     "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml", ["v1"]),
]

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


def strip_descriptions(node: object) -> object:
    """Remove ``description`` from every schema node (not from a property named description)."""
    if not isinstance(node, dict):
        return node
    out = {k: v for k, v in node.items() if k != "description"}
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strip_descriptions(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strip_descriptions(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strip_descriptions(out[key])
    return out


def main(mirrors: Path) -> None:
    record = []
    for repo, tag, path, versions in SOURCES:
        git_dir = mirrors / repo.replace("/", "+") / "repo"
        text = subprocess.run(["git", "-C", str(git_dir), "show", f"{tag}:{path}"],
                              check=True, capture_output=True, text=True).stdout
        blob = subprocess.run(["git", "-C", str(git_dir), "rev-parse", f"{tag}:{path}"],
                              check=True, capture_output=True, text=True).stdout.strip()
        crd = yaml.safe_load(text)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["name"] not in versions:
                continue
            schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
            out = HERE / group / f"{kind}_{version['name']}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            record.append({"apiVersion": f"{group}/{version['name']}", "kind": kind, "file": str(out.relative_to(HERE)),
                           "repo": repo, "tag": tag, "path": path, "blob": blob})
    (HERE / "SOURCES.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/deploy/vendor_crds.py MIRRORS")
    main(Path(sys.argv[1]))
