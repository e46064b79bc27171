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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from moto.sqs import models


def _under_the_queue_lock(delete: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(delete)
    def delete_message(self: models.Queue, receipt_handle: str) -> None:
        with self._messages_lock:
            return delete(self, receipt_handle)

    delete_message.resilienced_locked = True  # type: ignore[attr-defined]
    return delete_message


def patch() -> None:
    """Make ``moto.sqs.models.Queue.delete_message`` hold the queue's lock (once)."""
    if not getattr(models.Queue.delete_message, "resilienced_locked", False):
        models.Queue.delete_message = _under_the_queue_lock(models.Queue.delete_message)


def main() -> None:
    patch()
    from moto.server import main as moto_main

    moto_main()


if __name__ == "__main__":
    main()
