"""A stand-in for Volcano's job controller, on the emulated API server (test support only).

Volcano cannot run here, so this plays the rules a requeue meets, as volcano-sh/volcano at ed72c7c
(v1.16 line; the same in v1.15.1) writes them, on the Job's status; pods are not modelled (the
requeue never reads them), so "all pods killed" and "all pods running" happen at once:

1. A pod event (``pod_evicted``): the Job's policies map the event to an action
   (``pkg/controllers/job/job_controller_util.go`` ``applyPolicies``: task policies first, then the
   Job's; ``PodEvicted -> RestartJob`` is the usual one); ``RestartJob`` in the Running or Pending
   state kills every pod, moves the Job to ``Restarting`` and adds one to ``status.retryCount``
   (``pkg/controllers/job/state/running.go``, ``pending.go``).
2. A ``bus.volcano.sh/v1alpha1`` Command targeting the Job (``step``): the controller deletes it
   first, "to make sure executed not more than once", then runs its action as in 1
   (``job_controller_handler.go`` ``processNextCommand``).
3. ``Restarting`` (``state/restarting.go`` ``restartingUpdateStatus``): ``retryCount >= maxRetry``
   (default 3) -> ``Failed``; else, the pods gone -> ``Pending``; ``Pending`` with every pod
   running -> ``Running`` (``state/pending.go`` SyncJob).
4. Every phase change sets ``status.state.lastTransitionTime`` and puts a condition ``{status:
   <phase>, lastTransitionTime}`` in ``status.conditions``, one per phase (the newest replaces the
   older one: ``job_controller_actions.go`` ``newCondition`` / ``appendJobCondition``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from tests.support.kubeapi import KubeApiServer

RESTARTABLE = ("Running", "Pending")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class VolcanoSim:
    """``pod_evicted`` and ``step`` act on the Jobs of ``namespace`` (sequential: call after the code under test)."""

    def __init__(self, server: KubeApiServer, *, namespace: str) -> None:
        self.server = server
        self.namespace = namespace
        self.restarts: list[tuple[str, str]] = []  # (job, "policy" | "command"), in order

    def pod_evicted(self, job_name: str, *, task: str | None = None) -> None:
        """Rule 1 for one evicted pod of ``task``, then the Job settles (rule 3)."""
        job = self._job(job_name)
        if self._action(job, "PodEvicted", task) == "RestartJob":
            self._restart(job, "policy")
        self._settle(job)

    def step(self) -> None:
        """Rule 2 for every Command, then rule 3 for every Job."""
        for cmd in self.server.list("commands", namespace=self.namespace):
            self.server.delete("commands", cmd["metadata"]["name"], namespace=self.namespace)
            job = self._job((cmd.get("target") or {}).get("name", ""))
            if cmd.get("action") == "RestartJob":
                self._restart(job, "command")
            self._settle(job)

    # ------------------------------------------------------------------ rules
    @staticmethod
    def _action(job: dict[str, Any], event: str, task: str | None) -> str | None:
        tasks = {t["name"]: t for t in job["spec"].get("tasks") or []}
        for policies in ((tasks.get(task) or {}).get("policies") or [], job["spec"].get("policies") or []):
            for policy in policies:
                events = policy.get("events") or ([policy["event"]] if policy.get("event") else [])
                if event in events or "*" in events:
                    return policy.get("action")
        return None

    def _restart(self, job: dict[str, Any], by: str) -> None:
        status = job.setdefault("status", {})
        if (status.get("state") or {}).get("phase") not in RESTARTABLE:
            return
        status["retryCount"] = int(status.get("retryCount") or 0) + 1
        self._phase(job, "Restarting")
        self.restarts.append((job["metadata"]["name"], by))

    def _settle(self, job: dict[str, Any]) -> None:
        status = job["status"]
        if status["state"]["phase"] == "Restarting":
            failed = status["retryCount"] >= int(job["spec"].get("maxRetry") or 3)
            self._phase(job, "Failed" if failed else "Pending")
        if status["state"]["phase"] == "Pending":
            self._phase(job, "Running")
        self.server.put(job)

    @staticmethod
    def _phase(job: dict[str, Any], phase: str) -> None:
        status = job["status"]
        now = _now()
        status["state"] = {**(status.get("state") or {}), "phase": phase, "lastTransitionTime": now}
        conditions = [c for c in status.get("conditions") or [] if c.get("status") != phase]
        status["conditions"] = [*conditions, {"status": phase, "lastTransitionTime": now}]

    def _job(self, name: str) -> dict[str, Any]:
        job = self.server.get("jobs", name, namespace=self.namespace)
        assert job is not None, f"no Volcano Job {name}"
        return job
