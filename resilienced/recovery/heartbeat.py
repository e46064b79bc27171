"""Keeping an ASG terminate hook waiting while the recovery works (``RecordLifecycleActionHeartbeat``).

An Auto Scaling terminate lifecycle hook holds the instance until ``CompleteLifecycleAction`` or
its heartbeat timeout (30-7200 s, default 3600 s).  The drain, the save and the durable wait can
take longer than a short timeout; at the timeout the ASG goes on terminating (its default result)
and the checkpoint may not be durable yet.  :func:`hook_kept_alive` sends a heartbeat at once and
then every ``Lifecycle.heartbeat_seconds`` while the block inside runs (the recovery's runs:
drain, save, durable wait, requeue); the recovery completes the action after it, as
aws-node-termination-handler does since 2025.

A heartbeat that fails is logged and the next one is tried (one lost beat does not lose the hook:
the interval is a third of the shortest timeout); an action no longer pending (completed by
another replica, or timed out) ends the beats.  Leaving the block stops them: a heartbeat in flight
finishes, none starts, so the action is completed after the last one.  Nothing here changes the
recovery's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from handlers.asg_lifecycle import LifecycleAction
from resilienced import log
from resilienced.errors import ResilienceError
from resilienced.model import Plan, Step
from resilienced.ports import LifecycleHooks

_log = log.get(__name__)


@contextlib.asynccontextmanager
async def hook_kept_alive(lifecycle: LifecycleHooks | None, plan: Plan) -> AsyncIterator[list[str]]:
    """Heartbeats for ``plan``'s terminate action while the block runs; yields what each did so far
    (``recorded``, ``no longer pending``, ``failed: ...``: the recovery reports them).  Nothing for
    a plan without a lifecycle action to complete, or without Auto Scaling access."""
    beats: list[str] = []
    action = plan.event.detail
    if lifecycle is None or Step.COMPLETE_LIFECYCLE not in plan.steps or not isinstance(action, LifecycleAction):
        yield beats
        return
    instance = plan.instance_ids[0] if plan.instance_ids else None
    stop = asyncio.Event()
    task = asyncio.create_task(_beat(lifecycle, action, instance, beats, stop), name="resilienced.asg-heartbeat")
    try:
        yield beats
    finally:
        # no heartbeat after the block: one in flight finishes (not cut off mid-request, where AWS may
        # have it already and record it after the action is completed), none starts (run 99)
        stop.set()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:  # our caller is cancelled: the beats are, too
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise


async def _beat(lifecycle: LifecycleHooks, action: LifecycleAction, instance: str | None, beats: list[str],
                stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            pending = await lifecycle.heartbeat(action, instance_id=instance)
        except ResilienceError as e:
            _log.warning("lifecycle heartbeat failed", instance_id=instance, error=str(e),
                         hook=action.lifecycle_hook_name, group=action.auto_scaling_group_name)
            beats.append(f"failed: {e}")
        else:
            beats.append("recorded" if pending else "no longer pending")
            if not pending:
                _log.info("lifecycle action no longer pending: heartbeats stop", instance_id=instance)
                return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(lifecycle.heartbeat_seconds):
                await stop.wait()
