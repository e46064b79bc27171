"""The three patch types, as kubernetes_asyncio sends them, with the API server's list semantics.

Each test runs on the emulator and on the real API server (tests/support/controlplane), but those
that need the emulator's own controls.  The pod spec's strategic merge keys are shown on a
PodTemplate: a pod refuses every change of its spec but images and added tolerations (the real
server's ``ValidatePodUpdate``, which the emulator keeps too)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node, raycluster, worker_group
from tests.support.controlplane.facade import serve, server_params
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


@pytest.fixture(params=server_params())
async def kubeapi(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The emulator, and the real API server (tests/support/controlplane/facade.py) where the test
    can play there (``emulator_only()`` marks those that cannot)."""
    async with serve(request) as server:
        yield server


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
#: The same pod spec in a PodTemplate, whose template may change in every field.
TEMPLATE = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": POD["metadata"], "template": {"spec": POD["spec"]}}


async def test_strategic_merge_replaces_node_taints_whole(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """spec.taints has no patch strategy in the Node type: a strategic patch replaces the list."""
    kubeapi.create(node("n1", None, taints=[TAINT_A]))
    patched = await k8s.CoreV1Api(api).patch_node("n1", {"spec": {"taints": [TAINT_B]}})
    assert [t.key for t in patched.spec.taints] == ["b"]


async def test_strategic_merge_on_pod_fields(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(TEMPLATE)
    patch = {
        "metadata": {"finalizers": ["y/also"]},
        "template": {"spec": {
            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
            "tolerations": [{"key": "reserved", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}},
            "containers": [
                {"name": "ray", "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}]},
                {"name": "sidecar", "$patch": "delete"},
            ],
        }},
    }
    await k8s.CoreV1Api(api).patch_namespaced_pod_template("p", "ml", patch)
    pod = kubeapi.get("podtemplates", "p", namespace="ml")
    spec = pod["template"]["spec"]
    assert spec["nodeSelector"] == {"karpenter.sh/capacity-type": "spot", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert spec["tolerations"] == [{"key": "reserved", "operator": "Exists"}]  # no patch strategy: replaced
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["b"]
    assert [c["name"] for c in spec["containers"]] == ["ray"]  # merged by name, sidecar deleted
    assert spec["containers"][0]["image"] == "ray:1"
    assert spec["containers"][0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "3"}, {"name": "C", "value": "4"}]
    # merged as a set, a new element ahead of the server's (the emulator put it last)
    assert pod["metadata"]["finalizers"] == ["y/also", "x/keep"]


async def test_strategic_merge_directives(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(TEMPLATE)
    core = k8s.CoreV1Api(api)
    await core.patch_namespaced_pod_template(
        "p", "ml", {"template": {"spec": {"nodeSelector": {"$patch": "replace", "only": "this"}}}})
    await core.patch_namespaced_pod_template("p", "ml", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["x/keep"]}})
    template = kubeapi.get("podtemplates", "p", namespace="ml")
    assert template["template"]["spec"]["nodeSelector"] == {"only": "this"}
    assert "finalizers" not in template["metadata"]  # an empty list is not kept


async def test_strategic_merge_orders_a_merged_list_as_the_real_server(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """The patch's elements in its order, a new one ahead of the server's others (the emulator
    kept the server's order and put new elements last)."""
    kubeapi.create(TEMPLATE)
    patched = await k8s.CoreV1Api(api).patch_namespaced_pod_template("p", "ml", {"template": {"spec": {"containers": [
        {"name": "sidecar", "image": "side:2"},
        {"name": "ray", "env": [{"name": "D", "value": "5"}]}]}}})
    containers = patched.template.spec.containers
    assert [(c.name, c.image) for c in containers] == [("sidecar", "side:2"), ("ray", "ray:1")]
    assert [e.name for e in containers[1].env] == ["D", "A", "B"]


async def test_a_pod_spec_takes_new_images_and_added_tolerations_only(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """kube-apiserver's ValidatePodUpdate: containers neither come nor go, an existing toleration
    stays, and nothing else of the spec changes (422 Invalid); the emulator took all of them."""
    kubeapi.create(POD)
    core = k8s.CoreV1Api(api)
    await core.patch_namespaced_pod("p", "ml", {"spec": {"containers": [{"name": "ray", "image": "ray:2"}]}})
    await core.patch_namespaced_pod("p", "ml", [{"op": "add", "path": "/spec/tolerations/-",
                                                 "value": {"key": "reserved", "operator": "Exists"}}], **JSON)
    refused = [
        ({"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}]}}, "pod updates may not add or remove containers"),
        ({"spec": {"containers": [{"name": "ray", "env": [{"name": "C", "value": "4"}]}]}},
         "pod updates may not change fields other than `spec.containers[*].image`"),
        ({"spec": {"nodeName": "n9"}}, "pod updates may not change fields other than"),
        ({"spec": {"tolerations": [{"key": "reserved", "operator": "Exists"}]}},
         "existing toleration can not be modified except its tolerationSeconds"),
    ]
    for patch, said in refused:
        with pytest.raises(ApiException) as err:
            await core.patch_namespaced_pod("p", "ml", patch)
        status = json.loads(err.value.body)
        assert (err.value.status, status["reason"]) == (422, "Invalid") and said in status["message"], patch
        assert status["message"].startswith('Pod "p" is invalid: spec')
    spec = kubeapi.get("pods", "p", namespace="ml")["spec"]
    assert [(c["name"], c["image"]) for c in spec["containers"]] == [("ray", "ray:2"), ("sidecar", "side:1")]
    assert {"key": "reserved", "operator": "Exists"} in spec["tolerations"]
    assert {"key": "spot", "operator": "Exists"} in spec["tolerations"]
    assert "nodeName" not in spec and spec["containers"][0]["env"] == POD["spec"]["containers"][0]["env"]


def defaulted(group: dict) -> dict:
    """A worker group as stored: the CRD schema's default ``numOfHosts: 1`` filled in (the emulator
    stored it without)."""
    return {**group, "numOfHosts": 1}


def as_stored(groups: list[dict], written: dict) -> list[dict]:
    """The fields of ``written`` and ``numOfHosts`` of each stored group (KubeRay v1.7.0's schema,
    the emulator's, defaults ``priority: 0`` too, a field the plane's v1.5.0 does not have)."""
    return [{k: g[k] for k in (*written, "numOfHosts") if k in g} for g in groups]


async def test_merge_patch_null_deletes_and_lists_are_replaced(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc", annotations={"keep": "1", "drop": "2"}))
    custom = k8s.CustomObjectsApi(api)
    patched = await custom.patch_namespaced_custom_object(
        "ray.io", "v1", "ml", "rayclusters", "rc",
        {"metadata": {"annotations": {"drop": None, "new": "3"}}, "spec": {"workerGroupSpecs": [worker_group("g")]}},
        **MERGE)
    assert patched["metadata"]["annotations"] == {"keep": "1", "new": "3"}
    assert as_stored(patched["spec"]["workerGroupSpecs"], worker_group("g")) == [defaulted(worker_group("g"))]


async def test_json_patch_operations(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc", annotations={"keep": "1"}))  # an empty map is not stored: no path to add to
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
    assert as_stored(patched["spec"]["workerGroupSpecs"], worker_group("a")) == [defaulted(worker_group("a", replicas=4))]
    assert patched["metadata"]["annotations"] == {"keep": "1", "moved": "2.60.0", "a/b": "slash"}


async def test_json_patch_failed_test_is_422_and_changes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    before = kubeapi.create(raycluster("rc"))
    with pytest.raises(ApiException) as err:
        await k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
            "ray.io", "v1", "ml", "rayclusters", "rc",
            [{"op": "replace", "path": "/spec/rayVersion", "value": "9"},
             {"op": "test", "path": "/spec/rayVersion", "value": "2.60.0"}])
    assert err.value.status == 422
    assert json.loads(err.value.body)["message"] == "the server rejected our request due to an error in our request"
    after = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    # the spec as it was (on the real server KubeRay writes the status meanwhile)
    assert (after["spec"], after["metadata"]["generation"]) == (before["spec"], before["metadata"]["generation"])


async def test_strategic_merge_on_a_custom_resource_is_415(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(raycluster("rc"))
    with pytest.raises(ApiException) as err:
        await k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
            "ray.io", "v1", "ml", "rayclusters", "rc", {"spec": {}},
            _content_type="application/strategic-merge-patch+json")
    assert err.value.status == 415


async def test_resource_version_in_a_patch_is_a_precondition(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", None))  # the real one once kwok and the controllers are done
    core = k8s.CoreV1Api(api)
    for _ in range(5):  # on the real plane kwok's heartbeat may come between the read and the patch
        rv = kubeapi.get("nodes", "n1")["metadata"]["resourceVersion"]
        try:
            await core.patch_node("n1", {"metadata": {"resourceVersion": rv}, "spec": {"taints": [TAINT_A]}})
        except ApiException as raced:
            assert raced.status == 409
            continue
        break
    else:
        pytest.fail("another writer changed the Node between the read and the patch five times running")
    with pytest.raises(ApiException) as err:
        await core.patch_node("n1", {"metadata": {"resourceVersion": rv}, "spec": {"taints": [TAINT_B]}})
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "Conflict"
    assert [t["key"] for t in kubeapi.get("nodes", "n1")["spec"]["taints"]] == ["a"]


def _content(obj: dict) -> dict:
    """An object without what every write changes (its resourceVersion and managedFields)."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "managedFields")}
    return {**obj, "metadata": meta}


async def test_a_no_op_patch_keeps_the_resource_version(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """On the real plane other writers touch a new Node (the TTL controller's annotation, kwok's
    heartbeat): a window where one of them wrote shows in the patch's answer and is tried again;
    in a window of the patch alone the resourceVersion must not move."""
    kubeapi.create(node("n1", None, labels={"a": "b"}))
    core = k8s.CoreV1Api(api)
    for _ in range(5):
        before = kubeapi.get("nodes", "n1")
        answer = await core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}}, _preload_content=False)
        patched = json.loads(await answer.read())
        if _content(patched) == _content(before):
            assert patched["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
            return
    pytest.fail("another writer changed the Node between the read and the patch five times running")
