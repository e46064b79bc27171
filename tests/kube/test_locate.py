"""locate(): instance -> Node -> Ray pods -> RayCluster -> RayJob -> Ray node ids, from the caches."""

from __future__ import annotations

import asyncio

import pytest

from resilienced.errors import BackendUnavailable
from resilienced.kube.cluster import KubeCluster, KubeOptions
from resilienced.kube.locate import elastic_facts
from .conftest import (
    LOCAL_BOUND_S,
    GcsFactory,
    eventually,
    instance,
    node,
    ray_node,
    ray_pod,
    raycluster,
    rayjob,
)
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

TRAIN_GCS = "10.0.9.1:6379"
ADHOC_GCS = "10.0.9.2:6379"


@pytest.fixture
def world(kubeapi: KubeApiServer, gcs: GcsFactory) -> dict[str, str]:
    """Two runs on four instances (see each test for the part it uses)."""
    job = kubeapi.create(rayjob("train", annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/train"},
                                cluster_name="train-rc"))
    kubeapi.seed(
        node("n1", instance(1)), node("n2", instance(2)), node("n3", instance(3)), node("n4", instance(4)),
        node("fargate", None),
        raycluster("train-rc", owner_job=job, head_ip="10.0.9.1",
                   annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/from-cluster"}),
        raycluster("adhoc", head_ip="10.0.9.2", annotations={"resilienced.io/checkpoint-uri": "s3://ckpt/adhoc"}),
        ray_pod("train-head", cluster="train-rc", node_name="n4", ip="10.0.9.1", node_type="head"),
        ray_pod("train-w1", cluster="train-rc", node_name="n1", ip="10.0.1.1", group="gpu"),
        ray_pod("train-w2", cluster="train-rc", node_name="n1", ip="10.0.1.2", group="gpu"),
        ray_pod("train-w3", cluster="train-rc", node_name="n2", ip="10.0.2.1", group="gpu"),
        ray_pod("train-old", cluster="train-rc", node_name="n1", ip="10.0.1.9", phase="Failed"),
        ray_pod("adhoc-head", cluster="adhoc", node_name="n3", ip="10.0.9.2", node_type="head"),
        ray_pod("adhoc-w1", cluster="adhoc", node_name="n2", ip="10.0.2.2", group="cpu"),
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ml", "labels": {"app": "web"}},
         "spec": {"nodeName": "n3"}, "status": {"phase": "Running", "podIP": "10.0.3.1"}},
    )
    gcs.nodes[TRAIN_GCS] = [
        ray_node(0x01, "10.0.1.1", alive=False),  # a dead node that had the same IP
        ray_node(0x11, "10.0.1.1"), ray_node(0x12, "10.0.1.2"), ray_node(0x21, "10.0.2.1"),
        ray_node(0x91, "10.0.9.1", head=True),
    ]
    gcs.nodes[ADHOC_GCS] = [ray_node(0x22, "10.0.2.2"), ray_node(0x92, "10.0.9.2", head=True)]
    return {"job_uid": job["metadata"]["uid"]}


async def test_instance_to_ray_nodes_of_its_run(cluster: KubeCluster, world: dict[str, str]) -> None:
    location = await cluster.locate(instance_ids=[instance(1)])
    assert location.unresolved == {}
    (target,) = location.targets
    assert target.instance_id == instance(1)
    assert target.node == "n1"
    assert target.ray_cluster == "ml/train-rc"
    assert target.ray_job == "ml/train"
    assert target.ray_node_ids == ("11" * 28, "12" * 28)  # alive nodes only; the failed pod is ignored
    assert target.checkpoint_uri == "s3://ckpt/train"  # the RayJob's annotation wins
    assert target.ray_address == TRAIN_GCS
    assert target.facts.groups == ("gpu",)
    assert target.attributes["head_on_instance"] is False
    assert target.run_key == "ml/train"


async def test_unresolved_instances_say_why(cluster: KubeCluster, world: dict[str, str]) -> None:
    unknown = instance(99)
    location = await cluster.locate(instance_ids=[unknown, instance(3)])
    assert location.unresolved[unknown] == f"no Kubernetes Node has spec.providerID aws:///<az>/{unknown}"
    # n3 carries the adhoc head and a web pod: the head still makes it a target
    assert [t.ray_cluster for t in location.targets] == ["ml/adhoc"]


