"""Intake: decode, validate, parse, plan, the ack policy, claims, the SQS consumer and daemon."""
