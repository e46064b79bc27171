"""The Auto Scaling adapter: the call a terminate lifecycle hook waits for (``CompleteLifecycleAction``).

Errors follow the one rule of :mod:`resilienced.aws.errors` (backend ``"autoscaling"``), with one
named exception: ``ValidationError`` "No active Lifecycle Action" means the action was already
completed (by another replica or an earlier delivery) or timed out, so there is nothing left to do.
"""

from __future__ import annotations

from aiobotocore.client import AioBaseClient

from handlers.asg_lifecycle import LifecycleAction
from resilienced.aws import errors

BACKEND = "autoscaling"
#: The message of the ValidationError Auto Scaling answers for an action no longer pending.
NO_ACTIVE_ACTION = "No active Lifecycle Action"


class Lifecycle:
    """The Auto Scaling call a terminate lifecycle hook waits for (``CompleteLifecycleAction``)."""

    def __init__(self, client: AioBaseClient) -> None:
        self._client = client  # an aiobotocore ``autoscaling`` client owned by the caller

    async def complete(self, action: LifecycleAction, *, instance_id: str | None) -> str:
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
                return "already completed or timed out"
            raise errors.translate(e, backend=BACKEND, operation="CompleteLifecycleAction") from e
        return "completed (CONTINUE)"
