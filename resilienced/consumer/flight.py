"""One message being handled (:class:`Flight`), and the name this replica holds claims under."""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass

from resilienced.ports import Message


def replica_name() -> str:
    """This process's name in claims: the pod name (HOSTNAME) or host, pid, and a nonce."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class Flight:
    """One message being handled: ``holder`` is its name in the event claim (replica/message id)."""

    message: Message
    holder: str
    received_at: float
    received_unix: float = 0.0  # wall clock, to age the event against its ``time``
    settling: bool = False

    @classmethod
    def of(cls, message: Message, *, replica: str) -> Flight:
        return cls(message=message, holder=f"{replica}/{message.message_id}",
                   received_at=time.monotonic(), received_unix=time.time())
