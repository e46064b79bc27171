"""One retry policy: an exponential backoff, capped, optionally jittered, reset after progress.

The daemon retries in four places; each takes its waits from :class:`Backoff`:

========================  =====================================================================
consumer (receive loop)   ``Backoff(1, maximum=30)``: 1, 2, 4, 8, 16, 30, 30 ... s after each
                          failed receive; reset by a receive that answers
kube/cache.py (informer)  ``Backoff(backoff_initial_s, maximum=backoff_max_s, jitter=0.25)``
                          after each failed list or watch; reset by a list, or a watch that
                          delivered something
ops/notify.py (webhook)   ``attempts(retries + 1, backoff=Backoff(backoff_s))``: 0.5, 1 s
                          between the attempts of one notification
kube/leases.py (complete) ``attempts(5)``: a 409 means another writer changed the Lease, the
                          next read sees its write, so it reads again at once (no wait)
========================  =====================================================================

The consumer and the informer are loops that run for the daemon's life, back off while their
backend fails and start from the first wait again once it answers; they ask :meth:`Backoff.next`
for the wait and sleep themselves (the consumer's sleep ends early on stop, the informer logs the
wait first).  The webhook and the Lease update try a bounded number of times: :func:`attempts`.

Why a module of ours and not tenacity or stamina (docs/architecture.md, "Retries"): both retry
one call until it succeeds or its attempts run out, which is the shape of two of the four; the
receive loop and the informer never give up and reset on progress, which they model only by
wrapping the whole loop body.  stamina also counts and logs every retry itself when
prometheus-client and structlog are installed (both are, here): a new metric
(``stamina_retries_total``) and a new log line, where the daemon's metrics and log lines are a
contract.  Forty lines here keep the waits the tests pin (tests/intake/timing/test_consumer.py,
tests/kube/test_cache.py, tests/recovery/test_operations.py) and add no dependency.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

#: Past this many doublings every wait is the cap (2**64 times any initial wait exceeds any cap),
#: so a backend failing for days never overflows the float (2.0**1100 does).
_MAX_DOUBLINGS = 64


@dataclass
class Backoff:
    """The wait after the n-th failure in a row: ``min(maximum, initial * 2**(n-1))``, times a
    uniform factor in ``[1 - jitter, 1 + jitter]``; :meth:`reset` after a success."""

    initial: float
    maximum: float = math.inf
    jitter: float = 0.0
    failures: int = 0

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0:
            raise ValueError(f"backoff: initial={self.initial} and maximum={self.maximum} must be >= 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff: jitter={self.jitter} must be in [0, 1)")

    def next(self) -> float:
        """Count one more failure; the seconds to wait before the next attempt."""
        self.failures += 1
        base = min(self.maximum, self.initial * 2.0 ** min(self.failures - 1, _MAX_DOUBLINGS))
        if self.jitter:
            return base * random.uniform(1 - self.jitter, 1 + self.jitter)
        return base

    def reset(self) -> None:
        """The backend answered: the next failure waits ``initial`` again."""
        self.failures = 0


async def attempts(count: int, *, backoff: Backoff | None = None) -> AsyncIterator[int]:
    """Attempt numbers ``0 .. count-1``; before each one but the first, waits ``backoff.next()``
    (at once without a backoff).  The caller breaks out on success or on an error that a retry
    cannot help; after the last one it gives up."""
    if count < 1:
        raise ValueError(f"attempts: count={count} must be at least 1")
    for attempt in range(count):
        if attempt and backoff is not None:
            await asyncio.sleep(backoff.next())
        yield attempt
