"""KubeRay without Kueue: every worker group moves, worker pods are replaced as a gang (emulated API)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.model import Capacity, CapacityDecision
from resilienced.errors import BackendUnavailable, PermanentError
from resilienced.model import Event, Kind, Target
from resilienced.requeue.kuberay import KubeRayRequeuer
from resilienced.requeue.rbac import requested_verbs
from resilienced.recovery.steps import RequeueStep
from tests.requeue.kuberay_sim import KubeRaySim
from tests.requeue.objects import NS, SPOT_AFFINITY, node, ray_pod, raycluster, rayjob
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

NOW = datetime(2026, 8, 20, 12, 0, tzinfo=timezone.utc)
BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "spot interrupted twice", reservation_id="cr-0block")
SPOT = CapacityDecision(Capacity.SPOT, "back to spot")
EVENT = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-1", instance_ids=("i-0aaa",))
RESERVED = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
            "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
WRITES = {"patch", "delete", "create", "update"}


def target(*, job: bool = True) -> Target:
    return Target(instance_id="i-0aaa", node="spot-1", ray_cluster=f"{NS}/train",
                  ray_job=f"{NS}/job" if job else None, ray_node_ids=("ab" * 28,), checkpoint_uri=None)


def seed_spot_run(kubeapi: KubeApiServer, *, job: bool = True) -> None:
    kubeapi.seed(
        node("spot-1", capacity="spot"), node("spot-2", capacity="spot"), node("od-head", capacity="on-demand"),
        raycluster(selector={"karpenter.sh/capacity-type": "spot"}, affinity=SPOT_AFFINITY),
        ray_pod("train-head", node_type="head", group="headgroup", node_name="od-head"),
        ray_pod("train-gpu-a", node_name="spot-1", selector={"karpenter.sh/capacity-type": "spot"}),
        ray_pod("train-gpu-b", node_name="spot-2", selector={"karpenter.sh/capacity-type": "spot"}),
        ray_pod("train-cpu-a", group="cpu", node_name="spot-2", selector={"karpenter.sh/capacity-type": "spot"}),
        ray_pod("other-gpu-a", cluster="other", node_name="spot-2"),
    )
    if job:
        kubeapi.seed(rayjob(selector={"karpenter.sh/capacity-type": "spot"}, affinity=SPOT_AFFINITY))


def writes(kubeapi: KubeApiServer) -> list[tuple[str, str, str | None]]:
    return [(r.verb, r.resource, r.name) for r in kubeapi.requests if r.verb in WRITES]


async def test_move_to_a_block_sets_every_group_and_replaces_the_workers(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    requeuer = KubeRayRequeuer(api, clock=lambda: NOW)
    result = await requeuer.requeue(target(), decision=BLOCK, event=EVENT)

    assert result.changed and result.capacity is Capacity.CAPACITY_BLOCK and result.reservation_id == "cr-0block"
    for obj, groups in ((kubeapi.get("rayjobs", "job", namespace=NS), lambda o: o["spec"]["rayClusterSpec"]),
                        (kubeapi.get("rayclusters", "train", namespace=NS), lambda o: o["spec"])):
        for group in groups(obj)["workerGroupSpecs"]:
            spec = group["template"]["spec"]
            assert spec["nodeSelector"] == RESERVED, group["groupName"]
            assert {"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": "reserved",
                    "effect": "NoSchedule"} in spec["tolerations"]
            # The spot affinity term lost its capacity-type expression; the instance type stays.
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert [e["key"] for t in terms for e in t["matchExpressions"]] == ["node.kubernetes.io/instance-type"]
        annotations = obj["metadata"]["annotations"]
        assert annotations["resilienced.io/capacity-type"] == "capacity-block"
        assert annotations["resilienced.io/capacity-reservation-id"] == "cr-0block"
        assert annotations["resilienced.io/capacity-moved-at"] == "2026-08-20T12:00:00Z"
        assert annotations["resilienced.io/requeued-for"] == "ev-1"
    # The head group is not a worker group: untouched.
    head = kubeapi.get("rayclusters", "train", namespace=NS)["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    # Every worker of the run is gone (KubeRay recreates them); the head and other runs' pods stay.
    left = {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)}
    assert left == {"train-head", "other-gpu-a"}


async def test_applying_the_same_decision_again_changes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    requeuer = KubeRayRequeuer(api, clock=lambda: NOW)
    await requeuer.requeue(target(), decision=BLOCK, event=EVENT)
    # KubeRay recreated the workers from the new template, on block nodes.
    kubeapi.seed(node("block-1", capacity="reserved", reservation="cr-0block"),
                 ray_pod("train-gpu-c", node_name="block-1", selector=RESERVED),
                 ray_pod("train-gpu-d", selector=RESERVED))  # still pending: asks for the block
    kubeapi.reset_log()
    again = await requeuer.requeue(target(), decision=BLOCK, event=EVENT)
    assert again.changes == () and not again.changed and "already on capacity-block" in again.reason
    assert writes(kubeapi) == []
    assert {"train-gpu-c", "train-gpu-d"} <= {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)}


async def test_moving_off_a_block_removes_its_selector_and_keeps_workers_already_on_spot(
    api: k8s.ApiClient, kubeapi: KubeApiServer
) -> None:
    kubeapi.seed(
        node("block-1", capacity="reserved", reservation="cr-0block"), node("spot-9", capacity="spot"),
        raycluster(selector=RESERVED),
        ray_pod("train-gpu-a", node_name="block-1", selector=RESERVED),
        ray_pod("train-gpu-b", node_name="spot-9"),  # no selector, but already on a Spot node
    )
    result = await KubeRayRequeuer(api, clock=lambda: NOW).requeue(target(job=False), decision=SPOT, event=EVENT)
    spec = kubeapi.get("rayclusters", "train", namespace=NS)["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert spec["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    annotations = kubeapi.get("rayclusters", "train", namespace=NS)["metadata"]["annotations"]
    assert "resilienced.io/capacity-reservation-id" not in annotations
    assert {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)} == {"train-gpu-b"}
    assert any("deleted worker pods train-gpu-a " in c for c in result.changes)


async def test_dry_run_reports_and_writes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    before = kubeapi.get("rayclusters", "train", namespace=NS)
    result = await KubeRayRequeuer(api).requeue(target(), decision=BLOCK, event=EVENT, dry_run=True)
    assert result.dry_run and not result.changed
    assert any(c.startswith("RayJob ml/job spec.rayClusterSpec: would set worker groups gpu, cpu") for c in result.changes)
    assert any("would delete worker pods train-cpu-a, train-gpu-a, train-gpu-b" in c for c in result.changes)
    assert writes(kubeapi) == []
    assert kubeapi.get("rayclusters", "train", namespace=NS) == before


async def test_a_wait_decision_touches_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    wait = CapacityDecision(Capacity.WAIT, "nothing has room")
    result = await KubeRayRequeuer(api).requeue(target(), decision=wait, event=EVENT)
    assert result.capacity is Capacity.WAIT and result.changes == ()
    assert kubeapi.requests == []


async def test_requests_stay_within_the_declared_rbac(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    await KubeRayRequeuer(api).requeue(target(), decision=BLOCK, event=EVENT)
    assert all(r.status < 400 for r in kubeapi.requests), [(r.verb, r.resource, r.status) for r in kubeapi.requests]
    assert {(g, res, v) for g, res, v in kubeapi.verbs_seen()} <= requested_verbs()


async def test_a_run_that_is_gone_is_a_permanent_error(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    with pytest.raises(PermanentError, match="RayJob ml/job no longer exists"):
        await KubeRayRequeuer(api).requeue(target(), decision=BLOCK, event=EVENT)


async def test_an_api_server_failure_is_retried_later(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_spot_run(kubeapi)
    kubeapi.fail(verb="patch", resource="rayclusters", status=503)
    with pytest.raises(BackendUnavailable):
        await KubeRayRequeuer(api).requeue(target(), decision=BLOCK, event=EVENT)
    # The retry picks up where the first attempt stopped (the RayJob is already patched).
    result = await KubeRayRequeuer(api).requeue(target(), decision=BLOCK, event=EVENT)
    assert not any(c.startswith("RayJob") for c in result.changes)
    assert any(c.startswith("RayCluster ml/train: set worker groups gpu, cpu") for c in result.changes)


def set_upgrade_strategy(kubeapi: KubeApiServer, strategy: str | None) -> None:
    """``spec.upgradeStrategy.type`` on the RayCluster and on the RayJob's rayClusterSpec (KubeRay >= 1.6)."""
    if strategy is None:
        return
    kubeapi.patch("rayclusters", "train", {"spec": {"upgradeStrategy": {"type": strategy}}}, namespace=NS)
    kubeapi.patch("rayjobs", "job", {"spec": {"rayClusterSpec": {"upgradeStrategy": {"type": strategy}}}},
                  namespace=NS)


