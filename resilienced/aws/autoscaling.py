"""The Auto Scaling adapter: the calls a terminate lifecycle hook waits for.

``RecordLifecycleActionHeartbeat`` while the drain, the save and the durable wait go on (a hook's
heartbeat timeout, 30-7200 s, can be shorter than they take: without a heartbeat the ASG would go
on terminating at the timeout, its default result, before the checkpoint is durable), then
``CompleteLifecycleAction`` (CONTINUE), as aws-node-termination-handler does since 2025.

Errors follow the one rule of :mod:`resilienced.aws.errors` (backend ``"autoscaling"``), with one
named exception: ``ValidationError`` "No active Lifecycle Action" means the action was already
completed (by another replica or an earlier delivery) or timed out, so there is nothing left to do
(and nothing left to keep alive).
"""

from __future__ import annotations

from aiobotocore.client import AioBaseClient

from resilienced.aws import errors
from resilienced.ports import HookAction

BACKEND = "autoscaling"
#: Seconds between two heartbeats: a third of the shortest heartbeat timeout a hook can have (30 s),
#: so a hook of any timeout is kept alive with two beats to spare.
HEARTBEAT_INTERVAL_S = 10.0
#: What :meth:`Lifecycle.complete` answers when the action is no longer pending.
GONE = "already completed or timed out"
#: The message of the ValidationError Auto Scaling answers for an action no longer pending.
NO_ACTIVE_ACTION = "No active Lifecycle Action"


class Lifecycle:
    """:class:`~resilienced.ports.LifecycleHooks`: the Auto Scaling calls a terminate lifecycle hook
    waits for (``RecordLifecycleActionHeartbeat``, ``CompleteLifecycleAction``).  ``heartbeat_seconds``:
    how often ``recovery.heartbeat`` beats."""

    def __init__(self, client: AioBaseClient, *, heartbeat_seconds: float = HEARTBEAT_INTERVAL_S) -> None:
        self._client = client  # an aiobotocore ``autoscaling`` client owned by the caller
        self.heartbeat_seconds = heartbeat_seconds

    async def heartbeat(self, action: HookAction, *, instance_id: str | None) -> bool:
        """Restart the hook's heartbeat timeout for ``instance_id`` (``RecordLifecycleActionHeartbeat``);
        False when the action is no longer pending (nothing left to keep alive)."""
        params = {
            "LifecycleHookName": action.lifecycle_hook_name,
            "AutoScalingGroupName": action.auto_scaling_group_name,
            "LifecycleActionToken": action.lifecycle_action_token,
        }
        if instance_id:
            params["InstanceId"] = instance_id
        try:
            await self._client.record_lifecycle_action_heartbeat(**params)
        except Exception as e:
            if errors.error_code(e) == "ValidationError" and NO_ACTIVE_ACTION in str(e):
                return False
            raise errors.translate(e, backend=BACKEND, operation="RecordLifecycleActionHeartbeat") from e
        return True

    async def complete(self, action: HookAction, *, instance_id: str | None) -> str:
        """CONTINUE the terminate action ``action`` (the hook's fields, parsed by
        ``handlers.asg_lifecycle``) for ``instance_id``."""
        params = {
            "LifecycleHookName": action.lifecycle_hook_name,
            "AutoScalingGroupName": action.auto_scaling_group_name,
            "LifecycleActionToken": action.lifecycle_action_token,
            "LifecycleActionResult": "CONTINUE",
        }
        if instance_id:
            params["InstanceId"] = instance_id
        try:
            await self._client.complete_lifecycle_action(**params)
        except Exception as e:
            if errors.error_code(e) == "ValidationError" and NO_ACTIVE_ACTION in str(e):
                return GONE
            raise errors.translate(e, backend=BACKEND, operation="CompleteLifecycleAction") from e
        return "completed (CONTINUE)"
