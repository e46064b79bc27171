"""Bodies that are not events (undecodable) and events that break a rule (invalid): each says why."""

from __future__ import annotations

import json

import pytest

from resilienced.intake import pipeline as intake
from resilienced.model import Kind
from resilienced.settings import IntakeSettings

from . import payloads as p

pytestmark = pytest.mark.unit


def read(body, settings: IntakeSettings | None = None):
    return intake.read(body, settings or IntakeSettings())


UNDECODABLE = [
    ("empty", "", "body: empty"),
    ("whitespace", " \n\t ", "body: empty"),
    ("empty-bytes", b"", "body: empty"),
    ("not-json", "hello", "body: not JSON"),
    ("truncated-json", '{"source": "aws.ec2"', "body: not JSON"),
    ("not-utf8", b'{"source": "\xff\xfe"}', "body: not UTF-8"),
    ("utf8-bom-bytes", b"\xef\xbb\xbf{}", "body: not JSON"),
    ("array", "[1, 2]", "body: a JSON array, expected an object"),
    ("string", '"an event"', "body: a JSON string"),
    ("number", "42", "body: a JSON number"),
    ("null", "null", "body: a JSON null"),
    ("nested-50000-arrays", "[" * 50_000 + "]" * 50_000, "nested deeper than"),
    ("nested-50000-objects", '{"":' * 50_000 + "1" + "}" * 50_000, "nested deeper than"),
    ("nested-100-in-detail", json.dumps({"detail": json.loads("[" * 100 + "]" * 100)}), "nested deeper than 64"),
    ("too-big", json.dumps({"pad": "x" * 300_000}), "more than the 262144"),
    ("huge-integer", '{"n": ' + "9" * 5000 + "}", "body: not JSON"),
    ("sns-message-not-a-string", json.dumps({"Type": "Notification", "Message": {"a": 1}}),
     "Message: expected a string"),
    ("sns-message-not-json", json.dumps({"Type": "Notification", "Message": "hello"}), "Message: not JSON"),
    ("sns-message-array", json.dumps({"Type": "Notification", "Message": "[]"}), "Message: a JSON array"),
    ("not-text-at-all", 12345, "body: expected text or bytes"),
]


@pytest.mark.parametrize("body, reason", [u[1:] for u in UNDECODABLE], ids=[u[0] for u in UNDECODABLE])
def test_undecodable_bodies_are_invalid_with_a_reason_and_not_decoded(body, reason):
    reading = read(body)
    assert not reading.decoded
    assert reading.event.kind is Kind.INVALID
    assert not reading.plan.actionable
    assert reason in reading.plan.reason