async def test_a_node_with_no_ray_pod(cluster: KubeCluster, kubeapi: KubeApiServer, world: dict[str, str]) -> None:
    kubeapi.create(node("n5", instance(5)))
    kubeapi.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "db", "namespace": "ml"},
                    "spec": {"nodeName": "n5"}, "status": {"phase": "Running"}})
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n5") is not None, timeout=LOCAL_BOUND_S)
    location = await cluster.locate(instance_ids=[instance(5)])
    assert location.targets == ()
    assert location.unresolved == {instance(5): f"Node n5 ({instance(5)}) runs no Ray pods"}


async def test_two_runs_on_one_instance_and_a_cluster_without_job(cluster: KubeCluster, world: dict[str, str]) -> None:
    location = await cluster.locate(instance_ids=[instance(2)])
    by_cluster = {t.ray_cluster: t for t in location.targets}
    assert set(by_cluster) == {"ml/train-rc", "ml/adhoc"}
    assert by_cluster["ml/train-rc"].ray_node_ids == ("21" * 28,)  # only the pod on n2
    adhoc = by_cluster["ml/adhoc"]
    assert adhoc.ray_job is None and adhoc.run_key == "ml/adhoc"
    assert adhoc.checkpoint_uri == "s3://ckpt/adhoc"
    assert adhoc.ray_node_ids == ("22" * 28,) and adhoc.ray_address == ADHOC_GCS


async def test_head_on_the_instance_is_reported_not_drained(cluster: KubeCluster, world: dict[str, str]) -> None:
    (target,) = (await cluster.locate(instance_ids=[instance(4)])).targets
    assert target.ray_cluster == "ml/train-rc"
    assert target.attributes["head_on_instance"] is True
    assert target.attributes["head_node_id"] == "91" * 28
    assert target.ray_node_ids == ()


async def test_a_pod_with_no_ray_node_yet(cluster: KubeCluster, kubeapi: KubeApiServer, world: dict[str, str]) -> None:
    kubeapi.create(ray_pod("train-w4", cluster="train-rc", node_name="n1", ip="10.0.1.3", group="gpu"))
    await cluster.caches.pods.wait_until(lambda c: c.get("ml", "train-w4") is not None, timeout=LOCAL_BOUND_S)
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert target.ray_node_ids == ("11" * 28, "12" * 28)
    assert target.attributes["unmapped_pods"] == ["train-w4"]


async def test_many_instances_at_once(cluster: KubeCluster, world: dict[str, str]) -> None:
    location = await cluster.locate(instance_ids=[instance(1), instance(2), instance(1), instance(42)])
    assert [(t.instance_id, t.ray_cluster) for t in location.targets] == [
        (instance(1), "ml/train-rc"), (instance(2), "ml/adhoc"), (instance(2), "ml/train-rc")]
    assert list(location.unresolved) == [instance(42)]


@pytest.mark.parametrize(
    ("job_note", "cluster_note", "expected", "problem"),
    [
        (None, "s3://bucket/c", "s3://bucket/c", None),
        ("s3://bucket/j", "s3://bucket/c", "s3://bucket/j", None),
        (None, None, None, None),
        ("http://bucket/j", "s3://bucket/c", None, "RayJob ml/job"),
        (None, "s3://Bad_Bucket/x", None, "RayCluster ml/rc"),
        ("s3://bucket", None, None, "RayJob ml/job"),
    ],
    ids=["cluster-only", "job-wins", "none", "bad-scheme", "bad-bucket", "no-prefix"],
)
async def test_checkpoint_annotation_precedence_and_validation(
    cluster: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory,
    job_note: str | None, cluster_note: str | None, expected: str | None, problem: str | None,
) -> None:
    key = "resilienced.io/checkpoint-uri"
    job = kubeapi.create(rayjob("job", annotations={key: job_note} if job_note else {}))
    kubeapi.seed(
        node("n1", instance(1)),
        raycluster("rc", owner_job=job, head_ip="10.1.0.1", annotations={key: cluster_note} if cluster_note else {}),
        ray_pod("w", cluster="rc", node_name="n1", ip="10.1.0.2"),
    )
    gcs.nodes["10.1.0.1:6379"] = [ray_node(1, "10.1.0.2")]
    await cluster.caches.pods.wait_until(lambda c: c.get("ml", "w") is not None, timeout=LOCAL_BOUND_S)
    await cluster.caches.rayclusters.wait_until(lambda c: c.get("ml", "rc") is not None, timeout=LOCAL_BOUND_S)
    location = await cluster.locate(instance_ids=[instance(1)])
    if problem is None:
        (target,) = location.targets
        assert target.checkpoint_uri == expected and target.ray_job == "ml/job"
    else:
        assert location.targets == ()
        reason = location.unresolved[instance(1)]
        assert problem in reason and "is not s3://bucket/prefix" in reason


