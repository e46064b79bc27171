"""The emulator stores objects as the API server does: metadata, conflicts, status, deletes, auth."""

from __future__ import annotations

import base64
import json

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node, pod_template, raycluster
from tests.support.kubeapi import KubeApiServer, RbacRule

pytestmark = pytest.mark.integration

PODSETS = [{"name": "main", "count": 1, "template": pod_template()}]
EVICTED = {"type": "Evicted", "status": "True", "reason": "Deactivated", "message": "deactivated",
           "lastTransitionTime": "2026-08-20T12:00:00Z"}


async def test_create_sets_metadata_and_resource_versions_increase_across_kinds(api: k8s.ApiClient) -> None:
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    created_node = await core.create_node(node("n1", "i-00000000000000001"))
    created_rc = await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", raycluster("rc"))
    assert created_node.metadata.uid and created_node.metadata.creation_timestamp
    assert created_rc["metadata"]["generation"] == 1 and created_rc["metadata"]["uid"] != created_node.metadata.uid
    assert int(created_rc["metadata"]["resourceVersion"]) > int(created_node.metadata.resource_version)
    listed = await core.list_node()
    assert int(listed.metadata.resource_version) >= int(created_rc["metadata"]["resourceVersion"])


async def test_create_twice_is_409_already_exists(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    await core.create_node(node("n1", None))
    with pytest.raises(ApiException) as err:
        await core.create_node(node("n1", None))
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"


async def test_generate_name_and_invalid_names(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    pod = await core.create_namespaced_pod("ml", {"metadata": {"generateName": "worker-"}, "spec": {"containers": []}})
    assert pod.metadata.name.startswith("worker-") and len(pod.metadata.name) > len("worker-")
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod("ml", {"metadata": {"name": "Not_Valid"}, "spec": {}})
    assert err.value.status == 422


async def test_replace_with_stale_resource_version_is_409_conflict(api: k8s.ApiClient) -> None:
    leases = k8s.CoordinationV1Api(api)
    lease = await leases.create_namespaced_lease("ops", {"metadata": {"name": "l1"}, "spec": {"holderIdentity": "a"}})
    lease.spec.holder_identity = "b"
    updated = await leases.replace_namespaced_lease("l1", "ops", lease)
    assert updated.spec.holder_identity == "b"
    lease.spec.holder_identity = "c"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as err:
        await leases.replace_namespaced_lease("l1", "ops", lease)
    assert err.value.status == 409 and "Conflict" in err.value.body
    assert (await leases.read_namespaced_lease("l1", "ops")).spec.holder_identity == "b"


async def test_generation_bumps_on_spec_change_only(api: k8s.ApiClient) -> None:
    custom = k8s.CustomObjectsApi(api)
    await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayjobs",
                                                 {"apiVersion": "ray.io/v1", "kind": "RayJob",
                                                  "metadata": {"name": "j"}, "spec": {"suspend": False}})
    merge = {"_content_type": "application/merge-patch+json"}
    labelled = await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayjobs", "j",
                                                           {"metadata": {"labels": {"a": "b"}}}, **merge)
    assert labelled["metadata"]["generation"] == 1
    suspended = await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayjobs", "j",
                                                            {"spec": {"suspend": True}}, **merge)
    assert suspended["metadata"]["generation"] == 2


async def test_status_subresource_separates_status_from_spec(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    custom = k8s.CustomObjectsApi(api)
    body = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload", "metadata": {"name": "w"},
            "spec": {"active": True, "podSets": PODSETS}, "status": {"conditions": [{"type": "Admitted"}]}}
    created = await custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "ml", "workloads", body)
    assert "status" not in created  # status is written through the subresource only
    merge = {"_content_type": "application/merge-patch+json"}
    await custom.patch_namespaced_custom_object_status(
        "kueue.x-k8s.io", "v1beta1", "ml", "workloads", "w",
        {"spec": {"active": False}, "status": {"conditions": [EVICTED]}}, **merge)
    after_status = kubeapi.get("workloads.kueue.x-k8s.io", "w", namespace="ml")
    assert after_status["spec"]["active"] is True and after_status["status"]["conditions"][0]["type"] == "Evicted"
    await custom.patch_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", "ml", "workloads", "w",
        {"spec": {"active": False}, "status": {"conditions": []}}, **merge)
    after_main = kubeapi.get("workloads.kueue.x-k8s.io", "w", namespace="ml")
    assert after_main["spec"]["active"] is False and after_main["status"]["conditions"][0]["type"] == "Evicted"


async def test_two_versions_share_one_storage(api: k8s.ApiClient) -> None:
    custom = k8s.CustomObjectsApi(api)
    await custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "ml", "workloads",
                                                 {"metadata": {"name": "w"}, "spec": {"podSets": PODSETS}})
    seen = await custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "ml", "workloads", "w")
    assert seen["apiVersion"] == "kueue.x-k8s.io/v1beta2"


async def test_volcano_kinds_are_served(api: k8s.ApiClient) -> None:
    custom = k8s.CustomObjectsApi(api)
    await custom.create_namespaced_custom_object("batch.volcano.sh", "v1alpha1", "ml", "jobs",
                                                 {"metadata": {"name": "vj"}, "spec": {"minAvailable": 2}})
    await custom.create_namespaced_custom_object("bus.volcano.sh", "v1alpha1", "ml", "commands",
                                                 {"metadata": {"name": "restart"}, "action": "RestartJob"})
    jobs = await custom.list_namespaced_custom_object("batch.volcano.sh", "v1alpha1", "ml", "jobs")
    commands = await custom.list_namespaced_custom_object("bus.volcano.sh", "v1alpha1", "ml", "commands")
    assert [j["metadata"]["name"] for j in jobs["items"]] == ["vj"]
    assert commands["items"][0]["action"] == "RestartJob"


