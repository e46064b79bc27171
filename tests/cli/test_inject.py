"""``resilienced inject``: events onto a queue or through an event bus (moto over HTTP)."""

from __future__ import annotations

import json

import boto3

from resilienced.app import cli
from resilienced.local import demo
from resilienced.model import Kind
from tests.intake import payloads as p
from tests.intake.queues import REGION, make_queues
import pytest

pytestmark = pytest.mark.integration

SAMPLES = dict(demo.samples())


def sample_file(tmp_path, name: str):
    path = tmp_path / name.replace("/", "_")
    path.write_bytes(SAMPLES[name])
    return str(path)


def test_queue_url_sends_each_file_verbatim(aws, tmp_path, capsys):
    queues = make_queues(aws)
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("not an event")
    files = [sample_file(tmp_path, "nth/nth-asg-terminate-lifecycle-direct-sqs.json"), str(garbage)]
    code = cli.main(["inject", "--queue-url", queues.url, "--endpoint-url", aws.endpoint_url,
                     "--region", REGION, *files])
    assert code == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    bodies = sorted(m["Body"] for m in queues.receive_all())
    assert bodies == sorted([SAMPLES["nth/nth-asg-terminate-lifecycle-direct-sqs.json"].decode(), "not an event"])


def test_event_bus_puts_events_that_rules_route_to_the_queue(aws, tmp_path, capsys):
    queues = make_queues(aws)
    events = boto3.client("events", region_name=REGION, endpoint_url=aws.endpoint_url)
    events.put_rule(Name="spot", EventPattern=json.dumps(
        {"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]}))
    events.put_targets(Rule="spot", Targets=[{"Id": "q", "Arn": queues.arn}])
    code = cli.main(["inject", "--event-bus", "default", "--endpoint-url", aws.endpoint_url, "--region", REGION,
                     sample_file(tmp_path, "nth/nth-spot-itn.json"),
                     sample_file(tmp_path, "nth/nth-rebalance-recommendation.json")])  # no rule: dropped
    assert code == 0
    [message] = queues.receive_all()
    event = json.loads(message["Body"])
    assert event["detail-type"] == "EC2 Spot Instance Interruption Warning"
    assert event["detail"] == {"instance-id": "i-0b662ef9931388ba0", "instance-action": "terminate"}
    assert event["time"] == "1970-01-01T00:00:00Z"
    assert event["id"] == capsys.readouterr().out.splitlines()[0].split("\t")[1]


def test_fresh_gives_a_new_id_and_the_current_time(aws, tmp_path):
    queues = make_queues(aws)
    assert cli.main(["inject", "--queue-url", queues.url, "--endpoint-url", aws.endpoint_url, "--region",
                     REGION, "--fresh", sample_file(tmp_path, "nth/nth-spot-itn.json")]) == 0
    event = json.loads(queues.receive_all()[0]["Body"])
    assert event["id"] != "1e5527d7-bb36-4607-3370-4164db56a40e"
    assert not event["time"].startswith("1970")


def test_event_bus_refuses_a_file_that_is_not_an_eventbridge_event_and_sends_nothing(aws, tmp_path, capsys):
    queues = make_queues(aws)
    good = sample_file(tmp_path, "nth/nth-spot-itn.json")
    for bad_name in ("karpenter/karpenter-unparseable-message.json",
                     "nth/nth-asg-terminate-lifecycle-direct-sqs.json"):
        bad = sample_file(tmp_path, bad_name)
        code = cli.main(["inject", "--event-bus", "default", "--endpoint-url", aws.endpoint_url,
                         "--region", REGION, good, bad])
        err = capsys.readouterr().err
        assert code == 2
        assert f"resilienced: error: {bad}: not an EventBridge event" in err
    assert queues.counts() == (0, 0)
    text = tmp_path / "text.json"
    text.write_text("hello")
    assert cli.main(["inject", "--event-bus", "default", "--region", REGION, str(text)]) == 2
    assert "not an EventBridge event: body: not JSON" in capsys.readouterr().err


def test_a_placeholder_time_asks_for_fresh(aws, tmp_path, capsys):
    path = sample_file(tmp_path, "aws-docs/ec2-spot-instance-interruption-warning.json")
    assert cli.main(["inject", "--event-bus", "default", "--endpoint-url", aws.endpoint_url,
                     "--region", REGION, path]) == 2
    assert "pass --fresh" in capsys.readouterr().err


def test_inject_needs_exactly_one_target(capsys):
    for args in (["inject", "x.json"], ["inject", "--queue-url", "http://q", "--event-bus", "b", "x.json"]):
        try:
            cli.main(args)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError("argparse accepted " + " ".join(args))


def test_injected_events_are_what_the_daemon_reads(aws, tmp_path):
    from resilienced.intake import pipeline as intake
    from resilienced.settings import IntakeSettings
    queues = make_queues(aws)
    events = boto3.client("events", region_name=REGION, endpoint_url=aws.endpoint_url)
    events.put_rule(Name="asg", EventPattern=json.dumps({"source": ["aws.autoscaling"]}))
    events.put_targets(Rule="asg", Targets=[{"Id": "q", "Arn": queues.arn}])
    cli.main(["inject", "--event-bus", "default", "--endpoint-url", aws.endpoint_url, "--region", REGION,
              sample_file(tmp_path, "nth/nth-asg-terminate-lifecycle-eventbridge.json")])
    [message] = queues.receive_all()
    plan = intake.read(message["Body"], IntakeSettings()).plan
    assert plan.event.kind is Kind.ASG_LIFECYCLE and plan.actionable
    assert plan.instance_ids == ("i-0633ac2b0d9769723",)
    assert p.ACCOUNT  # payload helpers shared with the intake tests