async def test_rayjob_found_by_cluster_selector(cluster: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory) -> None:
    kubeapi.seed(
        node("n1", instance(1)),
        rayjob("finished", selector="shared", state="Complete"),
        rayjob("running", selector="shared"),
        raycluster("shared", head_ip="10.2.0.1"),
        ray_pod("w", cluster="shared", node_name="n1", ip="10.2.0.2"),
    )
    gcs.nodes["10.2.0.1:6379"] = [ray_node(2, "10.2.0.2")]
    await cluster.caches.rayjobs.wait_until(lambda c: len(c) == 2, timeout=LOCAL_BOUND_S)
    await cluster.caches.pods.wait_until(lambda c: c.get("ml", "w") is not None, timeout=LOCAL_BOUND_S)
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert target.ray_job == "ml/running"


async def test_capacity_reservation_adds_its_nodes(cluster: KubeCluster, kubeapi: KubeApiServer, world: dict[str, str]) -> None:
    kubeapi.patch("nodes", "n2", body={"metadata": {"labels": {"karpenter.k8s.aws/capacity-reservation-id": "cr-0abc"}}})
    await cluster.caches.nodes.wait_until(lambda c: bool(c.by_index("reservation", "cr-0abc")), timeout=LOCAL_BOUND_S)
    location = await cluster.locate(instance_ids=[instance(1)], capacity_reservation_id="cr-0abc")
    assert sorted({t.instance_id for t in location.targets}) == [instance(1), instance(2)]


async def test_gcs_address_prefers_service_ip_and_the_head_container_port(
    cluster: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory
) -> None:
    kubeapi.seed(
        node("n1", instance(1)),
        raycluster("rc", head_ip="10.3.0.1", service_ip="172.20.0.7", gcs_port=6380),
        ray_pod("h", cluster="rc", node_name="n1", ip="10.3.0.1", node_type="head", gcs_port=6390),
        ray_pod("w", cluster="rc", node_name="n1", ip="10.3.0.2"),
    )
    gcs.nodes["172.20.0.7:6390"] = [ray_node(3, "10.3.0.2")]
    await cluster.caches.pods.wait_until(lambda c: len(c) == 2, timeout=LOCAL_BOUND_S)
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert target.ray_address == "172.20.0.7:6390"
    assert target.ray_node_ids == ("03" * 28,)


async def test_gcs_down_with_the_head_elsewhere_is_temporary(cluster: KubeCluster, gcs: GcsFactory, world: dict[str, str]) -> None:
    gcs.down.add(TRAIN_GCS)
    with pytest.raises(BackendUnavailable):
        await cluster.locate(instance_ids=[instance(1)])


async def test_gcs_down_with_the_head_on_the_instance_still_gives_the_run(
    cluster: KubeCluster, gcs: GcsFactory, world: dict[str, str]
) -> None:
    gcs.down.add(TRAIN_GCS)
    location = await cluster.locate(instance_ids=[instance(1), instance(4)])
    assert {t.instance_id for t in location.targets} == {instance(1), instance(4)}
    assert all(t.ray_node_ids == () and "GCS unreachable" in t.attributes["gcs_error"] for t in location.targets)


async def test_a_gcs_that_does_not_answer_in_time_is_temporary_then_recovers(
    kubeapi: KubeApiServer, api, gcs: GcsFactory, world: dict[str, str]
) -> None:
    from .conftest import FAST

    gcs.hang[TRAIN_GCS] = 5.0
    options = KubeOptions(cache=FAST.cache, gcs_timeout_s=0.2)
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=options) as kube:
        with pytest.raises(BackendUnavailable) as err:
            await kube.locate(instance_ids=[instance(1)])
        assert err.value.backend == "ray" and "did not answer within 0.2s" in str(err.value)
        gcs.hang.clear()
        (target,) = (await kube.locate(instance_ids=[instance(1)])).targets
        assert len(target.ray_node_ids) == 2


