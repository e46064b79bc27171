"""The three patch types, as kubernetes_asyncio sends them, with the API server's list semantics."""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node, raycluster, worker_group
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

MERGE = {"_content_type": "application/merge-patch+json"}
JSON = {"_content_type": "application/json-patch+json"}
TAINT_A = {"key": "a", "value": "1", "effect": "NoSchedule"}
TAINT_B = {"key": "b", "value": "2", "effect": "NoExecute"}

POD = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ml", "finalizers": ["x/keep"]},
    "spec": {
        "nodeSelector": {"karpenter.sh/capacity-type": "spot"},
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "containers": [
            {"name": "ray", "image": "ray:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
            {"name": "sidecar", "image": "side:1"},
        ],
    },
}


async def test_strategic_merge_replaces_node_taints_whole(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """spec.taints has no patch strategy in the Node type: a strategic patch replaces the list."""
    kubeapi.create(node("n1", None, taints=[TAINT_A]))
    patched = await k8s.CoreV1Api(api).patch_node("n1", {"spec": {"taints": [TAINT_B]}})
    assert [t.key for t in patched.spec.taints] == ["b"]


async def test_strategic_merge_on_pod_fields(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(POD)
    patch = {
        "metadata": {"finalizers": ["y/also"]},
        "spec": {
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
            "tolerations": [{"key": "reserved", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}},
            "containers": [
                {"name": "ray", "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]},
                {"name": "sidecar", "$patch": "delete"},
            ],
        },
    }
    await k8s.CoreV1Api(api).patch_namespaced_pod("p", "ml", patch)
    pod = kubeapi.get("pods", "p", namespace="ml")
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"karpenter.sh/capacity-type": "spot", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert spec["tolerations"] == [{"key": "reserved", "operator": "Exists"}]  # no patch strategy: replaced
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["b"]
    assert [c["name"] for c in spec["containers"]] == ["ray"]  # merged by name, sidecar deleted
    assert spec["containers"][0]["image"] == "ray:1"
    assert spec["containers"][0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}, {"name": "C", "value": "4"}]
    assert pod["metadata"]["finalizers"] == ["x/keep", "y/also"]  # merged as a set


async def test_strategic_merge_directives(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(POD)
    core = k8s.CoreV1Api(api)
    await core.patch_namespaced_pod("p", "ml", {"spec": {"nodeSelector": {"$patch": "replace", "only": "this"}}})
    await core.patch_namespaced_pod("p", "ml", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x/keep"]}})
    pod = kubeapi.get("pods", "p", namespace="ml")
    assert pod["spec"]["nodeSelector"] == {"only": "this"}
    assert pod["metadata"]["finalizers"] == []


async def test_merge_patch_null_deletes_and_lists_are_replaced(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc", annotations={"keep": "1", "drop": "2"}))
    custom = k8s.CustomObjectsApi(api)
    patched = await custom.patch_namespaced_custom_object(
        "ray.io", "v1", "ml", "rayclusters", "rc",
        {"metadata": {"annotations": {"drop": None, "new": "3"}}, "spec": {"workerGroupSpecs": [worker_group("g")]}},
        **MERGE)
    assert patched["metadata"]["annotations"] == {"keep": "1", "new": "3"}
    assert patched["spec"]["workerGroupSpecs"] == [worker_group("g")]


async def test_json_patch_operations(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc"))
    custom = k8s.CustomObjectsApi(api)
    ops = [
        {"op": "add", "path": "/spec/workerGroupSpecs/-", "value": worker_group("a")},
        {"op": "add", "path": "/spec/workerGroupSpecs/0", "value": worker_group("first")},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 4},
        {"op": "copy", "from": "/spec/rayVersion", "path": "/metadata/annotations/version"},
        {"op": "move", "from": "/metadata/annotations/version", "path": "/metadata/annotations/moved"},
        {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "a"},
        {"op": "remove", "path": "/spec/workerGroupSpecs/0"},
        {"op": "add", "path": "/metadata/annotations/a~1b", "value": "slash"},
    ]
    patched = await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc", ops)
    assert patched["spec"]["workerGroupSpecs"] == [worker_group("a", replicas=4)]
    assert patched["metadata"]["annotations"] == {"moved": "2.60.0", "a/b": "slash"}


async def test_json_patch_failed_test_is_422_and_changes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    before = kubeapi.create(raycluster("rc"))
    with pytest.raises(ApiException) as err:
        await k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
            "ray.io", "v1", "ml", "rayclusters", "rc",
            [{"op": "replace", "path": "/spec/rayVersion", "value": "9"},
             {"op": "test", "path": "/spec/rayVersion", "value": "2.60.0"}])
    assert err.value.status == 422
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml") == before


async def test_strategic_merge_on_a_custom_resource_is_415(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc"))
    with pytest.raises(ApiException) as err:
        await k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
            "ray.io", "v1", "ml", "rayclusters", "rc", {"spec": {}},
            _content_type="application/strategic-merge-patch+json")
    assert err.value.status == 415


async def test_resource_version_in_a_patch_is_a_precondition(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    created = kubeapi.create(node("n1", None))
    core = k8s.CoreV1Api(api)
    rv = created["metadata"]["resourceVersion"]
    await core.patch_node("n1", {"metadata": {"resourceVersion": rv}, "spec": {"taints": [TAINT_A]}})
    with pytest.raises(ApiException) as err:
        await core.patch_node("n1", {"metadata": {"resourceVersion": rv}, "spec": {"taints": [TAINT_B]}})
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "Conflict"
    assert [t["key"] for t in kubeapi.get("nodes", "n1")["spec"]["taints"]] == ["a"]


async def test_a_no_op_patch_keeps_the_resource_version(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    created = kubeapi.create(node("n1", None, labels={"a": "b"}))
    patched = await k8s.CoreV1Api(api).patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    assert patched.metadata.resource_version == created["metadata"]["resourceVersion"]
