"""``python -m resilienced.local.motoserver``: moto's server, with SQS's delete made atomic.

What :class:`resilienced.local.aws.MotoServer` runs (the drill, the campaign, the tests). Its
arguments are ``moto.server``'s.

moto 5.2.5's ``Queue.delete_message`` (moto/sqs/models.py) reads the queue's message list,
builds a new one without the deleted message and assigns it, without the queue's lock; the
server answers each request on its own thread. Two DeleteMessage requests at once can then
each build its list from the old one, and the one assigned last puts the other's message back,
still in flight: it comes back after its visibility timeout although its delete succeeded (a
message sent at the same moment can be lost the same way). Real SQS does neither. Here the
delete holds the queue's own lock (``Queue._messages_lock``, which ``add_message`` already
holds), so deletes, and a delete and a send, happen one after the other.
``tests/local/test_motoserver.py`` plays the interleaving that loses a delete.

And EC2 capacity that runs out (the drill's ``--provider ec2``): moto launches whatever it is
asked.  With ``RESILIENCED_MOTO_EC2_CAPACITY`` set to a JSON object of market -> instances
(``{"spot": 0, "capacity-block": 2, "on-demand": 0}``; the market is RunInstances'
``InstanceMarketOptions.MarketType``, none is ``on-demand``; a market not listed has no limit), a
RunInstances that would take a market past its live (not terminated) instances is answered as EC2
answers it, ``InsufficientInstanceCapacity``, and launches nothing.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable
from typing import Any

from moto.sqs import models

#: market -> how many live instances EC2 has for it (JSON); unset: no limit.
EC2_CAPACITY_ENV = "RESILIENCED_MOTO_EC2_CAPACITY"


def _under_the_queue_lock(delete: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(delete)
    def delete_message(self: models.Queue, receipt_handle: str) -> None:
        with self._messages_lock:
            return delete(self, receipt_handle)

    delete_message.resilienced_locked = True  # type: ignore[attr-defined]
    return delete_message


def _with_capacity(run_instances: Callable[..., Any], capacity: dict[str, int]) -> Callable[..., Any]:
    from moto.ec2.exceptions import EC2ClientError

    launched: dict[str, list[str]] = {}
    lock = threading.Lock()

    @functools.wraps(run_instances)
    def run(self: Any) -> Any:
        market = self._get_param("InstanceMarketOptions.MarketType") or "on-demand"
        if market not in capacity:
            return run_instances(self)
        with lock:
            live = [i for i in launched.get(market, [])
                    if self.ec2_backend.get_instance(i)._state.name not in ("shutting-down", "terminated")]
            if len(live) + int(self._get_param("MinCount", if_none="1")) > capacity[market]:
                raise EC2ClientError("InsufficientInstanceCapacity", (
                    f"We currently do not have sufficient {market} capacity in the Availability Zone you "
                    f"requested (moto: {len(live)} of {capacity[market]} in use)."))
            answer = run_instances(self)
            launched[market] = live + [i.id for i in answer.result.instances]
            return answer

    run.resilienced_capacity = True  # type: ignore[attr-defined]
    return run


def patch() -> None:
    """Make ``moto.sqs.models.Queue.delete_message`` hold the queue's lock (once); limit EC2's
    capacity per market when :data:`EC2_CAPACITY_ENV` says so."""
    if not getattr(models.Queue.delete_message, "resilienced_locked", False):
        models.Queue.delete_message = _under_the_queue_lock(models.Queue.delete_message)
    capacity = os.environ.get(EC2_CAPACITY_ENV)
    if capacity:
        from moto.ec2.responses.instances import InstanceResponse

        if not getattr(InstanceResponse.run_instances, "resilienced_capacity", False):
            InstanceResponse.run_instances = _with_capacity(
                InstanceResponse.run_instances, {k: int(v) for k, v in json.loads(capacity).items()})


def main() -> None:
    patch()
    from moto.server import main as moto_main

    moto_main()


if __name__ == "__main__":
    main()
