"""The emulator rejects what kube-apiserver rejects for a custom resource write (see tests/support/crdschema.py).

Strategic merge on a custom resource (415), a stale resourceVersion (409) and status through the
main resource (ignored) are in test_kubeapi_patch.py / test_kubeapi_objects.py; here: the CRD
schema (422, pruning) and that every custom resource the emulator serves has its schema vendored.
"""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import pod_template, raycluster, worker_group
from tests.support import crdschema
from tests.support.kubeapi import RESOURCES, KubeApiServer

pytestmark = pytest.mark.integration

MERGE = {"_content_type": "application/merge-patch+json"}


def test_every_custom_resource_served_has_its_vendored_schema() -> None:
    for rtype in RESOURCES:
        if rtype.builtin:
            continue
        for version in rtype.versions:
            api_version = rtype.api_version(version)
            assert crdschema.schema_for(api_version, rtype.kind) is not None, api_version
            assert "@v" in (crdschema.source_of(api_version, rtype.kind) or ""), api_version  # repo@tag:path


async def test_a_write_that_breaks_the_schema_is_422_and_stores_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    custom = k8s.CustomObjectsApi(api)
    broken = raycluster("rc")
    broken["spec"]["workerGroupSpecs"] = [{**worker_group("g"), "replicas": "two"}]
    with pytest.raises(ApiException) as err:
        await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", broken)
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert "spec.workerGroupSpecs.0.replicas" in status["message"] and "'two' is not of type 'integer'" in status["message"]
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml") is None

    kubeapi.create(raycluster("rc"))
    before = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    with pytest.raises(ApiException) as err:  # a merge patch replacing the groups with ones missing their template
        await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc",
                                                    {"spec": {"workerGroupSpecs": [{"groupName": "g"}]}}, **MERGE)
    assert err.value.status == 422 and "'template' is a required property" in json.loads(err.value.body)["message"]
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml") == before


@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
async def test_a_workload_is_checked_against_its_version(api: k8s.ApiClient, version: str) -> None:
    custom = k8s.CustomObjectsApi(api)
    body = {"metadata": {"name": "w"}, "spec": {"active": "yes", "podSets": [{"name": "main", "count": 1,
                                                                                "template": pod_template()}]}}
    with pytest.raises(ApiException) as err:
        await custom.create_namespaced_custom_object("kueue.x-k8s.io", version, "ml", "workloads", body)
    assert err.value.status == 422 and "spec.active" in json.loads(err.value.body)["message"]


async def test_unknown_fields_and_nulls_are_pruned_not_rejected(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """No fieldValidation=Strict (the client's default): undeclared fields are dropped silently."""
    custom = k8s.CustomObjectsApi(api)
    body = raycluster("rc")
    body["spec"]["madeUp"] = {"a": 1}
    body["spec"]["headGroupSpec"]["serviceType"] = None
    created = await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", body)
    assert "madeUp" not in created["spec"] and "serviceType" not in created["spec"]["headGroupSpec"]
    stored = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    assert "madeUp" not in stored["spec"]
    # preserve-unknown-fields parts keep what they are given (a pod template's metadata labels are declared maps)
    assert stored["spec"]["headGroupSpec"]["rayStartParams"] == {}


async def test_direct_test_controls_are_not_validated(kubeapi: KubeApiServer) -> None:
    """Seeding from Python bypasses HTTP, admission and the schema (documented in the module)."""
    kubeapi.create({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "rc", "namespace": "ml"},
                    "spec": {}})
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")["spec"] == {}
