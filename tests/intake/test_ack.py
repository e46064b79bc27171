"""The ack policy as a table: every handling result maps to one verdict."""

from __future__ import annotations

import pytest

from resilienced.intake import ack_policy
from resilienced.intake.ack_policy import DeadLetterAction
from resilienced.model import Outcome, Result, Verdict

pytestmark = pytest.mark.unit

VERDICTS = [
    (Result.DONE, Verdict.DELETE),
    (Result.DUPLICATE, Verdict.DELETE),
    (Result.NOT_ACTIONABLE, Verdict.DELETE),
    (Result.FAILED, Verdict.DELETE),
    (Result.RETRY, Verdict.KEEP),
    (Result.UNDECODABLE, Verdict.DEAD_LETTER),
    (Result.INVALID, Verdict.DEAD_LETTER),
]


@pytest.mark.parametrize("result, expected", VERDICTS, ids=[r.value for r, _ in VERDICTS])
def test_verdict(result, expected):
    assert ack_policy.verdict(Outcome(result=result, event=None)) is expected


def test_the_table_covers_every_result():
    assert {result for result, _ in VERDICTS} == set(Result)


DEAD_LETTER = [
    ("first-receive-with-dlq", 1, 3, DeadLetterAction.RELEASE),
    ("second-receive-with-dlq", 2, 3, DeadLetterAction.RELEASE),
    ("last-receive-with-dlq", 3, 3, DeadLetterAction.RELEASE_LAST),
    ("past-max-with-dlq", 4, 3, DeadLetterAction.RELEASE_LAST),
    ("no-dlq-early", 1, None, DeadLetterAction.RELEASE),
    ("no-dlq-at-limit", 5, None, DeadLetterAction.DELETE),
    ("no-dlq-past-limit", 9, None, DeadLetterAction.DELETE),
]


@pytest.mark.parametrize("receive_count, max_receive_count, expected", [d[1:] for d in DEAD_LETTER],
                         ids=[d[0] for d in DEAD_LETTER])
def test_dead_letter_action(receive_count, max_receive_count, expected):
    assert ack_policy.dead_letter_action(receive_count=receive_count, max_receive_count=max_receive_count,
                                  max_receives_without_dlq=5) is expected


@pytest.mark.parametrize("suggested, receive_count, expected", [
    (None, 1, 60.0), (None, 2, 120.0), (None, 4, 480.0), (None, 5, 900.0),  # capped
    (5.0, 1, 5.0), (5.0, 3, 20.0), (0.0, 2, 120.0), (None, 30, 900.0),
])
def test_a_backend_failure_backs_off_with_the_receive_count(suggested, receive_count, expected):
    assert ack_policy.backend_retry_delay(suggested=suggested, visibility_timeout=60.0,
                                   receive_count=receive_count) == expected
