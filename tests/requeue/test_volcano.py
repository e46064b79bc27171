"""Volcano Jobs: a RestartJob Command restarts the whole job; task templates steered where allowed."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from kubernetes_asyncio import client as k8s

from resilienced.model import Capacity, CapacityDecision
from resilienced.errors import PermanentError
from resilienced.model import Event, Kind, RunFacts, Target
from resilienced.requeue.volcano import VolcanoRequeuer
from resilienced.requeue.rbac import requested_verbs
from resilienced.requeue.volcano import command_name
from tests.requeue.objects import NS, pod_template
from tests.requeue.volcano_sim import VolcanoSim
from tests.support.kubeapi import KubeApiServer

pytestmark = pytest.mark.integration

ON_DEMAND = CapacityDecision(Capacity.ON_DEMAND, "no block with room")
EVENT = Event(kind=Kind.SPOT_INTERRUPTION, event_id="ev-9", instance_ids=("i-0aaa",))
TARGET = Target(instance_id="i-0aaa", node="spot-1", ray_cluster=None, ray_job=None, ray_node_ids=(),
                checkpoint_uri=None, facts=RunFacts(volcano_job=f"{NS}/vcjob"))


def volcano_job() -> dict:
    spot = {"karpenter.sh/capacity-type": "spot"}
    return {
        "apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
        "metadata": {"name": "vcjob", "namespace": NS},
        "spec": {"minAvailable": 3, "schedulerName": "volcano", "queue": "default", "maxRetry": 3,
                 "policies": [{"event": "PodEvicted", "action": "RestartJob"}],
                 "tasks": [{"name": "head", "replicas": 1, "template": pod_template(selector=spot)},
                           {"name": "worker", "replicas": 2, "template": pod_template(selector=spot)}]},
        "status": {"state": {"phase": "Running"}, "retryCount": 0},
    }


async def test_restart_as_a_whole_on_the_decided_capacity(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    job = kubeapi.create(volcano_job())
    result = await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert result.changed and result.details["steered"] is True
    commands = kubeapi.list("commands", namespace=NS)
    assert len(commands) == 1
    cmd = commands[0]
    assert cmd["metadata"]["name"] == command_name("vcjob", "ev-9")
    assert cmd["action"] == "RestartJob"
    assert cmd["target"]["kind"] == "Job" and cmd["target"]["name"] == "vcjob"
    assert cmd["target"]["uid"] == job["metadata"]["uid"] and cmd["target"]["controller"] is True
    assert cmd["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    after = kubeapi.get("jobs", "vcjob", namespace=NS)
    for task in after["spec"]["tasks"]:
        assert task["template"]["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "on-demand"}
    assert after["metadata"]["annotations"]["resilienced.io/requeued-for"] == "ev-9"


async def test_the_same_event_restarts_once(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(volcano_job())
    requeuer = VolcanoRequeuer(api)
    await requeuer.requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    # Volcano takes the Command and deletes it; a redelivered event must not restart again.
    for cmd in kubeapi.list("commands", namespace=NS):
        kubeapi.delete("commands", cmd["metadata"]["name"], namespace=NS)
    kubeapi.reset_log()
    again = await requeuer.requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert again.changes == () and kubeapi.list("commands", namespace=NS) == []
    assert [r for r in kubeapi.requests if r.verb != "get"] == []


async def test_a_command_not_yet_taken_is_not_duplicated(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(volcano_job())
    kubeapi.create({"apiVersion": "bus.volcano.sh/v1alpha1", "kind": "Command",
                    "metadata": {"name": command_name("vcjob", "ev-9"), "namespace": NS}, "action": "RestartJob"})
    await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert len(kubeapi.list("commands", namespace=NS)) == 1


async def test_a_refused_template_change_still_restarts_the_job(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(volcano_job())
    kubeapi.fail(verb="patch", resource="jobs", status=400, times=1,
                 message='admission webhook "validatejob.volcano.sh" denied the request: job updates may not '
                         "change fields other than `minAvailable`, `tasks[*].replicas under spec` and "
                         "`PriorityClassName`")
    result = await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert result.details["steered"] is False and "not steered" in result.reason
    assert any("refused the task template change" in c for c in result.changes)
    assert len(kubeapi.list("commands", namespace=NS)) == 1
    after = kubeapi.get("jobs", "vcjob", namespace=NS)
    assert after["spec"]["tasks"][1]["template"]["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert after["metadata"]["annotations"]["resilienced.io/requeued-for"] == "ev-9"
    assert "resilienced.io/capacity-type" not in after["metadata"]["annotations"]  # it did not move


async def test_a_job_volcano_already_restarts_on_the_decided_capacity_is_left_alone(
    api: k8s.ApiClient, kubeapi: KubeApiServer
) -> None:
    job = volcano_job()
    for task in job["spec"]["tasks"]:
        task["template"]["spec"]["nodeSelector"] = {"karpenter.sh/capacity-type": "on-demand"}
        task["template"]["spec"]["tolerations"] = [{"key": "karpenter.sh/capacity-type", "operator": "Equal",
                                                     "value": "on-demand", "effect": "NoSchedule"}]
    job["status"]["state"]["phase"] = "Restarting"
    kubeapi.create(job)
    result = await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert result.changes == () and "already restarting" in result.reason
    assert kubeapi.list("commands", namespace=NS) == []


async def test_dry_run_writes_nothing(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(volcano_job())
    result = await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT, dry_run=True)
    assert result.dry_run and any("would create Command" in c for c in result.changes)
    assert kubeapi.list("commands", namespace=NS) == []
    assert [r for r in kubeapi.requests if r.verb != "get"] == []


async def test_a_target_without_a_volcano_job_is_refused(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    bare = Target(instance_id="i-0aaa", node=None, ray_cluster=None, ray_job=None, ray_node_ids=(), checkpoint_uri=None)
    with pytest.raises(PermanentError, match="volcano_job"):
        await VolcanoRequeuer(api).requeue(bare, decision=ON_DEMAND, event=EVENT)


async def test_requests_stay_within_the_declared_rbac(api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    kubeapi.create(volcano_job())
    await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=EVENT)
    assert all(r.status < 400 for r in kubeapi.requests)
    assert kubeapi.verbs_seen() <= requested_verbs()


# ---------------------------------------------------------------------- the Job's own restart
SPOT = CapacityDecision(Capacity.SPOT, "spot healthy")
REFUSAL = ('admission webhook "validatejob.volcano.sh" denied the request: job updates may not change fields '
           "other than `minAvailable`, `tasks[*].replicas under spec` and `PriorityClassName`")


def noticed_now() -> Event:
    return replace(EVENT, time=datetime.now(timezone.utc) - timedelta(seconds=30))


@pytest.mark.parametrize(("decision", "refused"), [(SPOT, False), (ON_DEMAND, True)],
                         ids=["templates already on the decision", "steering refused by the webhook"])
async def test_a_job_that_restarted_itself_after_the_notice_gets_no_second_restart(
        api: k8s.ApiClient, kubeapi: KubeApiServer, decision: CapacityDecision, refused: bool) -> None:
    job = volcano_job()
    job["spec"]["maxRetry"] = 2
    kubeapi.create(job)
    volcano = VolcanoSim(kubeapi, namespace=NS)
    event = noticed_now()
    volcano.pod_evicted("vcjob", task="worker")  # Karpenter's drain evicts a pod: PodEvicted -> RestartJob
    assert kubeapi.get("jobs", "vcjob", namespace=NS)["status"]["state"]["phase"] == "Running"  # already back
    if refused:
        kubeapi.fail(verb="patch", resource="jobs", status=400, times=1, message=REFUSAL)

    result = await VolcanoRequeuer(api).requeue(TARGET, decision=decision, event=event)
    volcano.step()

    assert kubeapi.list("commands", namespace=NS) == [] and volcano.restarts == [("vcjob", "policy")], result.changes
    after = kubeapi.get("jobs", "vcjob", namespace=NS)
    assert (after["status"]["retryCount"], after["status"]["state"]["phase"]) == (1, "Running")
    assert "restarted the job itself" in result.reason and result.details["own_restart"]


async def test_a_second_restart_after_the_jobs_own_fails_it_at_max_retry(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    # What a second restart costs (here the notice has no time, so the Job's own restart, done and
    # Running again, cannot be told apart): its own one plus resilienced's reach maxRetry 2.
    job = volcano_job()
    job["spec"]["maxRetry"] = 2
    kubeapi.create(job)
    volcano = VolcanoSim(kubeapi, namespace=NS)
    volcano.pod_evicted("vcjob", task="worker")
    await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=replace(EVENT, event_id="ev-10"))
    volcano.step()
    assert volcano.restarts == [("vcjob", "policy"), ("vcjob", "command")]
    assert kubeapi.get("jobs", "vcjob", namespace=NS)["status"]["state"]["phase"] == "Failed"


async def test_a_job_that_restarted_itself_is_still_moved_when_its_templates_could_be_steered(
        api: k8s.ApiClient, kubeapi: KubeApiServer) -> None:
    # Its own restart recreated the pods from the old (Spot) templates; only a restart puts the
    # steered templates to use, at the cost of one retry (said in the reason).
    kubeapi.create(volcano_job())
    volcano = VolcanoSim(kubeapi, namespace=NS)
    volcano.pod_evicted("vcjob", task="worker")
    result = await VolcanoRequeuer(api).requeue(TARGET, decision=ON_DEMAND, event=noticed_now())
    volcano.step()
    assert volcano.restarts == [("vcjob", "policy"), ("vcjob", "command")]
    assert result.details["steered"] is True and "one more of maxRetry" in result.reason
    assert kubeapi.get("jobs", "vcjob", namespace=NS)["status"]["retryCount"] == 2
