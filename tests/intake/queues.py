"""Queues on moto for tests: a main queue with a redrive policy to a DLQ, seen through boto3."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import boto3

from resilienced.local.aws import MotoServer

REGION = "us-east-1"
MAX_RECEIVE_COUNT = 3


@dataclass
class Queues:
    """A main queue with a redrive policy to a DLQ, and a boto3 client to look at them."""

    sqs: Any
    url: str
    arn: str
    dlq_url: str
    endpoint_url: str

    def send(self, body: str | dict) -> str:
        text = body if isinstance(body, str) else json.dumps(body)
        return self.sqs.send_message(QueueUrl=self.url, MessageBody=text)["MessageId"]

    def counts(self, url: str | None = None) -> tuple[int, int]:
        """(visible, in flight) as SQS reports them."""
        attributes = self.sqs.get_queue_attributes(QueueUrl=url or self.url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]), int(
            attributes["ApproximateNumberOfMessagesNotVisible"])

    def receive_all(self, url: str | None = None, *, wait: int = 1) -> list[dict]:
        """Every message visible now (received with a long visibility so each comes once)."""
        found: dict[str, dict] = {}
        while True:
            batch = self.sqs.receive_message(QueueUrl=url or self.url, MaxNumberOfMessages=10,
                                             WaitTimeSeconds=wait, VisibilityTimeout=300,
                                             MessageSystemAttributeNames=["ApproximateReceiveCount"]
                                             ).get("Messages", [])
            if not batch:
                return list(found.values())
            found.update((m["MessageId"], m) for m in batch)


def make_queues(aws: MotoServer, *, name: str = "interruptions", dlq: bool = True,
                visibility: int = 30) -> Queues:
    sqs = boto3.client("sqs", region_name=REGION, endpoint_url=aws.endpoint_url)
    attributes = {"VisibilityTimeout": str(visibility)}
    dlq_url = ""
    if dlq:
        dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attributes["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": dlq_arn,
                                                  "maxReceiveCount": str(MAX_RECEIVE_COUNT)})
    url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return Queues(sqs=sqs, url=url, arn=arn, dlq_url=dlq_url, endpoint_url=aws.endpoint_url)
