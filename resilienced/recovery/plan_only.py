"""The plan-only responder: logs each plan and reports it done, acting on nothing.

The seam itself, :class:`~resilienced.ports.Responder`: the consumer hands every *actionable*
:class:`~resilienced.model.Plan` to a responder and turns what comes back into an ack verdict:

- an :class:`~resilienced.model.Outcome` returned: used as is (``DONE`` deletes the message);
- :class:`~resilienced.errors.TemporaryError` raised: ``RETRY`` (the message comes back, after
  ``delay`` seconds when given);
- :class:`~resilienced.errors.PermanentError` raised: ``FAILED`` (logged, acknowledged);
- anything else raised: ``RETRY`` with the error logged; the loop never crashes.

``act`` may take minutes (signal, wait for a durable checkpoint, requeue): the consumer keeps
the message invisible and the event's claim alive while it runs.  ``holder`` identifies this
delivery (``<replica>/<message id>``) for the responder's own per-target idempotency.

:class:`PlanLogger` is the responder of ``--mode plan`` (and of tests that need no world): it
logs each plan and reports it done.  The responder that acts (``--mode kubernetes`` and ``ray``)
is :class:`resilienced.recovery.responder.Recovery` (locate -> signal -> durable -> requeue).
"""

from __future__ import annotations


from resilienced import log
from resilienced.log import Logger
from resilienced.model import Outcome, Plan, Result
from resilienced.intake.validate import isoformat


class PlanLogger:
    """A responder that only logs the plan (one ``plan`` line) and reports it done."""

    def __init__(self, logger: Logger | None = None) -> None:
        self._log = logger or log.get("resilienced.recovery.plan_only")

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        event = plan.event
        self._log.info(
            "plan", event_id=event.event_id, kind=event.kind.value,
            instance_ids=list(plan.instance_ids),
            capacity_reservation_id=plan.capacity_reservation_id,
            steps=[step.value for step in plan.steps], deadline=isoformat(plan.deadline),
            attributes=event.detail_json(), holder=holder,
        )
        return Outcome(result=Result.DONE, event=event, plan=plan,
                       reason="plan logged (--mode plan acts on nothing)")
