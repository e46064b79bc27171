"""The campaign's own reading of the DLQ (tests/chaos/world.py), against moto over HTTP."""

from __future__ import annotations

import uuid

import botocore.session
import pytest

from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from tests.chaos.world import read_dead_letters

pytestmark = pytest.mark.integration


def test_a_dead_letter_still_hidden_by_the_receive_that_raced_its_redrive_is_read(moto_server: MotoServer) -> None:
    """moto's redrive can move a message to the DLQ while another receive has just taken it (the
    flood scenario's "bad messages not in the DLQ", seen once under load): the message is in the
    DLQ, hidden for that receive's visibility timeout, and a read that stopped at the first empty
    receive missed it.  Here the hidden one is made by receiving it from the DLQ with a 2 s
    visibility, as that receive would have."""
    keys = {"aws_access_key_id": FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
    sqs = botocore.session.get_session().create_client("sqs", region_name="us-east-1",
                                                       endpoint_url=moto_server.endpoint_url, **keys)
    dlq = sqs.create_queue(QueueName=f"dlq-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    for body in ("seen", "hidden"):
        sqs.send_message(QueueUrl=dlq, MessageBody=body)
    taken = sqs.receive_message(QueueUrl=dlq, MaxNumberOfMessages=1, VisibilityTimeout=2)["Messages"]
    assert len(taken) == 1

    dead = read_dead_letters(sqs, dlq, hidden_for_s=2)

    assert sorted(m["Body"] for m in dead) == ["hidden", "seen"]
    assert read_dead_letters(sqs, sqs.create_queue(QueueName=f"empty-{uuid.uuid4().hex[:8]}")["QueueUrl"],
                             hidden_for_s=2) == []
