"""Requeue a Volcano Job (``batch.volcano.sh/v1alpha1``) as a whole: restart it through a Command.

Mechanism (volcano-sh/volcano at ed72c7c, v1.16 line):

* **Restart the whole job** by creating a ``bus.volcano.sh/v1alpha1`` Command with
  ``action: RestartJob`` whose ``target`` (and controller ownerReference) is the Job, exactly as
  ``vcctl`` builds its job commands (``pkg/cli/util/util.go`` ``CreateJobCommand``).  The job
  controller takes each Command once (it deletes the Command before acting, "to make sure executed
  not more than once", ``job_controller_handler.go`` ``processNextCommand``); in the Running or
  Pending state ``RestartJob`` kills every pod of the job and moves it to Restarting, then Pending,
  where the pods are created again from the task templates as one gang (``state/running.go``,
  ``state/restarting.go``).  Each restart adds one to ``status.retryCount``, and the job goes
  Failed when it reaches ``spec.maxRetry`` (default 3): resilienced's restarts count too.
* **Steering**: the requeuer sets every task's ``template.spec`` node selector to the decided
  capacity (see :mod:`.placement`) before the restart.  Volcano's validating webhook, where it
  is installed, refuses that: a Job update may change only ``minAvailable``,
  ``tasks[*].replicas`` and ``priorityClassName`` (``pkg/webhooks/admission/jobs/validate/
  admit_job.go`` ``validateJobUpdate``).  Then the job is restarted without steering, the
  refusal is reported in the result, and placement is left to the NodePools (Karpenter falls back
  from Spot to On-Demand on its own when one NodePool allows both).  To steer Volcano jobs, run
  them on a queue whose NodePool has the capacity type, or recreate the Job.
* **The Job's own restart.**  A Job whose policy restarts it on ``PodEvicted`` (``RestartJob``) has
  usually restarted itself by the time the notice is handled: Karpenter drains the node at the
  notice.  Volcano records each phase change in ``status.conditions`` (one ``{status: <phase>,
  lastTransitionTime}`` per phase, the newest kept: ``job_controller_actions.go``
  ``appendJobCondition``), so a ``Restarting`` condition at or after the notice's time is that
  restart (without the notice's time: the phase ``Pending``/``Restarting``).  Then no Command is
  created unless a task's node selector changes and Volcano accepted the change: an unsteered
  restart would recreate the same pods and only spend one more of ``maxRetry`` (the Job fails one
  interruption earlier).  A steered one is what puts the new templates to use (the pods of the
  Job's own restart came from the old ones), and its reason says it spends one more retry.
* Idempotency: the Command's name is derived from (event, job), so a retry finds it (409) while
  Volcano has not taken it yet; after that the annotation ``resilienced.io/requeued-for: <event
  id>`` on the Job says the restart for this event was issued.  (A crash between the Command and
  the annotation can restart the job a second time; the handler's claim makes that rare.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import datetime

from resilienced.capacity.request import ANNOTATION_REQUEUED_FOR
from resilienced.clock import parse_time
from resilienced.errors import PermanentError
from resilienced.kube.api import JsonObj, KubeStatusError
from resilienced.model import CapacityDecision, Event, JsonValue, RequeueResult, Target
from resilienced.requeue.kuberay import PodTemplateRequeuer, bookkeeping
from resilienced.requeue.objects import VOLCANO_COMMAND, VOLCANO_JOB, annotations_of, modify, split_key
from resilienced.requeue.placement import Placement

RESTART_JOB = "RestartJob"
#: Job phases in which the pods are being (re)created as a gang already.
RESTARTING_PHASES = frozenset({"Pending", "Restarting"})
#: Answers that mean "the admission webhook refused the template change".
_REFUSED = (400, 403, 422)


def command_name(job_name: str, event_id: str | None) -> str:
    """A DNS-1123 name for the restart Command of ``job_name`` for one event."""
    digest = hashlib.sha256(f"{job_name}/{event_id or ''}".encode()).hexdigest()[:10]
    return f"{job_name[:40].rstrip('-.')}-restartjob-{digest}"


def placed_tasks(tasks: Sequence[Mapping[str, JsonValue]], placement: Placement) -> tuple[list[dict], list[str]]:
    new_tasks, changed = [], []
    for task in tasks:
        template = dict(task.get("template") or {})
        spec = template.get("spec") or {}
        if not placement.matches(spec):
            changed.append(str(task.get("name", "?")))
        template["spec"] = placement.applied(spec)
        new_tasks.append({**task, "template": template})
    return new_tasks, changed


def own_restart(job: Mapping[str, JsonValue], noticed: datetime | None) -> str | None:
    """How the Job restarted itself since the notice (None: it did not).

    A ``Restarting`` condition of ``status.conditions`` at or after ``noticed`` (Volcano keeps the
    newest transition into each phase); without the notice's time, the phase ``Pending`` or
    ``Restarting`` (the gang is being recreated right now).
    """
    status = job.get("status") or {}
    retries = status.get("retryCount", 0)
    if noticed is not None:
        for condition in status.get("conditions") or []:
            if condition.get("status") != "Restarting":
                continue
            at = _time(condition.get("lastTransitionTime"))
            if at is not None and at >= noticed.replace(microsecond=0):
                return (f"Volcano restarted the job itself at {condition['lastTransitionTime']} (its own policy, "
                        f"retryCount {retries})")
    phase = ((status.get("state") or {}).get("phase")) or ""
    if phase in RESTARTING_PHASES:
        return f"Volcano is already restarting the job ({phase}, retryCount {retries})"
    return None


def _time(value: object) -> datetime | None:
    try:
        return parse_time(str(value)) if value else None
    except ValueError:
        return None


class VolcanoRequeuer(PodTemplateRequeuer):
    """:class:`~resilienced.ports.Requeuer` for Volcano Jobs (``Target.facts.volcano_job``).

    Takes :class:`~resilienced.requeue.kuberay.PodTemplateRequeuer`'s arguments.
    """

    kind = "volcano"

    async def requeue(
        self, target: Target, *, decision: CapacityDecision, event: Event, dry_run: bool = False
    ) -> RequeueResult:
        key = target.facts.volcano_job
        if not key:
            raise PermanentError(f"requeue: target {target.run_key} has no facts.volcano_job")
        namespace, name = split_key(str(key), what="facts.volcano_job")
        job = await self.objects.find(VOLCANO_JOB, namespace, name)
        if job is None:
            raise PermanentError(f"requeue: Volcano Job {key} no longer exists")
        if not decision.places:
            return RequeueResult.waiting(target, kind=self.kind, decision=decision, dry_run=dry_run)
        placement = Placement.for_decision(decision, tolerations=self._tolerations, shape=target.facts.node_shape)
        if event.event_id and annotations_of(job).get(ANNOTATION_REQUEUED_FOR) == event.event_id:
            return self._result(target, decision, [], dry_run,
                                f"the restart for event {event.event_id} was already issued")

        tasks = (job.get("spec") or {}).get("tasks") or []
        if not tasks:
            raise PermanentError(f"requeue: Volcano Job {key} has no tasks")
        _, changed = placed_tasks(tasks, placement)
        moves = any(not placement.selector_matches((t.get("template") or {}).get("spec") or {}) for t in tasks)
        own = own_restart(job, event.time)
        if own and not moves:
            # The gang is recreated already, from templates that ask for the decided capacity:
            # another restart would only spend one more of spec.maxRetry.
            return self._result(target, decision, [], dry_run, f"{own}, already on {decision.capacity.value}: "
                                "no second restart", own=own)
        cmd = command_name(name, event.event_id)
        if dry_run:
            changes = [f"would set tasks {', '.join(changed)} of Volcano Job {key} to {placement.describe()}"] \
                if changed else []
            changes.append(f"would create Command {namespace}/{cmd} (action {RESTART_JOB}) to restart the whole job")
            return self._result(target, decision, changes, True, "plan only", own=own)
        changes, steered = await self._steer(namespace, name, placement, changed) if changed else ([], True)
        if own and not steered:
            return self._result(target, decision, changes, False, (
                f"{own}; the task templates cannot be steered here, so a second restart would recreate the same "
                "pods and only spend one more of maxRetry: none issued"), steered=False, own=own)
        changes += await self._restart(job, cmd, decision=decision, event=event, steered=steered)
        reason = (f"restarted as a whole on {decision.capacity.value}" if steered
                  else "restarted as a whole; not steered (task templates are immutable here)")
        if own:
            reason += (f"; {own} from the old templates: this restart moves it to the decided capacity and "
                       "spends one more of maxRetry")
        return self._result(target, decision, changes, False, reason, steered=steered, own=own)

    async def _steer(self, namespace: str, name: str, placement: Placement,
                     changed: list[str]) -> tuple[list[str], bool]:
        """Set the tasks' templates to ``placement``: (what was done, whether Volcano accepted it)."""
        key = f"{namespace}/{name}"

        def change(j: JsonObj) -> dict[str, JsonValue] | None:
            new_tasks, now_changed = placed_tasks((j.get("spec") or {}).get("tasks") or [], placement)
            return {"spec": {"tasks": new_tasks}} if now_changed else None

        try:
            await modify(lambda: self.objects.get(VOLCANO_JOB, namespace, name), change,
                         lambda patch: self.objects.patch(VOLCANO_JOB, namespace, name, patch),
                         what=f"patch Volcano Job {key}")
        except KubeStatusError as e:
            if e.status not in _REFUSED:
                raise
            return [f"Volcano Job {key} refused the task template change ({e.status} {e.message}); "
                    "restarting it on whatever capacity its NodePools give"], False
        return [f"set tasks {', '.join(changed)} of Volcano Job {key} to {placement.describe()}"], True

    async def _restart(self, job: JsonObj, cmd: str, *, decision: CapacityDecision, event: Event,
                       steered: bool) -> list[str]:
        """The RestartJob Command (once per event) and the bookkeeping annotations."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        changes: list[str] = []
        owner = {"apiVersion": VOLCANO_JOB.api_version, "kind": VOLCANO_JOB.kind, "name": name,
                 "uid": job["metadata"].get("uid"), "controller": True, "blockOwnerDeletion": True}
        try:
            await self.objects.create(VOLCANO_COMMAND, namespace, {
                "apiVersion": VOLCANO_COMMAND.api_version, "kind": VOLCANO_COMMAND.kind,
                "metadata": {"name": cmd, "namespace": namespace, "ownerReferences": [owner]},
                "action": RESTART_JOB, "target": owner,
                "reason": "Requeue", "message": f"resilienced: {decision.reason}"[:1024],
            })
            changes.append(f"created Command {namespace}/{cmd} ({RESTART_JOB}): Volcano restarts the whole job")
        except KubeStatusError as e:
            if e.status != 409:
                raise  # 409: issued by an earlier attempt and not yet taken by Volcano
        now = self._clock()
        annotations = bookkeeping(job, decision=decision, event=event, now=now) if steered else \
            {ANNOTATION_REQUEUED_FOR: event.event_id or ""}
        await modify(lambda: self.objects.get(VOLCANO_JOB, namespace, name),
                     lambda j: {"metadata": {"annotations": annotations}},
                     lambda patch: self.objects.patch(VOLCANO_JOB, namespace, name, patch),
                     what=f"annotate Volcano Job {namespace}/{name}")
        return changes

    def _result(self, target: Target, decision: CapacityDecision, changes: list[str], dry_run: bool,
                reason: str, *, steered: bool = True, own: str | None = None) -> RequeueResult:
        return RequeueResult(
            run_key=target.run_key, kind=self.kind, capacity=decision.capacity, reason=reason,
            reservation_id=decision.reservation_id, changes=tuple(changes), dry_run=dry_run,
            decision=decision, details={"steered": steered, "own_restart": own})
