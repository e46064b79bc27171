"""The emulator rejects what kube-apiserver rejects for a custom resource write (see tests/support/crdschema.py).

Strategic merge on a custom resource (415), a stale resourceVersion (409) and status through the
main resource (ignored) are in test_kubeapi_patch.py / test_kubeapi_objects.py; here: the CRD
schema (422, pruning, defaults) and that every custom resource the emulator serves has its schema vendored.

The tests with a ``kubeapi`` run on the emulator and on the real API server too.  On the real
plane Kueue's mutating webhooks (its RayCluster, RayJob and Workload integrations) decode a write
before the schema is checked: a value Go cannot decode (a string for an integer) is their 400, not
the schema's 422.  So the type error is shown on a Volcano Job (no webhook), and the Workload's
violation is one Go decodes (a negative count).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import pod_template, raycluster
from tests.support import crdschema
from tests.support.controlplane.facade import emulator_only, serve, server_params
from tests.support.kubeapi import RESOURCES, KubeApiServer

pytestmark = pytest.mark.integration


@pytest.fixture(params=server_params())
async def kubeapi(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The emulator, and the real API server (tests/support/controlplane/facade.py) where the test
    can play there (``emulator_only()`` marks those that cannot)."""
    async with serve(request) as server:
        yield server


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
    broken = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "vj"},
              "spec": {"minAvailable": "two"}}
    with pytest.raises(ApiException) as err:
        await custom.create_namespaced_custom_object("batch.volcano.sh", "v1alpha1", "ml", "jobs", broken)
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"] == ('Job.batch.volcano.sh "vj" is invalid: spec.minAvailable: Invalid value: "string": '
                                 'spec.minAvailable in body must be of type integer: "string"')
    assert kubeapi.get("jobs.batch.volcano.sh", "vj", namespace="ml") is None

    kubeapi.create(raycluster("rc"))
    before = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    with pytest.raises(ApiException) as err:  # a merge patch replacing the groups with ones missing their template
        await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc",
                                                    {"spec": {"workerGroupSpecs": [{"groupName": "g"}]}}, **MERGE)
    message = json.loads(err.value.body)["message"]
    assert err.value.status == 422 and message.startswith('RayCluster.ray.io "rc" is invalid: ')
    assert "spec.workerGroupSpecs[0].template: Required value" in message
    after = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    assert after["spec"] == before["spec"]  # (KubeRay writes the status meanwhile on the real plane)


@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
async def test_a_workload_is_checked_against_its_version(api: k8s.ApiClient, version: str) -> None:
    custom = k8s.CustomObjectsApi(api)
    body = {"apiVersion": f"kueue.x-k8s.io/{version}", "kind": "Workload", "metadata": {"name": "w"},
            "spec": {"podSets": [{"name": "main", "count": -1, "template": pod_template()}]}}
    with pytest.raises(ApiException) as err:
        await custom.create_namespaced_custom_object("kueue.x-k8s.io", version, "ml", "workloads", body)
    assert err.value.status == 422 and json.loads(err.value.body)["message"] == (
        'Workload.kueue.x-k8s.io "w" is invalid: spec.podSets[0].count: Invalid value: -1: '
        "spec.podSets[0].count in body should be greater than or equal to 0")


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


@emulator_only()  # the real server has no way around its checks
async def test_direct_test_controls_are_not_validated(kubeapi: KubeApiServer) -> None:
    """Seeding from Python bypasses HTTP, admission and the schema (documented in the module)."""
    kubeapi.create({"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "rc", "namespace": "ml"},
                    "spec": {}})
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")["spec"] == {}