@pytest.mark.parametrize("strategy", [None, "None", "Recreate"])
async def test_the_head_survives_under_every_upgrade_strategy(
        api: k8s.ApiClient, kubeapi: KubeApiServer, strategy: str | None) -> None:
    """With Recreate a nodeSelector change makes KubeRay delete every pod, head included: refuse."""
    seed_spot_run(kubeapi)
    set_upgrade_strategy(kubeapi, strategy)
    kuberay = KubeRaySim(kubeapi, namespace=NS)
    kuberay.stamp_head("train")
    kubeapi.reset_log()
    result = await KubeRayRequeuer(api, clock=lambda: NOW).requeue(target(), decision=BLOCK, event=EVENT)
    kuberay.step()
    left = {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)}
    assert "train-head" in left and kuberay.recreated == []  # the Ray cluster, and its job, live on
    if strategy == "Recreate":
        assert result.refused and result.changes == () and "upgradeStrategy.type: Recreate" in result.reason
        assert RequeueStep.of(result).as_json()["refused"] is True  # what the run's record says
        assert writes(kubeapi) == []
        assert left == {"train-head", "train-gpu-a", "train-gpu-b", "train-cpu-a", "other-gpu-a"}
    else:
        assert result.changed and not result.refused
        assert left == {"train-head", "other-gpu-a"}


def test_the_kuberay_stand_in_recreates_every_pod_on_a_selector_change_only_under_recreate(
        kubeapi: KubeApiServer) -> None:
    """The stand-in's rule (raycluster_controller.go shouldRecreatePodsForUpgrade, v1.6.0)."""
    seed_spot_run(kubeapi, job=False)
    kuberay = KubeRaySim(kubeapi, namespace=NS)
    kubeapi.patch("rayclusters", "train", {"spec": {"upgradeStrategy": {"type": "Recreate"}}}, namespace=NS)
    kuberay.stamp_head("train")
    cluster = kubeapi.get("rayclusters", "train", namespace=NS)
    for group in cluster["spec"]["workerGroupSpecs"]:  # tolerations and replicas are muted in the hash
        group["template"]["spec"]["tolerations"] = [{"key": "k", "operator": "Exists"}]
        group["replicas"] = 5
    kubeapi.put(cluster)
    kuberay.step()
    assert kuberay.recreated == []
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"] = RESERVED
    kubeapi.put(cluster)
    kuberay.step()
    assert kuberay.recreated == ["train"]
    assert {p["metadata"]["name"] for p in kubeapi.list("pods", namespace=NS)} == {"other-gpu-a"}
