"""The emulator stores objects as the API server does: metadata, conflicts, status, deletes, auth.

The tests with a ``kubeapi`` run on the emulator and on the real API server (tests/support/controlplane)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node, pod_template, raycluster
from tests.support.controlplane.facade import serve, server_params
from tests.support.kubeapi import KubeApiServer, RbacRule

pytestmark = pytest.mark.integration


@pytest.fixture(params=server_params())
async def kubeapi(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The emulator, and the real API server (tests/support/controlplane/facade.py) where the test
    can play there (``emulator_only()`` marks those that cannot)."""
    async with serve(request) as server:
        yield server


PODSETS = [{"name": "main", "count": 1, "template": pod_template()}]


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
    pod = await core.create_namespaced_pod("ml", {"metadata": {"generateName": "worker-"}, "spec": {
        "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.60.0"}]}})
    assert pod.metadata.name.startswith("worker-") and len(pod.metadata.name) > len("worker-")
    with pytest.raises(ApiException) as err:
        await core.create_namespaced_pod("ml", {"metadata": {"name": "Not_Valid"}, "spec": {}})
    assert err.value.status == 422
    with pytest.raises(ApiException) as err:  # a pod needs a container with an image (the emulator took none)
        await core.create_namespaced_pod("ml", {"metadata": {"generateName": "worker-"}, "spec": {
            "containers": [{"name": "ray-worker"}]}})
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["message"].endswith("is invalid: spec.containers[0].image: Required value")


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
    """On a Volcano Job, which no controller of the real plane writes (Kueue rewrites a Workload's
    conditions as soon as they change)."""
    custom = k8s.CustomObjectsApi(api)
    job = ("batch.volcano.sh", "v1alpha1", "ml", "jobs", "vj")
    body = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "vj"},
            "spec": {"minAvailable": 1}, "status": {"state": {"phase": "Pending"}}}
    created = await custom.create_namespaced_custom_object(*job[:4], body)
    assert not created.get("status")  # status is written through the subresource only
    merge = {"_content_type": "application/merge-patch+json"}
    await custom.patch_namespaced_custom_object_status(
        *job, {"spec": {"minAvailable": 2}, "status": {"state": {"phase": "Running"}}}, **merge)
    after_status = kubeapi.get("jobs.batch.volcano.sh", "vj", namespace="ml")
    assert after_status["spec"]["minAvailable"] == 1 and after_status["status"]["state"]["phase"] == "Running"
    await custom.patch_namespaced_custom_object(
        *job, {"spec": {"minAvailable": 2}, "status": {"state": {"phase": "Failed"}}}, **merge)
    after_main = kubeapi.get("jobs.batch.volcano.sh", "vj", namespace="ml")
    assert after_main["spec"]["minAvailable"] == 2 and after_main["status"]["state"]["phase"] == "Running"


async def test_two_versions_share_one_storage(api: k8s.ApiClient) -> None:
    custom = k8s.CustomObjectsApi(api)
    await custom.create_namespaced_custom_object("kueue.x-k8s.io", "v1beta1", "ml", "workloads", {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload", "metadata": {"name": "w"}, "spec": {"podSets": PODSETS}})
    seen = await custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "ml", "workloads", "w")
    assert seen["apiVersion"] == "kueue.x-k8s.io/v1beta2"


async def test_volcano_kinds_are_served(api: k8s.ApiClient) -> None:
    custom = k8s.CustomObjectsApi(api)
    await custom.create_namespaced_custom_object("batch.volcano.sh", "v1alpha1", "ml", "jobs", {
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "vj"}, "spec": {"minAvailable": 2}})
    await custom.create_namespaced_custom_object("bus.volcano.sh", "v1alpha1", "ml", "commands", {
        "apiVersion": "bus.volcano.sh/v1alpha1", "kind": "Command", "metadata": {"name": "restart"}, "action": "RestartJob"})
    jobs = await custom.list_namespaced_custom_object("batch.volcano.sh", "v1alpha1", "ml", "jobs")
    commands = await custom.list_namespaced_custom_object("bus.volcano.sh", "v1alpha1", "ml", "commands")
    assert [j["metadata"]["name"] for j in jobs["items"]] == ["vj"]
    assert commands["items"][0]["action"] == "RestartJob"


async def test_a_custom_resource_needs_its_kind_and_api_version(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """Decoded as unstructured, a custom resource's body must name its kind (400; the emulator took
    the URL's); a built-in kind's need not."""
    with pytest.raises(ApiException) as err:
        await k8s.CustomObjectsApi(api).create_namespaced_custom_object(
            "batch.volcano.sh", "v1alpha1", "ml", "jobs", {"metadata": {"name": "vj"}, "spec": {"minAvailable": 2}})
    assert err.value.status == 400
    assert "the object provided is unrecognized (must be of type Job): Object 'Kind' is missing" in json.loads(
        err.value.body)["message"]
    assert kubeapi.get("jobs.batch.volcano.sh", "vj", namespace="ml") is None
    await k8s.CoordinationV1Api(api).create_namespaced_lease("ops", {"metadata": {"name": "l1"}, "spec": {}})


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
    """One storage, two views (the emulator kept them apart); an events.k8s.io Event needs a type
    (422 without).  In ``ops``: the real plane's ``default`` holds the controllers' Events too."""
    core, events = k8s.CoreV1Api(api), k8s.EventsV1Api(api)
    pod = {"kind": "Pod", "name": "p1", "namespace": "ops"}
    await core.create_namespaced_event("ops", {
        "metadata": {"name": "p1.1"}, "involvedObject": pod, "reason": "R", "message": "m"})
    new = {"metadata": {"name": "p1.2"}, "regarding": pod, "reason": "R", "note": "n",
           "action": "A", "reportingController": "x/y", "reportingInstance": "i", "eventTime": "2026-01-01T00:00:00.000000Z"}
    with pytest.raises(ApiException) as err:
        await events.create_namespaced_event("ops", new)
    assert err.value.status == 422 and json.loads(err.value.body)["message"] == (
        'Event "p1.2" is invalid: type: Invalid value: "": has invalid value: ')
    await events.create_namespaced_event("ops", {**new, "type": "Normal"})
    in_core = (await core.list_namespaced_event("ops")).items
    assert [(e.metadata.name, e.involved_object.name, e.message) for e in in_core] == [("p1.1", "p1", "m"), ("p1.2", "p1", "n")]
    # as JSON: the client's events.k8s.io model wants an eventTime, which p1.1 has not
    found = json.loads(await (await events.list_namespaced_event(
        "ops", field_selector="regarding.name=p1", _preload_content=False)).read())["items"]
    assert [(e["metadata"]["name"], e["regarding"]["name"], e["note"]) for e in found] == [("p1.1", "p1", "m"), ("p1.2", "p1", "n")]
    assert (await events.read_namespaced_event("p1.2", "ops")).reporting_controller == "x/y"