INVALID = [
    ("custom-source", p.spot(source="custom.chaos"), "source: 'custom.chaos' is not an AWS source"),
    ("no-source-no-detail-type", {"field1": "value1"}, "source: missing"),
    ("docs-detail_type-spelling", {"detail_type": "Capacity Block Reservation Expiration Warning",
                                   "source": "aws.ec2", "detail": {}}, "detail-type: missing; the body has 'detail_type'"),
    ("no-id", p.spot(id=p.DROP), "id: missing"),
    ("empty-id", p.spot(id=""), "id: empty"),
    ("id-not-a-string", p.spot(id=7), "id: expected a string"),
    # found by the reliability campaign's forged input (tests/chaos/flood.py): an id is an identifier
    ("id-path-and-newline", p.spot(id='../../2\n{"x":1}'), "id: '../../2\\n{\"x\":1}' is not an event id"),
    ("id-with-space", p.spot(id="a b"), "id: 'a b' is not an event id"),
    ("id-too-long", p.spot(id="a" * 257), "is not an event id"),
    ("source-not-a-string", p.spot(source=["aws.ec2"]), "source: expected a string"),
    ("no-time", p.spot(time=p.DROP), "time: missing"),
    ("time-placeholder", p.spot(time="yyyy-mm-ddThh:mm:ssZ"), "time: 'yyyy-mm-ddThh:mm:ssZ' is not an ISO-8601 time"),
    ("time-without-zone", p.spot(time="2024-01-01T00:00:00"), "time: '2024-01-01T00:00:00' has no time zone"),
    ("time-rfc1123-outside-health", p.spot(time="Sat, 05 Jun 2016 15:10:09 GMT"), "time:"),
    ("time-number", p.spot(time=1704067200), "time: expected a string"),
    ("account-placeholder", p.spot(account="[Customer Account ID]"), "account: '[Customer Account ID]' is not a 12-digit"),
    ("region-placeholder", p.spot(region="[region]"), "region: '[region]' is not an AWS region"),
    ("resources-a-string", p.spot(resources="[instance arn]"), "resources: expected a list of strings"),
    ("detail-missing", p.spot(detail=None) | {"detail": None}, "detail: missing"),
    ("detail-a-list", p.spot() | {"detail": []}, "detail: expected an object"),
    ("instance-id-10-hex", p.spot("i-0123456789"), "detail.instance-id: 'i-0123456789' is not an EC2 instance id"),
    ("instance-id-upper-hex", p.spot("i-0123456789ABCDEF0"), "detail.instance-id:"),
    ("instance-id-placeholder", p.spot("[instance-id]"), "detail.instance-id:"),
    ("instance-id-missing", p.spot(detail={"instance-id": p.DROP}), "detail.instance-id: missing"),
    ("instance-id-number", p.spot(detail={"instance-id": 12345678}), "detail.instance-id: expected a string"),
    ("spot-action-placeholder", p.spot(detail={"instance-action": "action"}), "detail.instance-action: 'action' is not one of"),
    ("termination-time-placeholder", p.reservation_interruption(detail={"instance-termination-time": "yyyy-mm-ddThh:mm:ssZ"}),
     "detail.instance-termination-time:"),
    ("reservation-id-bad", p.block_expiry("cr-1234567890abcdefg"), "detail.capacity-reservation-id: 'cr-1234567890abcdefg'"),
    ("end-date-missing", p.block_expiry(detail={"end-date": p.DROP}), "detail.end-date: missing"),
    ("health-start-empty", p.health(start=""), "detail.startTime: empty"),
    ("health-start-garbage", p.health(start="soon"), "detail.startTime: 'soon' is neither an RFC 1123 nor an ISO-8601"),
    ("health-bad-instance", p.health(("i-xyz",)), "detail.affectedEntities[0].entityValue: 'i-xyz'"),
    ("health-entities-not-a-list", p.health(detail={"affectedEntities": "i-0123456789abcdef0"}), "detail.affectedEntities: expected a list"),
    ("state-missing", p.state_change(detail={"state": p.DROP}), "detail.state: missing"),
    ("asg-token-missing", p.asg(detail={"LifecycleActionToken": p.DROP}), "detail.LifecycleActionToken: missing"),
    ("asg-direct-bad-instance", p.asg_direct("i-1"), "EC2InstanceId: 'i-1'"),
    ("asg-direct-no-request-id", p.asg_direct(RequestId=p.DROP, LifecycleActionToken=p.DROP), "RequestId: missing"),
    ("time-at-the-end-of-the-calendar", p.spot(time="9999-12-31T23:59:00Z"), "time: 9999-12-31T23:59:00+00:00 is too close"),
    ("end-date-at-the-start-of-the-calendar", p.block_expiry(end="0001-01-01T00:10:00Z"), "detail.end-date:"),
    ("sns-wrapped-custom-source", p.sns(p.spot(source="custom.x")), "source: 'custom.x'"),
]


@pytest.mark.parametrize("payload, reason", [i[1:] for i in INVALID], ids=[i[0] for i in INVALID])
def test_events_that_break_a_rule_are_invalid_and_the_reason_names_the_field(payload, reason):
    reading = read(p.body(payload))
    assert reading.decoded
    assert reading.event.kind is Kind.INVALID
    assert not reading.plan.actionable
    assert reason in reading.plan.reason, reading.plan.reason


def test_an_invalid_event_keeps_its_id_for_the_log():
    reading = read(p.body(p.spot("i-bad", id="e-1")))
    assert reading.event.event_id == "e-1"
    assert reading.event.source == "aws.ec2"


ALLOW_LISTS = [
    ("account-allowed", p.spot(), {"allowed_accounts": (p.ACCOUNT,)}, None),
    ("account-not-allowed", p.spot(account="210987654321"), {"allowed_accounts": (p.ACCOUNT,)},
     "account: 210987654321 is not in the allowed accounts"),
    ("account-missing-with-list", p.spot(account=p.DROP), {"allowed_accounts": (p.ACCOUNT,)},
     "account: missing, and an account allow-list is set"),
    ("account-missing-without-list", p.spot(account=p.DROP), {}, None),
    ("region-allowed", p.spot(), {"allowed_regions": ("us-east-1",)}, None),
    ("region-not-allowed", p.spot(region="eu-west-1"), {"allowed_regions": ("us-east-1",)},
     "region: eu-west-1 is not in the allowed regions"),
    ("region-missing-with-list", p.spot(region=p.DROP), {"allowed_regions": ("us-east-1",)},
     "region: missing, and a region allow-list is set"),
    ("asg-direct-account-checked", p.asg_direct(AccountId="210987654321"), {"allowed_accounts": (p.ACCOUNT,)},
     "AccountId: 210987654321 is not in the allowed accounts"),
]


@pytest.mark.parametrize("payload, settings, reason", [a[1:] for a in ALLOW_LISTS], ids=[a[0] for a in ALLOW_LISTS])
def test_allow_lists_of_accounts_and_regions(payload, settings, reason):
    reading = read(p.body(payload), IntakeSettings(**settings))
    if reason is None:
        assert reading.plan.actionable, reading.plan.reason
    else:
        assert reading.event.kind is Kind.INVALID
        assert reason in reading.plan.reason