async def test_a_burst_costs_no_api_call_and_one_gcs_call_per_cluster(
    cluster: KubeCluster, kubeapi: KubeApiServer, gcs: GcsFactory, world: dict[str, str]
) -> None:
    await cluster.caches.wait_ready()
    await eventually(lambda: kubeapi.open_watches == len(cluster.caches.informers), what="every watch to open")
    kubeapi.reset_log()
    locations = await asyncio.gather(*(
        cluster.locate(instance_ids=[instance(1 + i % 4)]) for i in range(500)))
    assert sum(len(loc.targets) for loc in locations) == 625  # instance 2 has two runs
    assert kubeapi.requests == []
    assert gcs.calls == 2  # train-rc and adhoc, each listed once


async def test_locate_waits_for_the_first_lists(kubeapi: KubeApiServer, api, gcs: GcsFactory, world: dict[str, str]) -> None:
    from .conftest import FAST

    kubeapi.delay(0.3, verb="list", resource="pods")
    async with KubeCluster(api, ray_control_factory=gcs, replica="r", options=FAST) as kube:
        assert not kube.caches.ready()
        location = await kube.locate(instance_ids=[instance(1)])
        assert kube.caches.ready() and len(location.targets) == 1


async def test_it_is_the_kubernetes_cluster_port(cluster: KubeCluster) -> None:
    from resilienced.ports import Cluster

    assert isinstance(cluster, Cluster) and cluster.mode == "kubernetes"


def _run_obj(kind: str, *, annotations: dict | None = None, labels: dict | None = None) -> dict:
    return {"kind": kind, "metadata": {"name": kind.lower(), "namespace": "ml", "annotations": annotations or {},
                                       "labels": labels or {}}}


_Q = {"kueue.x-k8s.io/queue-name": "training"}


@pytest.mark.parametrize(
    ("objects", "elastic", "extra"),
    [
        ([_run_obj("RayCluster")], False, None),
        ([_run_obj("RayCluster", annotations={"resilienced.io/elastic": "true"})], True, None),
        ([_run_obj("RayJob", annotations={"resilienced.io/elastic": "True "}), _run_obj("RayCluster")], True, None),
        # the RayJob's word wins over its cluster's
        ([_run_obj("RayJob", annotations={"resilienced.io/elastic": "false"}),
          _run_obj("RayCluster", annotations={"resilienced.io/elastic": "true"})], False, None),
        ([_run_obj("RayCluster", annotations={"resilienced.io/elastic": "yes"})], False,
         ("elastic_error", "resilienced.io/elastic='yes' on RayCluster ml/raycluster must be")),
        ([_run_obj("RayJob", annotations={"resilienced.io/elastic": "true"}, labels=_Q), _run_obj("RayCluster")], False,
         ("elastic_fallback", "Kueue manages RayJob ml/rayjob")),
        ([_run_obj("RayCluster", annotations={"resilienced.io/elastic": "true"}, labels=_Q)], False,
         ("elastic_fallback", "without kueue.x-k8s.io/elastic-job")),
        ([_run_obj("RayCluster", annotations={"resilienced.io/elastic": "true", "kueue.x-k8s.io/elastic-job": "true"},
                   labels=_Q)], True, None),
    ],
)
def test_elastic_facts(objects: list, elastic: bool, extra: tuple | None) -> None:
    facts = elastic_facts(objects)
    assert facts["elastic"] is elastic
    if extra is None:
        assert set(facts) == {"elastic"}
    else:
        assert extra[1] in facts[extra[0]]


async def test_the_elastic_annotation_reaches_the_target(cluster: KubeCluster, world: dict[str, str],
                                                         kubeapi: KubeApiServer) -> None:
    job = kubeapi.get("rayjobs", "train", namespace="ml")
    job["metadata"]["annotations"]["resilienced.io/elastic"] = "true"
    kubeapi.put(job)
    await eventually(lambda: (cluster.caches.rayjobs.get("ml", "train") or {}).get("metadata", {})
                     .get("annotations", {}).get("resilienced.io/elastic") == "true")
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert target.facts.elastic is True
    (other,) = (await cluster.locate(instance_ids=[instance(3)])).targets  # adhoc: not annotated
    assert other.facts.elastic is False


