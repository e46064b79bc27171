"""The manifests build, and every object validates: built-in kinds against the Kubernetes
schema (kubernetes-validate, strict, the oldest and newest versions we claim), custom resources
against their CRD's schema (vendored, strict)."""

from __future__ import annotations

import copy
import json

import pytest

from . import crd
from .tools import BUILDS, REPO, build, dumps, run, tool

pytestmark = pytest.mark.integration

#: Kubernetes versions validated against: 1.33 (oldest EKS standard-support version the
#: manifests claim) and 1.37 (the newest schemas kubernetes-validate 1.37 ships).
K8S_VERSIONS = ("1.33.0", "1.37.0")

#: What each build must contain (a build that silently lost a file would still "build").
EXPECTED_KINDS = {
    "base": {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
             "RoleBinding", "ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
             "Service", "ServiceMonitor"},
    "overlay": {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                "RoleBinding", "ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
                "Service", "ServiceMonitor", "PrometheusRule"},
    "examples": {"Namespace", "PersistentVolume", "PersistentVolumeClaim", "ResourceFlavor",
                 "ClusterQueue", "LocalQueue", "EC2NodeClass", "NodePool", "RayJob"},
}


def _is_builtin(obj: dict) -> bool:
    """Built-in unless a CRD schema is vendored for it (an unknown kind then fails as no-schema)."""
    return (obj["apiVersion"], obj["kind"]) not in crd.sources()


def _k8s_validate(objects: list[dict]) -> list[dict]:
    done = run([tool("python"), str(REPO / "tests" / "deploy" / "k8s_validate.py"), *K8S_VERSIONS],
               input=json.dumps(objects), timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_kustomize_builds_with_every_expected_kind(name: str) -> None:
    kinds = {doc["kind"] for doc in build(name)}
    assert kinds == EXPECTED_KINDS[name]


def test_every_builtin_object_validates_strictly_against_the_kubernetes_schema() -> None:
    objects = [doc for name in sorted(BUILDS) for doc in build(name) if _is_builtin(doc)]
    assert len(objects) > 20
    results = _k8s_validate(objects)
    assert len(results) == len(objects) * len(K8S_VERSIONS)
    bad = [r for r in results if r["result"] != "ok"]
    assert not bad, dumps(bad)


def test_every_custom_resource_validates_against_its_vendored_crd_schema() -> None:
    customs = [doc for name in sorted(BUILDS) for doc in build(name) if not _is_builtin(doc)]
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in customs}
    assert len(kinds) == 8  # RayJob, ClusterQueue, LocalQueue, ResourceFlavor, NodePool, EC2NodeClass,
    #                        ServiceMonitor, PrometheusRule
    bad = {f"{doc['kind']}/{doc['metadata']['name']}": crd.errors(doc) for doc in customs}
    assert not {k: v for k, v in bad.items() if v}, dumps(bad)


# ---------------------------------------------------------------- the validators can say no
def test_the_kubernetes_validator_rejects_an_unknown_field_and_a_wrong_type() -> None:
    deployment = copy.deepcopy(next(d for d in build("base") if d["kind"] == "Deployment"))
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "two"
    results = _k8s_validate([unknown, wrong])
    assert results and all(r["result"] != "ok" for r in results), dumps(results)


def test_the_crd_validator_rejects_an_unknown_field_and_a_wrong_enum() -> None:
    rayjob = next(d for d in build("examples") if d["kind"] == "RayJob")
    unknown = copy.deepcopy(rayjob)
    unknown["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicaz"] = 2
    wrong = copy.deepcopy(rayjob)
    wrong["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert any("replicaz" in e for e in crd.errors(unknown))
    assert any("password" in e for e in crd.errors(wrong))
