"""The Auto Scaling adapter: the call a terminate lifecycle hook waits for (``CompleteLifecycleAction``).

Errors follow the one rule of :mod:`resilienced.aws.errors` (backend ``"autoscaling"``), with one
named exception: ``ValidationError`` "No active Lifecycle Action" means the action was already
completed (by another replica or an earlier delivery) or timed out, so there is nothing left to do.
"""

from __future__ import annotations

from typing import Any

from resilienced.aws import errors

BACKEND = "autoscaling"
#: The message of the ValidationError Auto Scaling answers for an action no longer pending.
NO_ACTIVE_ACTION = "No active Lifecycle Action"


class Lifecycle:
    """The Auto Scaling call a terminate lifecycle hook waits for (``CompleteLifecycleAction``)."""

    def __init__(self, client: Any) -> None:
        self._client = client  # an aiobotocore ``autoscaling`` client owned by the caller

    async def complete(self, *, event_attributes: dict[str, Any], instance_id: str | None) -> str:
        params = {
            "LifecycleHookName": event_attributes["lifecycle_hook_name"],
            "AutoScalingGroupName": event_attributes["auto_scaling_group_name"],
            "LifecycleActionToken": event_attributes["lifecycle_action_token"],
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
