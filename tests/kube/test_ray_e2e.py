"""Pod IP <-> Ray node mapping and the token modes against a real local Ray cluster, through RayGcs.

The Ray cluster is three real ``ray start`` processes with token auth: a head at 127.0.0.1 and
two workers at distinct loopback addresses, 127.0.0.2 and 127.0.0.3 (a worker reports its
``--node-ip-address`` as its node manager address), each labelled with the instance id it stands
for.  The emulated API server holds the KubeRay view of the same cluster: a Node per instance,
pods whose ``podIP`` are those loopback addresses, a RayCluster whose ``status.head.serviceIP``
and head container port lead to the real GCS, and the auth Secret.  ``resilienced.local.raycluster``
starts workers at distinct loopback addresses (``add_node(node_ip=...)``), so pod IPs tell them
apart.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from resilienced.errors import RayAuthError
from resilienced.kube.cluster import KubeCluster, KubeOptions
from resilienced.local.raycluster import LocalRayCluster
from resilienced.model import Target
from resilienced.ray.gcs import RayGcs
from .conftest import FAST, instance, node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer
from tests.support.kubeoptions import LOCAL_BOUND_S

pytestmark = pytest.mark.e2e

INSTANCE_LABEL = "resilienced.io/instance-id"
WORKER_IPS = ("127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalRayCluster]:
    workdir = Path(tempfile.mkdtemp(prefix="rk-", dir="/tmp"))  # short: Ray's unix sockets live under it
    cluster = LocalRayCluster(workdir=workdir, head_labels={INSTANCE_LABEL: instance(100)})
    try:
        cluster.start()
        for n, ip in enumerate(WORKER_IPS, start=1):  # one at a time: concurrent starts time out on 2 cores
            cluster.add_node(labels={INSTANCE_LABEL: instance(n)}, num_cpus=1, node_ip=ip)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _kube_view(kubeapi: KubeApiServer, ray: LocalRayCluster, *, auth: dict | None, token: str | None) -> None:
    """The KubeRay objects of that Ray cluster: three Nodes, three pods, the RayJob, RayCluster, Secret."""
    job = kubeapi.create(rayjob("train", annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/train"}))
    kubeapi.seed(
        node("n0", instance(100)), node("n1", instance(1)), node("n2", instance(2)),
        raycluster("train-rc", owner_job=job, service_ip="127.0.0.1", head_ip="10.99.0.1", auth=auth),
        ray_pod("train-head", cluster="train-rc", node_name="n0", ip="10.99.0.1", node_type="head", gcs_port=ray.gcs_port),
        ray_pod("train-w1", cluster="train-rc", node_name="n1", ip=WORKER_IPS[0], group="cpu"),
        ray_pod("train-w2", cluster="train-rc", node_name="n2", ip=WORKER_IPS[1], group="cpu"),
    )
    if token is not None:
        kubeapi.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "train-rc", "namespace": "ml"},
                        "stringData": {"auth_token": token}})


def _real_gcs(address: str, token: str | None) -> RayGcs:
    return RayGcs(address, token=token, timeout=LOCAL_BOUND_S)


@pytest.fixture
async def kube(api) -> AsyncIterator[KubeCluster]:
    async with KubeCluster(api, ray_control_factory=_real_gcs, replica="r", options=KubeOptions(
            cache=FAST.cache, gcs_timeout_s=30)) as cluster:
        yield cluster


async def test_pod_ips_map_to_the_ray_nodes_of_the_right_instances(
    ray_cluster: LocalRayCluster, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token=ray_cluster.auth_token)
    truth = {n.labels[INSTANCE_LABEL]: n.node_id
             for n in await RayGcs(ray_cluster.address, token=ray_cluster.auth_token, timeout=LOCAL_BOUND_S).nodes() if n.alive}
    location = await kube.locate(instance_ids=[instance(1), instance(2), instance(100)])
    assert location.unresolved == {}
    by_instance = {t.instance_id: t for t in location.targets}
    assert by_instance[instance(1)].ray_node_ids == (truth[instance(1)],)
    assert by_instance[instance(2)].ray_node_ids == (truth[instance(2)],)
    head = by_instance[instance(100)]
    assert head.attributes["head_on_instance"] is True and head.ray_node_ids == ()
    assert {t.ray_address for t in location.targets} == {ray_cluster.address}
    assert {(t.ray_job, t.checkpoint_uri) for t in location.targets} == {("ml/train", "s3://ckpt/train")}

    control = await kube.ray_control(by_instance[instance(1)])
    assert truth[instance(1)] in {n.node_id for n in await control.nodes()}


async def test_a_wrong_token_in_the_secret_is_refused_by_the_real_gcs(
    ray_cluster: LocalRayCluster, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token="0" * 64)
    location = await kube.locate(instance_ids=[instance(1)])
    assert location.targets == ()
    reason = location.unresolved[instance(1)]
    assert "the token from its auth Secret was refused" in reason and "rejected the auth token" in reason


async def test_a_cluster_declared_without_auth_whose_gcs_wants_a_token(
    ray_cluster: LocalRayCluster, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    _kube_view(kubeapi, ray_cluster, auth=None, token=None)
    location = await kube.locate(instance_ids=[instance(1)])
    assert "has no authOptions.mode=token, but its GCS wants a token" in location.unresolved[instance(1)]


async def test_real_gcs_refuses_a_wrong_token_directly(ray_cluster: LocalRayCluster) -> None:
    with pytest.raises(RayAuthError):
        await RayGcs(ray_cluster.address, token="f" * 64, timeout=LOCAL_BOUND_S).nodes()


async def test_a_drain_through_ray_control_reaches_the_gcs(
    ray_cluster: LocalRayCluster, kubeapi: KubeApiServer, kube: KubeCluster
) -> None:
    """Last in the module: the drained worker may leave the cluster."""
    from datetime import datetime, timedelta, timezone

    _kube_view(kubeapi, ray_cluster, auth={"mode": "token"}, token=ray_cluster.auth_token)
    (target,) = (await kube.locate(instance_ids=[instance(2)])).targets
    assert isinstance(target, Target) and len(target.ray_node_ids) == 1
    control = await kube.ray_control(target)
    deadline = datetime.now(timezone.utc) + timedelta(minutes=2)
    drained = await control.drain(target.ray_node_ids[0], deadline=deadline, message="spot interruption (test)")
    assert drained.accepted
    drained = {n.node_id: n for n in await control.nodes()}[target.ray_node_ids[0]]
    assert drained.draining_deadline_ms is not None or not drained.alive