async def test_the_requeue_a_run_carries_reaches_the_target(cluster: KubeCluster, world: dict[str, str],
                                                            kubeapi: KubeApiServer) -> None:
    """The annotations a requeue leaves on the RayJob (requeue/kuberay.py ``bookkeeping``) become
    the target's ``requeued_*`` facts, so a delivery taking the same event over keeps that move."""
    (before,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert before.facts.requeued_for is None
    job = kubeapi.get("rayjobs", "train", namespace="ml")
    job["metadata"]["annotations"].update({"resilienced.io/requeued-for": "ev-1",
                                           "resilienced.io/capacity-type": "capacity-block",
                                           "resilienced.io/capacity-reservation-id": "cr-0123"})
    kubeapi.put(job)
    await eventually(lambda: (cluster.caches.rayjobs.get("ml", "train") or {}).get("metadata", {})
                     .get("annotations", {}).get("resilienced.io/requeued-for") == "ev-1")
    (target,) = (await cluster.locate(instance_ids=[instance(1)])).targets
    assert (target.facts.requeued_for, target.facts.requeued_capacity,
            target.facts.requeued_reservation_id) == ("ev-1", "capacity-block", "cr-0123")


async def _a_run_came_while_the_pods_relisted(cluster: KubeCluster, kubeapi: KubeApiServer, *, hold_s: float) -> None:
    """Every watch ends with 410 Gone; the pods' re-list is held ``hold_s``; meanwhile a run's worker
    comes on a new Node, which the Node cache (re-listed at once) has."""
    await cluster.caches.wait_ready()
    await eventually(lambda: kubeapi.open_watches == len(cluster.caches.informers), what="every cache's watch to open")
    kubeapi.delay(hold_s, verb="list", resource="pods", times=1)
    kubeapi.expire_watches()
    await eventually(lambda: cluster.caches.pods.behind is not None, what="the pod cache to know it lags")
    kubeapi.create(node("n5", instance(5)))
    kubeapi.create(ray_pod("train-w5", cluster="train-rc", node_name="n5", ip="10.0.5.1", group="gpu"))
    await cluster.caches.nodes.wait_until(lambda c: c.get(None, "n5") is not None, timeout=LOCAL_BOUND_S)
    assert cluster.caches.pods.by_index("node", "n5") == []  # the stale store: no pod on n5 yet


async def test_a_run_that_came_while_the_pod_cache_relisted_is_located_not_decided_on_the_stale_cache(
        cluster: KubeCluster, kubeapi: KubeApiServer, world: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in the chaos campaign's kube-watch-410 fault under load: the notice was decided
    ``not_actionable`` ("runs no Ray pods") from a pod cache still re-listing, and the run was never
    requeued.  An unresolved instance while a cache lags is looked at again once it follows."""
    from resilienced.kube import locator

    monkeypatch.setattr(locator, "CURRENT_WAIT_S", LOCAL_BOUND_S)  # a busy machine's re-list, not 10 s
    await _a_run_came_while_the_pods_relisted(cluster, kubeapi, hold_s=0.5)
    location = await cluster.locate(instance_ids=[instance(5)])
    assert location.unresolved == {}
    (target,) = location.targets
    assert (target.node, target.ray_cluster) == ("n5", "ml/train-rc")


async def test_a_cache_that_keeps_lagging_makes_the_notice_retried_not_decided(
        cluster: KubeCluster, kubeapi: KubeApiServer, world: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from resilienced.kube import locator

    monkeypatch.setattr(locator, "CURRENT_WAIT_S", 0.2)
    # held far longer than the set-up takes on a busy machine: the pod cache still lags at the locate
    await _a_run_came_while_the_pods_relisted(cluster, kubeapi, hold_s=LOCAL_BOUND_S * 4)
    with pytest.raises(BackendUnavailable, match=f"instance\\(s\\) {instance(5)} not found in caches that lag"):
        await cluster.locate(instance_ids=[instance(5)])
    located = await cluster.locate(instance_ids=[instance(1)])  # one the caches resolve: at once, lagging or not
    assert located.unresolved == {} and len(located.targets) == 1
