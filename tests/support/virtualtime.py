"""A virtual clock for asyncio tests, and an in-memory SQS queue that runs on it.

:class:`VirtualClockLoop` is an event loop whose ``time()`` is virtual: when no callback is
ready and no file descriptor is readable, the clock jumps to the next timer instead of waiting
for it.  Code that waits with ``asyncio.sleep``, ``wait_for`` or ``call_later`` (the consumer's
visibility extensions, retries and backoff) then runs in no wall-clock time, in the same order
as on a real clock, and a test of "every visibility/3 seconds" does not depend on how busy the
machine is.  Only for tests whose collaborators live in the process: a thread or a socket would
see the clock jump.

:class:`MemoryQueue` is the :class:`resilienced.ports.Queue` of the consumer, in memory, on the
loop's clock, with the semantics the consumer relies on (Amazon SQS Developer Guide, "Amazon
SQS visibility timeout" and "Using dead-letter queues"; moto 5.2.5 ``moto/sqs/models.py``
behaves the same): a received message is invisible for the visibility timeout given at receive,
``ChangeMessageVisibility`` restarts that timeout from now (0: visible at once), every receive
counts (``ApproximateReceiveCount``), and with a redrive policy a message that was received
``maxReceiveCount`` times moves to the DLQ when it would be received once more.  A long poll
(``wait_seconds``) returns as soon as a message is visible.
``tests/intake/test_memory_queue.py`` holds it against moto's SQS over HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
from dataclasses import dataclass, field
from typing import Any

from resilienced.errors import BackendUnavailable
from resilienced.ports import Message

#: Times closer than this are the same time (a virtual clock summed from floats is off by ulps).
_EPS = 1e-6


class _JumpingSelector(selectors.DefaultSelector):
    """``select(timeout)``: what is ready now; nothing ready: the loop's clock jumps ``timeout``."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only another thread or a descriptor can wake us
            return super().select(None)
        assert self.loop is not None
        self.loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that jumps to the next timer when idle."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


class VirtualClockPolicy(asyncio.DefaultEventLoopPolicy):
    """For pytest-asyncio's ``event_loop_policy`` fixture: every test loop is virtual."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return VirtualClockLoop()


@dataclass
class _Stored:
    message_id: str
    body: str
    sent_at: float
    receive_count: int = 0
    visible_at: float = 0.0
    receipt: str = ""


@dataclass
class MemoryQueue:
    """An SQS queue (and its DLQ) in memory; see the module docstring."""

    max_receives: int | None = 3  # the redrive policy's maxReceiveCount; None: no DLQ
    messages: dict[str, _Stored] = field(default_factory=dict)
    dead: list[_Stored] = field(default_factory=list)
    receives: int = 0  # ReceiveMessage calls
    fail_receives: int = 0  # the next N receives raise BackendUnavailable (an SQS outage)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def send(self, body: str) -> str:
        message_id = f"m-{next(self._ids)}"
        self.messages[message_id] = _Stored(message_id, body, sent_at=0.0)
        self._arrived.set()
        return message_id

    def counts(self, now: float) -> tuple[int, int]:
        """(visible, in flight) at ``now``, as ``ApproximateNumberOfMessages[NotVisible]``."""
        visible = sum(1 for m in self.messages.values() if m.visible_at <= now + _EPS)
        return visible, len(self.messages) - visible

    # ------------------------------------------------------------------ ports.Queue
    async def receive(self, *, max_messages: int, wait_seconds: int, visibility_timeout: int) -> list[Message]:
        self.receives += 1
        if self.fail_receives:
            self.fail_receives -= 1
            raise BackendUnavailable("sqs", "ReceiveMessage: ServiceUnavailable (the test's outage)")
        end = self._now() + wait_seconds
        while True:
            got = self._take(max_messages, visibility_timeout)
            left = end - self._now()
            if got or left <= _EPS:
                return got
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(left, self._next_visible() or left))
            except TimeoutError:
                pass

    def _next_visible(self) -> float | None:
        now = self._now()
        later = [m.visible_at - now for m in self.messages.values() if m.visible_at > now + _EPS]
        return min(later) if later else None

    def _take(self, count: int, visibility_timeout: int) -> list[Message]:
        now, taken = self._now(), []
        for stored in sorted(self.messages.values(), key=lambda m: m.message_id):
            if len(taken) == count:
                break
            if stored.visible_at > now + _EPS:
                continue
            if self.max_receives is not None and stored.receive_count >= self.max_receives:
                del self.messages[stored.message_id]  # the redrive policy moves it on this receive
                self.dead.append(stored)
                continue
            stored.receive_count += 1
            stored.visible_at = now + visibility_timeout
            stored.receipt = f"{stored.message_id}/{stored.receive_count}"
            taken.append(Message(message_id=stored.message_id, receipt_handle=stored.receipt,
                                 body=stored.body, receive_count=stored.receive_count))
        return taken

    def _current(self, message: Message) -> _Stored | None:
        stored = self.messages.get(message.message_id)
        return stored if stored is not None and stored.receipt == message.receipt_handle else None

    async def delete(self, message: Message) -> None:
        if self._current(message) is not None:
            del self.messages[message.message_id]

    async def change_visibility(self, message: Message, *, seconds: int) -> None:
        stored = self._current(message)
        if stored is None:
            raise BackendUnavailable("sqs", f"ChangeMessageVisibility: {message.message_id}: "
                                            "ReceiptHandleIsInvalid (received again since)")
        stored.visible_at = self._now() + seconds
        if seconds == 0:
            self._arrived.set()

    async def max_receive_count(self) -> int | None:
        return self.max_receives

    async def ping(self) -> None:
        return None
