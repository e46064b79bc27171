"""The ack policy: what happens to an SQS message once it has been handled.

:func:`verdict` is the one place that decides delete / keep / dead-letter, as a pure function
of the handling :class:`~resilienced.model.Outcome`:

==============================================  ===========  =================================
result                                          verdict      why
==============================================  ===========  =================================
DONE, DUPLICATE, NOT_ACTIONABLE, FAILED         DELETE       done, or nothing (more) to do
RETRY                                           KEEP         may succeed later: redelivered
                                                             (after ``retry_delay`` when given;
                                                             a backend's failure: after
                                                             :func:`backend_retry_delay`)
UNDECODABLE, INVALID                            DEAD_LETTER  poison: the queue's DLQ keeps it
==============================================  ===========  =================================

DEAD_LETTER does not delete: the message's visibility is set to 0 so it is received again at
once, until the queue's redrive policy (``maxReceiveCount``) moves it to the DLQ, where an
operator can read it.  Without a DLQ (``--allow-no-dlq``) :func:`dead_letter_action` deletes
it, with an error log, once it has been received ``max_receives_without_dlq`` times, so it
neither loops forever nor vanishes unlogged.
"""

from __future__ import annotations

import enum

from resilienced.model import Outcome, Result, Verdict

_VERDICTS: dict[Result, Verdict] = {
    Result.DONE: Verdict.DELETE,
    Result.DUPLICATE: Verdict.DELETE,
    Result.NOT_ACTIONABLE: Verdict.DELETE,
    Result.FAILED: Verdict.DELETE,
    Result.RETRY: Verdict.KEEP,
    Result.UNDECODABLE: Verdict.DEAD_LETTER,
    Result.INVALID: Verdict.DEAD_LETTER,
}


def verdict(outcome: Outcome) -> Verdict:
    """Delete, keep or dead-letter the message whose handling ended with ``outcome``."""
    return _VERDICTS[outcome.result]


class DeadLetterAction(str, enum.Enum):
    """How a DEAD_LETTER verdict is carried out for one receive of the message."""

    RELEASE = "release"  # visibility 0: received again until the redrive policy moves it
    RELEASE_LAST = "release_last"  # as RELEASE; this was the last receive before the DLQ
    DELETE = "delete"  # no DLQ, and received often enough: delete with an error log


def dead_letter_action(*, receive_count: int, max_receive_count: int | None,
                       max_receives_without_dlq: int) -> DeadLetterAction:
    """Carry out DEAD_LETTER given the queue's redrive policy (None: no DLQ)."""
    if max_receive_count is None:
        if receive_count >= max_receives_without_dlq:
            return DeadLetterAction.DELETE
        return DeadLetterAction.RELEASE
    if receive_count >= max_receive_count:
        return DeadLetterAction.RELEASE_LAST
    return DeadLetterAction.RELEASE


#: The longest a message waits for its next receive after a backend failed (seconds).
MAX_BACKOFF_S = 900.0


def backend_retry_delay(*, suggested: float | None, visibility_timeout: float, receive_count: int) -> float:
    """Seconds until the next receive of a message whose handling failed on a backend.

    Bounded exponential backoff by the message's receive count: the backend's own suggestion
    (a claim store or API's retry delay), or the visibility timeout when it gave none, doubled
    for each receive after the first, at most :data:`MAX_BACKOFF_S`. Each receive counts
    towards the queue's redrive policy, so a fixed delay would dead-letter a valid notice after
    ``maxReceiveCount`` short retries (the reliability campaign's GCS outage: 4 receives in
    16 s); doubling widens the window an outage may last to about 15 times the base for 5
    receives (15 min with the 60 s default), a Health event's days-ahead notice included.
    """
    base = suggested if suggested is not None and suggested > 0 else visibility_timeout
    return min(MAX_BACKOFF_S, base * 2 ** max(0, receive_count - 1))