async def test_delete_preconditions_and_finalizers(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    leases = k8s.CoordinationV1Api(api)
    lease = await leases.create_namespaced_lease("ops", {"metadata": {"name": "l1"}, "spec": {}})
    with pytest.raises(ApiException) as err:
        await leases.delete_namespaced_lease("l1", "ops", body={"preconditions": {"resourceVersion": "1"}})
    assert err.value.status == 409
    await leases.delete_namespaced_lease("l1", "ops", body={"preconditions": {"uid": lease.metadata.uid}})
    assert kubeapi.get("leases", "l1", namespace="ops") is None

    custom = k8s.CustomObjectsApi(api)
    held_rc = raycluster("rc")
    held_rc["metadata"]["finalizers"] = ["ray.io/gcs-ft"]
    await custom.create_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", held_rc)
    await custom.delete_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc")
    held = kubeapi.get("rayclusters.ray.io", "rc", namespace="ml")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    await custom.patch_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc",
                                                {"metadata": {"finalizers": None}},
                                                _content_type="application/merge-patch+json")
    assert kubeapi.get("rayclusters.ray.io", "rc", namespace="ml") is None


async def test_missing_objects_are_404(api: k8s.ApiClient) -> None:
    with pytest.raises(ApiException) as err:
        await k8s.CoreV1Api(api).read_namespaced_secret("absent", "ml")
    assert err.value.status == 404 and "NotFound" in err.value.body


async def test_secret_string_data_is_stored_as_base64_data(api: k8s.ApiClient) -> None:
    core = k8s.CoreV1Api(api)
    await core.create_namespaced_secret("ml", {"metadata": {"name": "rc"}, "stringData": {"auth_token": "s3cr3t"}})
    secret = await core.read_namespaced_secret("rc", "ml")
    assert secret.string_data is None
    assert base64.b64decode(secret.data["auth_token"]).decode() == "s3cr3t"


async def test_bearer_token_is_required_when_set() -> None:
    async with KubeApiServer(token="right") as server:
        async with server.api_client(token="wrong") as wrong:
            with pytest.raises(ApiException) as err:
                await k8s.CoreV1Api(wrong).list_node()
            assert err.value.status == 401
        async with server.api_client() as right:
            assert (await k8s.CoreV1Api(right).list_node()).items == []


async def test_rbac_answers_403_like_the_api_server() -> None:
    rules = [
        RbacRule(verbs=frozenset({"get"}), api_groups=frozenset({""}), resources=frozenset({"secrets"}),
                 resource_names=frozenset({"rc"}), namespace="ml"),
        RbacRule(verbs=frozenset({"list"}), api_groups=frozenset({""}), resources=frozenset({"nodes"})),
    ]
    async with KubeApiServer(rbac=rules) as server:
        server.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rc", "namespace": "ml"}, "data": {}})
        server.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "other", "namespace": "ml"}, "data": {}})
        async with server.api_client() as client:
            core = k8s.CoreV1Api(client)
            await core.read_namespaced_secret("rc", "ml")
            await core.list_node()
            with pytest.raises(ApiException) as err:
                await core.read_namespaced_secret("other", "ml")
            assert err.value.status == 403
            status = json.loads(err.value.body)
            assert status["reason"] == "Forbidden"
            assert status["message"] == (
                'secrets "other" is forbidden: User "system:serviceaccount:resilienced:resilienced" '
                'cannot get resource "secrets" in API group "" in the namespace "ml"')
            with pytest.raises(ApiException) as err:
                await core.patch_node("n1", {"spec": {}})
            assert err.value.status == 403 and "at the cluster scope" in json.loads(err.value.body)["message"]


async def test_kubeconfig_file_reaches_the_server(kubeapi: KubeApiServer, tmp_path) -> None:
    from kubernetes_asyncio import config as k8s_config

    kubeapi.create(node("n1", None))
    path = kubeapi.write_kubeconfig(tmp_path / "kubeconfig")
    client = await k8s_config.new_client_from_config(config_file=str(path))
    async with client:
        assert [n.metadata.name for n in (await k8s.CoreV1Api(client).list_node()).items] == ["n1"]


async def test_events_in_both_apis(api: k8s.ApiClient) -> None:
    core, events = k8s.CoreV1Api(api), k8s.EventsV1Api(api)
    await core.create_namespaced_event("default", {
        "metadata": {"name": "n1.1"}, "involvedObject": {"kind": "Node", "name": "n1"}, "reason": "R", "message": "m"})
    await events.create_namespaced_event("default", {
        "metadata": {"name": "n1.2"}, "regarding": {"kind": "Node", "name": "n1"}, "reason": "R", "note": "m",
        "action": "A", "reportingController": "x/y", "reportingInstance": "i", "eventTime": "2026-01-01T00:00:00.000000Z"})
    assert [e.metadata.name for e in (await core.list_namespaced_event("default")).items] == ["n1.1"]
    found = await events.list_namespaced_event("default", field_selector="regarding.name=n1")
    assert [e.metadata.name for e in found.items] == ["n1.2"]
