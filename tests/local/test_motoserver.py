"""The moto server the tests and the drill run (``resilienced.local.motoserver``): a delete is never lost.

moto 5.2.5's ``Queue.delete_message`` rebuilds the queue's message list and assigns it; two
deletes served at once (the server's threads) can each rebuild from the old list, and the last
assignment puts the other's message back (the module's docstring). Here the interleaving is
forced: one delete stops inside its rebuild (its list read, not yet assigned) until a second delete has finished, or a
bound has passed (then the second one is waiting for the lock, as it must).
"""

from __future__ import annotations

import threading

import pytest
from moto.sqs import models

from resilienced.local import motoserver
from tests.support.kubeoptions import LOCAL_BOUND_S

pytestmark = pytest.mark.unit

ACCOUNT, REGION = "123456789012", "us-east-1"


def two_messages_in_flight(name: str) -> tuple[models.SQSBackend, list[str]]:
    backend = models.sqs_backends[ACCOUNT][REGION]
    backend.create_queue(name)
    backend.send_message(name, "one")
    backend.send_message(name, "two")
    received = backend.receive_message(name, count=10, wait_seconds_timeout=0, visibility_timeout=600)
    return backend, [message.receipt_handle for message in received]


def deletes_that_interleave(backend: models.SQSBackend, name: str, first: str, second: str, *,
                            hold_s: float) -> None:
    """Delete ``first``; while its rebuild runs, delete ``second`` from another thread.

    The first delete holds inside its rebuild until the second one finished, or ``hold_s``
    passed: a second delete that waits for the lock cannot finish then, whatever the load.
    """
    inside, second_done = threading.Event(), threading.Event()
    original = models.Message.had_receipt_handle
    rebuilding = threading.local()

    def had_receipt_handle(message: models.Message, handle: str) -> bool:
        # the first delete's first call is its check that the handle is known (``any``), the
        # second its rebuild's first step: stop there, with the old list already being read
        rebuilding.calls = getattr(rebuilding, "calls", 0) + 1
        if getattr(rebuilding, "on", False) and rebuilding.calls == 2:
            inside.set()
            second_done.wait(hold_s)  # the second delete runs now, unless it waits for the lock
        return original(message, handle)

    def delete_second() -> None:
        inside.wait(10)
        backend.delete_message(name, second)
        second_done.set()

    other = threading.Thread(target=delete_second)
    other.start()
    models.Message.had_receipt_handle = had_receipt_handle
    try:
        rebuilding.on = True
        backend.delete_message(name, first)
        rebuilding.on = False
    finally:
        models.Message.had_receipt_handle = original
        other.join(10)
    assert inside.is_set() and not other.is_alive()


def test_two_deletes_at_once_both_delete() -> None:
    motoserver.patch()
    backend, (first, second) = two_messages_in_flight("patched")
    deletes_that_interleave(backend, "patched", first, second, hold_s=0.5)
    assert backend.get_queue("patched")._messages == []


def test_the_unpatched_delete_loses_one_so_the_test_above_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    unpatched = getattr(models.Queue.delete_message, "__wrapped__", models.Queue.delete_message)
    monkeypatch.setattr(models.Queue, "delete_message", unpatched)
    backend, (first, second) = two_messages_in_flight("unpatched")
    deletes_that_interleave(backend, "unpatched", first, second, hold_s=LOCAL_BOUND_S)
    assert [m.receipt_handle for m in backend.get_queue("unpatched")._messages] == [second]


def test_patching_twice_wraps_once() -> None:
    motoserver.patch()
    once = models.Queue.delete_message
    motoserver.patch()
    assert models.Queue.delete_message is once and once.__wrapped__.__name__ == "delete_message"
