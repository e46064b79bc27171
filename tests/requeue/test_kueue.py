"""Kueue-managed RayJobs: evict and requeue through the Workload, steered to the decided flavor.

The emulated API server holds the objects; ``KueueSim`` plays Kueue's controllers (see its
docstring for the rules and their sources in Kueue v0.19.2).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from resilienced.model import Capacity, CapacityDecision
from resilienced.errors import PermanentError, TemporaryError
from resilienced.model import Event, Kind, Target
from resilienced.requeue.kueue import KueueRequeuer
from resilienced.requeue.kueue import DEACTIVATED_FOR, discover_workload_version
from resilienced.requeue.rbac import requested_verbs
from tests.requeue.conftest import kueue_serving
from tests.requeue.kueue_sim import PODSET_REFUSAL, KueueSim, equivalent, workload_for
from tests.requeue.objects import NS, SPOT_AFFINITY, rayjob
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "spot interrupted twice", reservation_id="cr-0block")
SPOT = CapacityDecision(Capacity.SPOT, "spot healthy")
EVENT = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-7", instance_ids=("i-0aaa",))
TARGET = Target(instance_id="i-0aaa", node="spot-1", ray_cluster=f"{NS}/train", ray_job=f"{NS}/job",
                ray_node_ids=(), checkpoint_uri=None)
WRITES = {"patch", "delete", "create", "update"}
MERGE = "application/merge-patch+json"


def seed_admitted_on_spot(kubeapi: KubeApiServer, *, tolerations: list | None = None) -> None:
    """A RayJob Kueue admitted on the spot flavor: it injected capacity-type=spot into the templates."""
    job = kubeapi.create(rayjob(labels={"kueue.x-k8s.io/queue-name": "training"}, tolerations=tolerations))
    kubeapi.create(workload_for(job, flavor="spot"))  # PodSets: the templates as created (no selector)
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        group["template"]["spec"]["nodeSelector"] = {"karpenter.sh/capacity-type": "spot"}
    kubeapi.put(job)


async def eventually(check: Callable[[], bool], *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def worker_selectors(kubeapi: KubeApiServer) -> list[dict]:
    job = kubeapi.get("rayjobs", "job", namespace=NS)
    return [g["template"]["spec"].get("nodeSelector") for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]]


@pytest.mark.parametrize("version", ["v1beta2", "v1beta1"])
async def test_requeue_lands_the_run_on_the_block_flavor(api: k8s.ApiClient, kubeapi: KubeApiServer, version: str) -> None:
    seed_admitted_on_spot(kubeapi)
    requeuer = KueueRequeuer(api, workload_version=version, poll_interval_s=0.02, settle_timeout_s=10)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        result = await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
        verbs = [c.split(":")[0].split(" ")[0] for c in result.changes]
        assert verbs[0] == "deactivated" and verbs[1] == "set" and verbs[-1] == "reactivated"
        await eventually(lambda: kueue.admitted == ["capacity-block"]
                         and not kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"])
        assert kueue.foreign_suspend_writes == 0  # resilienced never wrote spec.suspend
    wl = kubeapi.list("workloads", namespace=NS)[0]
    assert wl["spec"]["active"] is True and DEACTIVATED_FOR not in (wl["metadata"].get("annotations") or {})
    for selector in worker_selectors(kubeapi):
        assert selector == {"karpenter.sh/capacity-type": "reserved",
                            "karpenter.k8s.aws/capacity-reservation-id": "cr-0block",
                            "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
    annotations = kubeapi.get("rayjobs", "job", namespace=NS)["metadata"]["annotations"]
    assert annotations["resilienced.io/capacity-type"] == "capacity-block"


async def test_applying_the_same_decision_again_changes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    requeuer = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
        await eventually(lambda: kueue.admitted == ["capacity-block"]
                         and not kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"])
        kubeapi.reset_log()
        again = await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
        assert again.changes == () and "already on capacity-block" in again.reason
        assert [r for r in kubeapi.requests if r.verb in WRITES] == []
        assert kueue.admitted == ["capacity-block"]  # no second eviction


async def test_a_run_already_on_the_decided_flavor_is_not_evicted(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    result = await KueueRequeuer(api).requeue(TARGET, decision=SPOT, event=EVENT)
    assert result.changes == ()
    assert kubeapi.list("workloads", namespace=NS)[0]["spec"]["active"] is True
    assert [r for r in kubeapi.requests if r.verb in WRITES] == []


async def test_dry_run_lists_the_steps_and_writes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    result = await KueueRequeuer(api).requeue(TARGET, decision=BLOCK, event=EVENT, dry_run=True)
    assert result.dry_run and len(result.changes) == 4 and result.changes[0].startswith("would deactivate Workload")
    assert [r for r in kubeapi.requests if r.verb in WRITES] == []


async def test_a_stalled_kueue_is_retried_and_the_retry_resumes(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    impatient = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=0.3)
    with pytest.raises(TemporaryError, match="waiting for Kueue to suspend"):
        await impatient.requeue(TARGET, decision=BLOCK, event=EVENT)  # no Kueue running
    wl = kubeapi.list("workloads", namespace=NS)[0]
    assert wl["spec"]["active"] is False and wl["metadata"]["annotations"][DEACTIVATED_FOR] == "ev-7"
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        result = await KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10).requeue(
            TARGET, decision=BLOCK, event=EVENT)
        assert not any(c.startswith("deactivated") for c in result.changes)  # not done twice
        assert any(c.startswith("reactivated") for c in result.changes)
        await eventually(lambda: kueue.admitted == ["capacity-block"])


async def test_a_workload_deactivated_by_someone_else_is_left_alone(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    wl = kubeapi.list("workloads", namespace=NS)[0]
    kubeapi.patch("workloads", wl["metadata"]["name"], {"spec": {"active": False}}, namespace=NS)
    async with KueueSim(kubeapi, namespace=NS):
        await KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10).requeue(TARGET, decision=BLOCK, event=EVENT)
    assert kubeapi.list("workloads", namespace=NS)[0]["spec"]["active"] is False  # an operator's choice stands


async def test_a_job_without_the_queue_label_is_refused(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(rayjob())
    with pytest.raises(PermanentError, match="Kueue does not manage it"):
        await KueueRequeuer(api).requeue(TARGET, decision=BLOCK, event=EVENT)


async def test_requests_stay_within_the_declared_rbac(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    async with KueueSim(kubeapi, namespace=NS):
        await KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10).requeue(TARGET, decision=BLOCK, event=EVENT)
    assert all(r.status < 400 or r.status == 409 for r in kubeapi.requests)
    assert kubeapi.verbs_seen() <= requested_verbs()


OLD_BLOCK = {"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-id": "cr-0old",
             "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}
NEW_BLOCK = CapacityDecision(Capacity.CAPACITY_BLOCK, "block cr-0old expires", reservation_id="cr-0new")


def seed_admitted_on_block(kubeapi: KubeApiServer) -> None:
    """A RayJob that an earlier requeue put on block cr-0old: templates and Workload PodSets ask for it."""
    toleration = {"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": "reserved", "effect": "NoSchedule"}
    job = rayjob(labels={"kueue.x-k8s.io/queue-name": "training"}, selector=OLD_BLOCK, tolerations=[toleration])
    job = kubeapi.create(job)
    kubeapi.create(workload_for(job, flavor="capacity-block"))


async def test_a_block_to_block_move_requeues_onto_the_new_block(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """Only the reservation id changes: Kueue's comparePodTemplate does not see it (v0.14-v0.19)."""
    seed_admitted_on_block(kubeapi)
    requeuer = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=3)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        result = await requeuer.requeue(TARGET, decision=NEW_BLOCK, event=EVENT)
        assert any(c.startswith("reactivated") for c in result.changes)
        await eventually(lambda: kueue.admitted == ["capacity-block"]
                         and not kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"])
        assert kueue.workload_updates == 0  # Kueue never re-read the job: the selector is not compared
        assert kueue.failed_to_start == []
    for selector in worker_selectors(kubeapi):
        assert selector == {**OLD_BLOCK, "karpenter.k8s.aws/capacity-reservation-id": "cr-0new"}
    wl = kubeapi.list("workloads", namespace=NS)[0]
    assert wl["spec"]["active"] is True
    for ps in wl["spec"]["podSets"]:  # the next eviction restores the new block, not the old one
        assert ps["template"]["spec"]["nodeSelector"]["karpenter.k8s.aws/capacity-reservation-id"] == "cr-0new"


async def test_a_move_with_identical_tolerations_lands_on_the_decided_flavor(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """Spot -> block with the same tolerations on every capacity: only the node selector differs.

    Left to Kueue, the Workload keeps its old PodSets, the scheduler admits on the spot flavor
    and merging spot's labels into the job's reserved selector fails the start (FailedToStart).
    """
    same = ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)
    seed_admitted_on_spot(kubeapi, tolerations=list(same))  # the one toleration every capacity gets
    requeuer = KueueRequeuer(api, tolerations={c: same for c in Capacity if c is not Capacity.WAIT},
                             poll_interval_s=0.02, settle_timeout_s=3)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
        await eventually(lambda: len(kueue.admitted) == 1 and not kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"]
                         or bool(kueue.failed_to_start))
        assert kueue.failed_to_start == [] and kueue.admitted == ["capacity-block"]
    for selector in worker_selectors(kubeapi):
        assert selector["karpenter.sh/capacity-type"] == "reserved"
        assert selector["karpenter.k8s.aws/capacity-reservation-id"] == "cr-0block"


def test_the_simulator_compares_what_kueue_compares() -> None:
    """comparePodTemplate (pkg/util/equality/podset.go, v0.14-v0.19): selector and affinity are not compared."""

    job = rayjob(labels={"kueue.x-k8s.io/queue-name": "training"})
    job["metadata"]["uid"] = "u-1"
    wl = workload_for(job)
    moved = rayjob(labels={"kueue.x-k8s.io/queue-name": "training"}, selector=OLD_BLOCK, affinity=SPOT_AFFINITY)
    assert equivalent(moved, wl)
    tolerated = rayjob(tolerations=[{"key": "k", "operator": "Exists"}])
    assert not equivalent(tolerated, wl)
    wl_admitted = workload_for(job, flavor="spot")  # admitted: tolerations are ignored
    assert equivalent(tolerated, wl_admitted)
    resized = rayjob()
    resized["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = 3
    assert not equivalent(resized, wl_admitted)


@pytest.mark.parametrize(("served", "found"), [(("v1beta1",), "v1beta1"), (("v1beta1", "v1beta2"), "v1beta2"),
                                               (("v1beta2",), "v1beta2"), ((), None)])
async def test_the_workload_version_is_found_through_discovery(served: tuple[str, ...], found: str | None) -> None:
    async with kueue_serving(*served) as server:
        api = server.api_client(token="requeue-test")
        try:
            assert await discover_workload_version(api) == found
        finally:
            await api.close()


@pytest.mark.parametrize("served", [("v1beta1",), ("v1beta1", "v1beta2")])
async def test_a_requeue_works_on_the_workload_version_the_server_serves(served: tuple[str, ...]) -> None:
    """Kueue v0.14 serves only v1beta1: a hard-coded v1beta2 was a 404 and a PermanentError."""
    async with kueue_serving(*served) as server:
        api = server.api_client(token="requeue-test")
        try:
            seed_admitted_on_spot(server)
            requeuer = KueueRequeuer(api, workload_version=await discover_workload_version(api),
                                     poll_interval_s=0.02, settle_timeout_s=10)
            async with KueueSim(server, namespace=NS) as kueue:
                result = await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
                assert any(c.startswith("reactivated") for c in result.changes)
                await eventually(lambda: kueue.admitted == ["capacity-block"])
            statuses = {r.status for r in server.requests if r.resource.startswith("workloads")}
            assert statuses <= {200, 409}  # 409: a conditional patch raced Kueue and was read again
        finally:
            await api.close()


async def test_without_kueue_a_kueue_managed_run_is_refused_saying_why(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    with pytest.raises(PermanentError, match="serves no Kueue Workload version"):
        await KueueRequeuer(api, workload_version=None).requeue(TARGET, decision=BLOCK, event=EVENT)


async def test_the_simulator_fails_a_start_whose_flavor_contradicts_the_job(kubeapi: KubeApiServer) -> None:
    """startJob's merge (pkg/podset/podset.go Merge): a conflicting flavor label is FailedToStart, not an overwrite."""
    job = kubeapi.create(rayjob(labels={"kueue.x-k8s.io/queue-name": "training"}, suspend=True))
    kubeapi.create(workload_for(job))  # PodSets without a capacity selector: the spot flavor fits first
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:  # the job alone asks for the block
        group["template"]["spec"]["nodeSelector"] = {"karpenter.sh/capacity-type": "reserved"}
    kubeapi.put(job)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        await eventually(lambda: bool(kueue.failed_to_start))
    assert kueue.admitted == ["spot"] and kueue.workload_updates == 0
    assert kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"] is True
    wl = kubeapi.list("workloads", namespace=NS)[0]
    assert any(c["type"] == "Finished" and c["reason"] == "FailedToStart" for c in wl["status"]["conditions"])
    assert worker_selectors(kubeapi) == [{"karpenter.sh/capacity-type": "reserved"}] * 2


async def test_the_simulator_restores_what_kueue_restores_at_eviction(kubeapi: KubeApiServer) -> None:
    """stopJob -> RestorePodSpec (v0.19.2 pkg/podset/podset.go): labels, annotations, nodeSelector,
    tolerations and scheduling gates all come back from the Workload's PodSet."""
    seed_admitted_on_spot(kubeapi)
    job = kubeapi.get("rayjobs", "job", namespace=NS)
    for group in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:  # what admission merged in, and more
        template = group["template"]
        template["metadata"]["labels"]["kueue.x-k8s.io/podset"] = group["groupName"]
        template["metadata"]["annotations"] = {"kueue.x-k8s.io/workload": "rayjob-job-1a2b3"}
        template["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/elastic-job"}]
    kubeapi.put(job)
    wl = kubeapi.list("workloads", namespace=NS)[0]
    kubeapi.patch("workloads", wl["metadata"]["name"], {"spec": {"active": False}}, namespace=NS)
    async with KueueSim(kubeapi, namespace=NS):
        await eventually(lambda: kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"])
    for group in kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        template = group["template"]
        assert template["metadata"].get("labels") == {"app": "train"}
        assert "annotations" not in template["metadata"] and "schedulingGates" not in template["spec"]
        assert "nodeSelector" not in template["spec"]  # the PodSet had none: the flavor's label goes too


@pytest.mark.parametrize(("served", "setting", "used"), [
    (("v1beta1",), "auto", "v1beta1"), (("v1beta1", "v1beta2"), "auto", "v1beta2"),
    (("v1beta1", "v1beta2"), "v1beta1", "v1beta1")])
async def test_the_daemon_takes_the_served_workload_version_at_start_up(
        tmp_path, monkeypatch: pytest.MonkeyPatch, served: tuple[str, ...], setting: str, used: str) -> None:
    """open_runtime in kubernetes mode: discovery unless --kueue-api-version forces a version."""
    from dataclasses import replace

    from resilienced.ops.metrics import Metrics
    from resilienced.settings import Settings
    from resilienced.app.runtime import open_runtime
    from tests.support.kubeapi import RESOURCES

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # clients are made, never called here
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    resources = [replace(t, versions=served) if t.key == "workloads.kueue.x-k8s.io" else t for t in RESOURCES]
    async with KubeApiServer(resources=resources) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        settings = Settings.from_args(["--mode", "kubernetes", "--kubeconfig", str(kubeconfig), "--region", "us-east-1",
                                       "--endpoint-url", "http://127.0.0.1:9", "--kueue-api-version", setting], {})
        async with open_runtime(settings, metrics=Metrics(), replica="r1") as runtime:
            assert runtime.responder.mover.requeue.requeuer.kueue.workload.version == used


def slice_of(job: dict, name: str, *, finished: bool) -> dict:
    """Another Workload of the same job, as Kueue's workload slicing leaves them
    (kubernetes-sigs/kueue v0.19.2 pkg/workloadslicing): a replaced slice is Finished with reason
    WorkloadSliceReplaced; a new slice waits for quota, annotated with the slice it replaces."""
    wl = workload_for(job, name=name)
    if finished:
        wl["status"]["conditions"] = [{"type": "Finished", "status": "True", "reason": "WorkloadSliceReplaced",
                                       "message": "replaced", "lastTransitionTime": "2026-08-20T11:00:00Z"}]
    else:
        wl["metadata"]["annotations"] = {"kueue.x-k8s.io/workload-slice-replacement-for": f"{NS}/rayjob-job-1a2b3"}
        wl["status"]["conditions"] = [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                       "message": "waiting", "lastTransitionTime": "2026-08-20T11:00:00Z"}]
    return wl


@pytest.mark.parametrize("finished", [True, False], ids=["a finished slice", "a pending slice"])
async def test_the_requeue_acts_on_the_active_workload_not_the_newest_written(
        api: k8s.ApiClient, kubeapi: KubeApiServer, finished: bool) -> None:
    # resourceVersion is opaque and says nothing of which Workload is the job's: Kueue takes the
    # newest not finished, not evicted one holding quota (v0.19.2 pkg/workloadslicing FindLatestActiveWorkload).
    seed_admitted_on_spot(kubeapi)
    job = kubeapi.get("rayjobs", "job", namespace=NS)
    other = kubeapi.create(slice_of(job, "rayjob-job-zz999", finished=finished))
    kubeapi.patch("workloads", other["metadata"]["name"], {"metadata": {"labels": {"touched": "1"}}}, namespace=NS)
    impatient = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=0.3)
    with pytest.raises(TemporaryError, match="waiting for Kueue to suspend"):
        await impatient.requeue(TARGET, decision=BLOCK, event=EVENT)  # no Kueue running: stops after step 1
    active = kubeapi.get("workloads", "rayjob-job-1a2b3", namespace=NS)
    assert active["spec"]["active"] is False and active["metadata"]["annotations"][DEACTIVATED_FOR] == "ev-7"
    assert kubeapi.get("workloads", "rayjob-job-zz999", namespace=NS)["spec"]["active"] is True


async def test_with_a_finished_slice_the_run_still_lands_on_the_block_flavor(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    seed_admitted_on_spot(kubeapi)
    job = kubeapi.get("rayjobs", "job", namespace=NS)
    kubeapi.create(slice_of(job, "rayjob-job-0old", finished=True))  # written last: the highest resourceVersion
    requeuer = KueueRequeuer(api, poll_interval_s=0.02, settle_timeout_s=10)
    async with KueueSim(kubeapi, namespace=NS) as kueue:
        await requeuer.requeue(TARGET, decision=BLOCK, event=EVENT)
        await eventually(lambda: kueue.admitted == ["capacity-block"]
                         and not kubeapi.get("rayjobs", "job", namespace=NS)["spec"]["suspend"])


async def test_the_simulator_refuses_a_podset_change_while_the_workload_holds_quota(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    """Rule 7, in the real Kueue's words (tests/cluster/test_plane.py): refused while the Workload
    holds quota, taken once Kueue released it."""
    seed_admitted_on_spot(kubeapi)
    custom = k8s.CustomObjectsApi(api)
    wl = kubeapi.list("workloads", namespace=NS)[0]
    # seeded directly, so not defaulted: a port without its protocol (the schema defaults TCP)
    wl["spec"]["podSets"][-1]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 8265}]
    wl = kubeapi.put(wl)
    name, podsets = wl["metadata"]["name"], wl["spec"]["podSets"]
    changed = [{**ps, "template": {**ps["template"], "spec": {**ps["template"]["spec"], "nodeSelector": {"x": "y"}}}}
               if i == len(podsets) - 1 else ps for i, ps in enumerate(podsets)]
    async with KueueSim(kubeapi, namespace=NS):
        # a write that leaves the PodSets as they are stored (defaults and all) is taken
        await custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", name,
                                                    {"metadata": {"labels": {"seen": "yes"}}}, _content_type=MERGE)
        with pytest.raises(ApiException) as refused:
            await custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", name,
                                                        {"spec": {"podSets": changed}}, _content_type=MERGE)
        body = json.loads(refused.value.body)
        assert (refused.value.status, body["reason"]) == (403, "Forbidden"), body["message"]
        words = PODSET_REFUSAL.fullmatch(body["message"])
        assert words is not None and int(words.group(1)) == len(podsets) - 1, body["message"]
        await custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", name,
                                                    {"spec": {"active": False}}, _content_type=MERGE)
        await eventually(lambda: not any(c["type"] == "QuotaReserved" and c["status"] == "True" for c in
                                         kubeapi.get("workloads", name, namespace=NS)["status"].get("conditions", [])))
        taken = await custom.patch_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NS, "workloads", name,
                                                            {"spec": {"podSets": changed}}, _content_type=MERGE)
    assert taken["spec"]["podSets"][-1]["template"]["spec"]["nodeSelector"] == {"x": "y"}
