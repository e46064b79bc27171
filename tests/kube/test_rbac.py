"""RBAC_RULES is enough and not more: the whole of kubernetes mode runs under exactly those rules."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from resilienced.errors import PermanentError
from resilienced.kube.cluster import KubeCluster
from resilienced.kube.events import EventRecorder
from resilienced.kube.followup_store import KubeFollowUps
from resilienced.kube.leases import KubeLeaseClaims
from resilienced.kube.rbac import RBAC_RULES, requested_verbs
from resilienced.kube.events import ObjectRef
from resilienced.kube.rbac import AUTH_SECRETS
from resilienced.model import Target
from .conftest import LOCAL_BOUND_S, FAST, KARPENTER_RESOURCES, KUEUE_QUEUE_RESOURCES, GcsFactory, eventually, instance, node, ray_node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer, RbacRule

pytestmark = pytest.mark.integration

LEASES_NS = "resilienced"
RAY_NS = "ml"


def emulated_rules(*, secrets: tuple[str, ...], drop: tuple[str, str] | None = None) -> list[RbacRule]:
    """RBAC_RULES as the bindings of docs/kubernetes.md would grant them (``drop``: leave one verb out)."""
    rules = []
    for rule in RBAC_RULES:
        if not rule.requested:
            continue
        verbs = frozenset(v for v in rule.verbs if drop is None or (rule.resources[0], v) != drop)
        namespace = {"cluster": None, "lease-namespace": LEASES_NS, "ray-namespace": RAY_NS}[rule.scope]
        names = frozenset(secrets if AUTH_SECRETS in rule.resource_names else rule.resource_names)
        rules.append(RbacRule(verbs=verbs, api_groups=frozenset(rule.api_groups), resources=frozenset(rule.resources),
                              resource_names=names, namespace=namespace))
    return rules


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


async def test_every_call_of_kubernetes_mode_is_allowed_and_every_rule_is_used(gcs: GcsFactory) -> None:
    server = KubeApiServer(rbac=emulated_rules(secrets=("train-rc",)))
    for rtype in (*KARPENTER_RESOURCES, *KUEUE_QUEUE_RESOURCES):
        server.register(rtype)
    await server.start()
    client = server.api_client()
    try:
        job = server.create(rayjob("train"))
        server.seed(
            node("n1", instance(1)),
            raycluster("train-rc", owner_job=job, head_ip="10.0.9.1", auth={"mode": "token"}),
            ray_pod("w1", cluster="train-rc", node_name="n1", ip="10.0.1.1"),
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "train-rc", "namespace": RAY_NS},
             "stringData": {"auth_token": "tok"}},
        )
        gcs.nodes["10.0.9.1:6379"] = [ray_node(0x11, "10.0.1.1")]
        async with KubeCluster(client, ray_control_factory=gcs, replica="replica-a", options=FAST) as kube:
            (target,) = (await kube.locate(instance_ids=[instance(1)])).targets  # list, watch, get secret
            await eventually(lambda: server.open_watches == len(kube.caches.informers), what="the watches")
            server.drop_watches()
            server.fail(verb="watch", resource="nodes", status=503, times=None)
            await eventually(lambda: server.open_watches < len(kube.caches.informers), what="the node watch to stop")
            server.patch("nodes", "n1", body={"metadata": {"labels": {"changed": "yes"}}})
            await kube.cordon(target, reason="spot_interruption", deadline=None)  # patch 409, get, patch
            server.clear_faults()
            await kube.record(target, reason="SpotInterruption", message="m")  # create (on the RayJob)
            on_node = ObjectRef(api_version="v1", kind="Node", name="n1", uid=server.get("nodes", "n1")["metadata"]["uid"])
            await EventRecorder(client, replica="replica-a").emit(on_node, reason="SpotInterruption", message="m")  # create
            await EventRecorder(client, replica="replica-a").emit(  # restarted: create 409, get, patch
                on_node, reason="SpotInterruption", message="m")
        clock = Clock()
        a, b = KubeLeaseClaims(client, namespace=LEASES_NS, clock=clock), KubeLeaseClaims(client, namespace=LEASES_NS, clock=clock)
        await a.acquire("k", holder="a", ttl_seconds=5)  # create
        clock.now += timedelta(seconds=6)
        await b.acquire("k", holder="b", ttl_seconds=5)  # create 409, get, update
        await b.release("k", holder="b")  # get, delete
        await a.sweep(older_than=timedelta(hours=24))  # list
        follow_ups = KubeFollowUps(client, namespace=LEASES_NS)
        first = await follow_ups.put("ml/train", {"stage": "requeued"}, version=None)  # create
        assert await follow_ups.put("ml/train", {"stage": "admitted"}, version=first) is not None  # patch
    finally:
        await client.close()
        await server.stop()

    assert [r for r in server.requests if r.status == 403] == []
    assert server.verbs_seen() == requested_verbs()


@pytest.mark.parametrize(
    ("drop", "call"),
    [(("events", "patch"), "record"), (("nodes", "patch"), "cordon"), (("leases", "create"), "claim")],
    ids=["events-patch", "nodes-patch", "leases-create"],
)
async def test_a_missing_verb_is_a_permanent_error_naming_it(gcs: GcsFactory, drop: tuple[str, str], call: str) -> None:
    server = KubeApiServer(rbac=emulated_rules(secrets=(), drop=drop))
    await server.start()
    client = server.api_client()
    try:
        server.create(node("n1", instance(1)))
        async with KubeCluster(client, ray_control_factory=gcs, replica="r", options=FAST) as kube:
            await kube.caches.nodes.wait_until(lambda c: c.get(None, "n1") is not None, timeout=LOCAL_BOUND_S)
            target = Target(instance_id=instance(1), node="n1", ray_cluster=None, ray_job=None,
                            ray_node_ids=(), checkpoint_uri=None)
            with pytest.raises(PermanentError) as err:
                if call == "record":
                    await kube.record(target, reason="R", message="m")
                    await kube.record(target, reason="R", message="m")
                elif call == "cordon":
                    await kube.cordon(target, reason="spot", deadline=None)
                else:
                    await KubeLeaseClaims(client, namespace=LEASES_NS).acquire("k", holder="a", ttl_seconds=5)
            assert f"{drop[1]} {drop[0]}" in str(err.value)
    finally:
        await client.close()
        await server.stop()


async def test_a_secret_outside_resource_names_is_refused(gcs: GcsFactory) -> None:
    server = KubeApiServer(rbac=emulated_rules(secrets=("another",)))
    await server.start()
    client = server.api_client()
    try:
        server.seed(node("n1", instance(1)), raycluster("rc", head_ip="10.0.9.1", auth={"mode": "token"}),
                    ray_pod("w1", cluster="rc", node_name="n1", ip="10.0.1.1"),
                    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rc", "namespace": RAY_NS},
                     "stringData": {"auth_token": "tok"}})
        async with KubeCluster(client, ray_control_factory=gcs, replica="r", options=FAST) as kube:
            location = await kube.locate(instance_ids=[instance(1)])
        assert "may not read the auth token Secret ml/rc" in location.unresolved[instance(1)]
    finally:
        await client.close()
        await server.stop()


def test_the_secret_rule_names_its_objects_and_ray_write_is_not_requested() -> None:
    """What the manifests grant from these rules (rendered and compared with deploy/ by
    tests/deploy/test_permissions.py, through ops.permissions.as_rbac): the auth Secrets by name only."""
    secret_rule = next(r for r in RBAC_RULES if r.resources == ("secrets",))
    assert (secret_rule.api_groups, secret_rule.verbs, secret_rule.resource_names) == (("",), ("get",), (AUTH_SECRETS,))
    ray_write = next(r for r in RBAC_RULES if "ray:write" in r.verbs)
    assert not ray_write.requested and ray_write.resources == ("rayclusters",)
