"""Label and field selectors, and paging, on list as the API server applies them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from .conftest import node, ray_pod
from tests.support.controlplane.facade import emulator_only, serve, server_params
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration


@pytest.fixture(params=server_params())
async def kubeapi(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The emulator, and the real API server (tests/support/controlplane/facade.py) where the test
    can play there (``emulator_only()`` marks those that cannot)."""
    async with serve(request) as server:
        yield server


PODS = [
    ray_pod("head", cluster="a", node_name="n1", ip="10.0.0.1", node_type="head"),
    ray_pod("w1", cluster="a", node_name="n1", ip="10.0.0.2", group="gpu"),
    ray_pod("w2", cluster="a", node_name="n2", ip="10.0.0.3", group="cpu", phase="Pending"),
    ray_pod("w3", cluster="b", node_name="n2", ip="10.0.0.4", group="gpu", namespace="other"),
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "ml", "labels": {"app": "web"}},
     "spec": {"nodeName": "n1", "containers": [{"name": "web", "image": "web:1"}]},  # a container needs an image
     "status": {"phase": "Running"}},
]


@pytest.fixture
def pods(kubeapi: KubeApiServer) -> None:
    kubeapi.seed(*PODS)


def seeded(listed: Any) -> list[str]:
    """The names of the listed pods that ``PODS`` seeded: the real plane is shared by the test
    process, and the cluster layer's runs before leave pods of their own in their namespaces."""
    names = {p["metadata"]["name"] for p in PODS}
    return sorted(p.metadata.name for p in listed.items if p.metadata.name in names)


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("ray.io/node-type", ["head", "w1", "w2", "w3"]),
        ("!ray.io/node-type", ["plain"]),
        ("ray.io/cluster=a", ["head", "w1", "w2"]),
        ("ray.io/cluster==b", ["w3"]),
        ("ray.io/cluster!=a", ["plain", "w3"]),
        ("ray.io/group in (gpu, cpu)", ["w1", "w2", "w3"]),
        ("ray.io/group notin (gpu)", ["head", "plain", "w2"]),
        ("ray.io/cluster=a,ray.io/node-type=worker", ["w1", "w2"]),
        ("ray.io/cluster=a,ray.io/group in (gpu,headgroup),ray.io/node-type!=head", ["w1"]),
    ],
    ids=["exists", "not-exists", "equals", "double-equals", "not-equals", "in", "notin", "and", "mixed"],
)
async def test_label_selectors(api: k8s.ApiClient, pods: None, selector: str, expected: list[str]) -> None:
    listed = await k8s.CoreV1Api(api).list_pod_for_all_namespaces(label_selector=selector)
    assert seeded(listed) == expected


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("spec.nodeName=n1", ["head", "plain", "w1"]),
        ("spec.nodeName=n2,status.phase=Running", ["w3"]),
        ("status.phase!=Running", ["w2"]),
        ("metadata.namespace=other", ["w3"]),
        ("metadata.name==w1", ["w1"]),
        ("status.podIP=10.0.0.4", ["w3"]),
    ],
    ids=["node", "node-and-phase", "phase-not", "namespace", "name", "pod-ip"],
)
async def test_pod_field_selectors(api: k8s.ApiClient, pods: None, selector: str, expected: list[str]) -> None:
    listed = await k8s.CoreV1Api(api).list_pod_for_all_namespaces(field_selector=selector)
    assert seeded(listed) == expected


async def test_selectors_combine_with_the_namespace_of_the_path(api: k8s.ApiClient, pods: None) -> None:
    listed = await k8s.CoreV1Api(api).list_namespaced_pod(
        "ml", label_selector="ray.io/group=gpu", field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in listed.items] == ["w1"]


async def test_unsupported_field_label_is_400_as_on_the_real_server(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(node("n1", "i-00000000000000001"))
    with pytest.raises(ApiException) as err:
        await k8s.CoreV1Api(api).list_node(field_selector="spec.providerID=aws:///us-east-1a/i-00000000000000001")
    assert err.value.status == 400
    assert json.loads(err.value.body)["message"] == "field label not supported: spec.providerID"
    assert (await k8s.CoreV1Api(api).list_node(field_selector="spec.unschedulable=false")).items


async def test_malformed_label_selector_is_400(api: k8s.ApiClient) -> None:
    with pytest.raises(ApiException) as err:
        await k8s.CoreV1Api(api).list_pod_for_all_namespaces(label_selector="a in (b")
    assert err.value.status == 400


async def test_event_field_selectors_on_involved_object(api: k8s.ApiClient) -> None:
    """In a namespace of the test's own: on the real plane ``default`` also holds the node
    controller's Events and those the daemon's cluster tests recorded about their Nodes."""
    core = k8s.CoreV1Api(api)
    for name, kind, target, uid in (("e1", "Pod", "p1", "u1"), ("e2", "RayJob", "job", "u2"), ("e3", "Pod", "p2", "u3")):
        await core.create_namespaced_event("ops", {
            "metadata": {"name": name}, "involvedObject": {"kind": kind, "name": target, "uid": uid, "namespace": "ops"},
            "reason": "SpotInterruption", "type": "Warning", "source": {"component": "resilienced"},
            "reportingComponent": "resilienced.io/resilienced"})
    by_pod = await core.list_namespaced_event("ops", field_selector="involvedObject.kind=Pod,involvedObject.name=p1")
    assert [e.metadata.name for e in by_pod.items] == ["e1"]
    by_uid = await core.list_event_for_all_namespaces(field_selector="involvedObject.uid=u2")
    assert [e.metadata.name for e in by_uid.items] == ["e2"]
    by_source = await core.list_namespaced_event(
        "ops", field_selector="source=resilienced,reportingComponent=resilienced.io/resilienced,type=Warning")
    assert len(by_source.items) == 3


async def test_list_pages_with_limit_and_continue(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(*(node(f"n{i:02d}", None) for i in range(7)))
    core = k8s.CoreV1Api(api)
    first = await core.list_node(limit=3)
    assert [n.metadata.name for n in first.items] == ["n00", "n01", "n02"]
    assert first.metadata.remaining_item_count == 4 and first.metadata._continue
    names = [n.metadata.name for n in first.items]
    token = first.metadata._continue
    while token:
        page = await core.list_node(limit=3, _continue=token)
        names += [n.metadata.name for n in page.items]
        token = page.metadata._continue
    assert names == [f"n{i:02d}" for i in range(7)]


@emulator_only()  # compact(): the real server's etcd compacts on its own schedule
async def test_continue_token_older_than_compaction_is_410(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.seed(*(node(f"n{i}", None) for i in range(4)))
    core = k8s.CoreV1Api(api)
    first = await core.list_node(limit=2)
    kubeapi.create(node("n9", None))
    kubeapi.compact()
    with pytest.raises(ApiException) as err:
        await core.list_node(limit=2, _continue=first.metadata._continue)
    assert err.value.status == 410
