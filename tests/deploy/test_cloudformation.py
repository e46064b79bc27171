"""deploy/aws: cfn-lint is clean, the stack is what the daemon reads (one rule per handler,
nothing else), and on moto server the stack deploys and the daemon, pointed at the queue the
stack made, decides on every event that matched a rule -- and never sees one that did not.

moto does not model ``AWS::SQS::QueuePolicy`` (it warns and skips it), so the policy is checked
statically here; everything else is the deployed stack over HTTP.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest

from handlers import registry
from handlers import asg_lifecycle, scheduled_change, state_change
from resilienced.aws.sqs import SqsQueue
from resilienced.capacity.ec2 import PURCHASE_KEY_TAG
from resilienced.capacity.policy import CapacityPolicy
from resilienced.doubles import MemoryClaims
from resilienced.consumer.loop import Consumer
from resilienced.local.aws import MotoServer
from resilienced.model import Kind, Result, Verdict
from resilienced.ops.permissions import IAM_ACTIONS
from resilienced.recovery.plan_only import PlanLogger
from resilienced.settings import IntakeSettings, QueueSettings

from .tools import STACK, TEMPLATES, dumps, load_template, run, tool

pytestmark = pytest.mark.integration

REGION = "us-east-1"
PARAMETERS = {
    "CheckpointBucket": "ckpt-bucket",
    "CheckpointPrefix": "runs/",
    "FsxFileSystemId": "fs-0123456789abcdef0",
    "OidcIssuer": "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE",
    "MaxReceiveCount": "4",
}
INSTANCE = "i-0123456789abcdef0"


def _rules(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in template["Resources"].items() if r["Type"] == "AWS::Events::Rule"}


# ---------------------------------------------------------------- static
def test_cfn_lint_is_clean() -> None:
    done = run([tool("cfn-lint"), *map(str, TEMPLATES)], timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_rule_per_handler_and_only_what_the_handler_acts_on() -> None:
    rules = _rules(load_template(STACK))
    by_module: dict[str, list[str]] = {}
    for name, rule in rules.items():
        pattern = rule["Properties"]["EventPattern"]
        (source,) = pattern["source"]
        modules = {registry.lookup(source, dt) for dt in pattern["detail-type"]}
        assert len(modules) == 1 and None not in modules, f"{name} matches no or several handlers"
        by_module.setdefault(modules.pop().__name__, []).append(name)
        target = rule["Properties"]["Targets"]
        assert target == [{"Id": "resilienced-queue", "Arn": {"Fn::GetAtt": ["Queue", "Arn"]}}]
        assert rule["Properties"]["State"] == "ENABLED"
    assert sorted(by_module) == sorted(m.__name__ for m in registry.MODULES)
    assert all(len(names) == 1 for names in by_module.values()), by_module
    # Every kind a handler produces has its rule (UNKNOWN/INVALID are verdicts, not kinds to route).
    assert {m.KIND for m in registry.MODULES} == set(Kind) - {Kind.UNKNOWN, Kind.INVALID}

    patterns = {registry.lookup(r["Properties"]["EventPattern"]["source"][0],
                                r["Properties"]["EventPattern"]["detail-type"][0]): r["Properties"]["EventPattern"]
                for r in rules.values()}
    # Narrowed to what the handler acts on, with the handler's own constants.
    assert set(patterns[state_change]["detail"]["state"]) == set(state_change.GOING)
    assert patterns[scheduled_change]["detail"] == {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]}
    assert patterns[asg_lifecycle]["detail-type"] == ["EC2 Instance-terminate Lifecycle Action"]
    for module, pattern in patterns.items():
        if module is not asg_lifecycle:
            assert sorted(pattern["detail-type"]) == sorted(module.DETAIL_TYPES), module.__name__


def test_queues_are_encrypted_and_the_queue_dead_letters() -> None:
    resources = load_template(STACK)["Resources"]
    for name in ("Queue", "DeadLetterQueue"):
        assert resources[name]["Properties"]["SqsManagedSseEnabled"] is True
    redrive = resources["Queue"]["Properties"]["RedrivePolicy"]
    assert redrive["deadLetterTargetArn"] == {"Fn::GetAtt": ["DeadLetterQueue", "Arn"]}


def test_the_queue_policy_lets_only_the_stacks_rules_send_and_denies_plain_http() -> None:
    template = load_template(STACK)
    rule_arns = sorted(({"Fn::GetAtt": [name, "Arn"]} for name in _rules(template)), key=json.dumps)
    policies = {tuple(json.dumps(q) for q in r["Properties"]["Queues"]): r["Properties"]["PolicyDocument"]
                for r in template["Resources"].values() if r["Type"] == "AWS::SQS::QueuePolicy"}
    queue = policies[(json.dumps({"Ref": "Queue"}),)]["Statement"]
    dlq = policies[(json.dumps({"Ref": "DeadLetterQueue"}),)]["Statement"]
    allow = [s for s in queue if s["Effect"] == "Allow"]
    assert len(allow) == 1
    assert allow[0]["Principal"] == {"Service": "events.amazonaws.com"}
    assert allow[0]["Action"] == "sqs:SendMessage"
    assert sorted(allow[0]["Condition"]["ArnEquals"]["aws:SourceArn"], key=json.dumps) == rule_arns
    deny_others = [s for s in queue if s["Effect"] == "Deny" and s["Action"] == "sqs:SendMessage"]
    assert len(deny_others) == 1 and deny_others[0]["Principal"] == "*"
    assert sorted(deny_others[0]["Condition"]["ArnNotEquals"]["aws:SourceArn"], key=json.dumps) == rule_arns
    for statements in (queue, dlq):
        (tls,) = [s for s in statements if s.get("Condition", {}).get("Bool")]
        assert (tls["Effect"], tls["Principal"], tls["Action"]) == ("Deny", "*", "sqs:*")
        assert tls["Condition"]["Bool"] == {"aws:SecureTransport": "false"}


# ---------------------------------------------------------------- on moto server
def _entry(detail_type: str, detail: dict[str, Any], source: str = "aws.ec2") -> dict[str, Any]:
    return {"Source": source, "DetailType": detail_type, "Detail": json.dumps(detail),
            "Resources": [f"arn:aws:ec2:{REGION}:123456789012:instance/{INSTANCE}"]}


def _soon(minutes: int) -> str:
    return (datetime.now(timezone.utc) + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def matching() -> dict[Kind, dict[str, Any]]:
    """One event per rule, each a kind's actionable form; made when the test sends them, since
    their deadlines are minutes from now (made at import, a test that ran 7 minutes after the
    collection on a loaded machine sent a deadline already past: stale, not acted on)."""
    return {
        Kind.SPOT_INTERRUPTION: _entry("EC2 Spot Instance Interruption Warning",
                                       {"instance-id": INSTANCE, "instance-action": "terminate"}),
        Kind.CAPACITY_RESERVATION_INTERRUPTION: _entry(
            "EC2 Capacity Reservation Instance Interruption Warning",
            {"instance-id": INSTANCE, "instance-action": "terminate", "instance-termination-time": _soon(2)}),
        Kind.CAPACITY_BLOCK_EXPIRY: _entry("Capacity Block Reservation Expiration Warning",
                                           {"capacity-reservation-id": "cr-0123456789abcdef0",
                                            "end-date": _soon(40)}),
        Kind.SCHEDULED_CHANGE: _entry("AWS Health Event", {
            "service": "EC2", "eventTypeCategory": "scheduledChange",
            "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
            "eventArn": "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/x",
            "startTime": "Sat, 05 Jun 2027 15:10:09 GMT",
            "affectedEntities": [{"entityValue": INSTANCE}]}, source="aws.health"),
        Kind.STATE_CHANGE: _entry("EC2 Instance State-change Notification",
                                  {"instance-id": INSTANCE, "state": "shutting-down"}),
        Kind.REBALANCE_RECOMMENDATION: _entry("EC2 Instance Rebalance Recommendation",
                                              {"instance-id": INSTANCE}),
        Kind.ASG_LIFECYCLE: _entry("EC2 Instance-terminate Lifecycle Action", {
            "LifecycleActionToken": "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6",
            "AutoScalingGroupName": "gpu-workers", "LifecycleHookName": "resilienced",
            "EC2InstanceId": INSTANCE, "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING"},
            source="aws.autoscaling"),
    }


#: Events of the same sources that no rule takes (the daemon would only drop them).
NOT_MATCHING = [
    _entry("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": "pending"}),
    _entry("AWS Health Event", {"service": "RDS", "eventTypeCategory": "scheduledChange",
                                "affectedEntities": []}, source="aws.health"),
    _entry("AWS Health Event", {"service": "EC2", "eventTypeCategory": "issue",
                                "affectedEntities": []}, source="aws.health"),
    _entry("EC2 Instance-launch Lifecycle Action", {
        "EC2InstanceId": INSTANCE, "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING"},
        source="aws.autoscaling"),
    _entry("Capacity Block Reservation Delivered", {"capacity-reservation-id": "cr-0123456789abcdef0",
                                                    "end-date": _soon(600)}),
]


@pytest.fixture
def stack(aws: MotoServer) -> dict[str, str]:
    """The stack deployed into a clean moto server; its outputs."""
    cfn = boto3.client("cloudformation", endpoint_url=aws.endpoint_url, region_name=REGION)
    cfn.create_stack(StackName="resilienced", TemplateBody=STACK.read_text(),
                     Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in PARAMETERS.items()],
                     Capabilities=["CAPABILITY_IAM"])
    (described,) = cfn.describe_stacks(StackName="resilienced")["Stacks"]
    assert described["StackStatus"] == "CREATE_COMPLETE", described.get("StackStatusReason")
    return {o["OutputKey"]: o["OutputValue"] for o in described["Outputs"]}


def test_the_stack_deploys_with_its_queue_dlq_rules_and_policy(aws: MotoServer, stack: dict[str, str]) -> None:
    sqs = boto3.client("sqs", endpoint_url=aws.endpoint_url, region_name=REGION)
    attributes = sqs.get_queue_attributes(QueueUrl=stack["QueueUrl"], AttributeNames=["All"])["Attributes"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=stack["DeadLetterQueueUrl"],
                                       AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    assert json.loads(attributes["RedrivePolicy"]) == {"deadLetterTargetArn": dlq_arn,
                                                       "maxReceiveCount": int(PARAMETERS["MaxReceiveCount"])}
    assert attributes["SqsManagedSseEnabled"] == "true"

    events = boto3.client("events", endpoint_url=aws.endpoint_url, region_name=REGION)
    rules = events.list_rules(NamePrefix="resilienced-")["Rules"]
    assert len(rules) == len(registry.MODULES)
    for rule in rules:
        (target,) = events.list_targets_by_rule(Rule=rule["Name"])["Targets"]
        assert target["Arn"] == stack["QueueArn"]

    iam = boto3.client("iam", endpoint_url=aws.endpoint_url, region_name=REGION)
    role_name = stack["RoleArn"].rpartition("/")[2]
    attached = {p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=role_name)["AttachedPolicies"]}
    # AllowCapacityBlockPurchase left "false": no buying; FsxFileSystemId given: export tasks.
    assert attached == {stack["PolicyArn"], stack["FsxExportTaskPolicyArn"]}
    assert "CapacityBlockPurchasePolicyArn" not in stack
    actions = set()
    for arn in attached:
        version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
        document = iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"]
        document = json.loads(document) if isinstance(document, str) else document
        actions |= {a for s in document["Statement"]
                    for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    # Ec2NodeProvider left "false": no instance is launched (ray mode's EC2 node provider is off)
    assert "Ec2NodeProviderPolicyArn" not in stack and "Ec2NodeRolePassPolicyArn" not in stack
    assert actions == set(IAM_ACTIONS) - {"ec2:DescribeCapacityBlockOfferings", "ec2:PurchaseCapacityBlock",
                                          "ec2:CreateTags", "ec2:RunInstances", "ec2:TerminateInstances",
                                          "iam:PassRole"}
    role = iam.get_role(RoleName=role_name)["Role"]
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    (statement,) = trust["Statement"]
    issuer = PARAMETERS["OidcIssuer"]
    assert statement["Condition"]["StringEquals"] == {
        f"{issuer}:sub": "system:serviceaccount:resilienced:resilienced", f"{issuer}:aud": "sts.amazonaws.com"}


def test_the_ec2_node_provider_policies_come_with_its_parameters(aws: MotoServer) -> None:
    """Ec2NodeProvider "true" and the nodes' role: the provider's two policies, attached to the role."""
    cfn = boto3.client("cloudformation", endpoint_url=aws.endpoint_url, region_name=REGION)
    node_role = "arn:aws:iam::123456789012:role/ray-nodes"
    parameters = {**PARAMETERS, "Ec2NodeProvider": "true", "Ec2NodeOwner": "ray-train-a", "Ec2NodeRoleArn": node_role}
    cfn.create_stack(StackName="resilienced-ec2", TemplateBody=STACK.read_text(), Capabilities=["CAPABILITY_IAM"],
                     Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()])
    (described,) = cfn.describe_stacks(StackName="resilienced-ec2")["Stacks"]
    assert described["StackStatus"] == "CREATE_COMPLETE", described.get("StackStatusReason")
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described["Outputs"]}
    iam = boto3.client("iam", endpoint_url=aws.endpoint_url, region_name=REGION)
    role_name = outputs["RoleArn"].rpartition("/")[2]
    attached = {p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=role_name)["AttachedPolicies"]}
    assert {outputs["Ec2NodeProviderPolicyArn"], outputs["Ec2NodeRolePassPolicyArn"]} <= attached
    statements = []
    for arn in (outputs["Ec2NodeProviderPolicyArn"], outputs["Ec2NodeRolePassPolicyArn"]):
        version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
        document = iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"]
        statements += (json.loads(document) if isinstance(document, str) else document)["Statement"]
    by_sid = {s["Sid"]: s for s in statements}
    assert by_sid["LaunchTaggedReplacements"]["Condition"] == {
        "StringEquals": {"aws:RequestTag/resilienced.io/launched-by": "ray-train-a"}}
    assert by_sid["TerminateOwnReplacementsOnly"]["Condition"] == {
        "StringEquals": {"ec2:ResourceTag/resilienced.io/launched-by": "ray-train-a"}}
    assert by_sid["PassTheNodeRoleToEc2"]["Resource"] == node_role


async def _one_pass_until_empty(aws: MotoServer, queue_url: str, *, passes: int = 5) -> list[tuple[Any, Verdict]]:
    """The daemon's own one pass (Consumer.run_once) on the stack's queue, until it is empty."""
    seen: list[tuple[Any, Verdict]] = []
    queue_settings = QueueSettings(queue_url=queue_url, region=REGION, endpoint_url=aws.endpoint_url,
                                   wait_seconds=1, visibility_timeout=30)
    intake_settings = IntakeSettings(allowed_regions=(REGION,))
    queue_settings.validate()
    intake_settings.validate()
    async with SqsQueue.open(queue_url=queue_url, region=REGION, endpoint_url=aws.endpoint_url) as queue:
        consumer = Consumer(queue=queue, responder=PlanLogger(), claims=MemoryClaims(),
                            queue_settings=queue_settings, intake_settings=intake_settings,
                            max_receive_count=await queue.max_receive_count(),
                            observer=lambda message, outcome, verdict, *_: seen.append((outcome, verdict)))
        for _ in range(passes):
            if not await consumer.run_once():
                break
    return seen


def test_the_daemon_on_the_stacks_queue_decides_every_event_a_rule_matched(
        aws: MotoServer, stack: dict[str, str]) -> None:
    events = boto3.client("events", endpoint_url=aws.endpoint_url, region_name=REGION)
    events_sent = matching()
    entries = list(events_sent.values()) + NOT_MATCHING
    put = events.put_events(Entries=entries[:10])
    put2 = events.put_events(Entries=entries[10:])
    assert put["FailedEntryCount"] == put2["FailedEntryCount"] == 0
    sent = dict(zip((e["EventId"] for e in put["Entries"] + put2["Entries"]),
                    list(events_sent) + [None] * len(NOT_MATCHING), strict=True))

    decided = asyncio.run(_one_pass_until_empty(aws, stack["QueueUrl"]))

    by_id = {outcome.event.event_id: (outcome, verdict) for outcome, verdict in decided}
    assert len(decided) == len(events_sent), dumps([o.event for o, _ in decided])
    for event_id, kind in sent.items():
        if kind is None:
            assert event_id not in by_id, "an event no rule matches reached the queue"
            continue
        outcome, verdict = by_id[event_id]
        assert outcome.event.kind is kind, dumps(outcome)
        # Every rule carries only what the handler acts on: each event is actionable and done
        # (the responder today only logs the plan), never "not actionable".
        assert outcome.result is Result.DONE and outcome.plan.actionable and outcome.plan.steps, dumps(outcome)
        assert verdict is Verdict.DELETE
        assert outcome.event.instance_ids == (INSTANCE,) or outcome.event.capacity_reservation_id
    sqs = boto3.client("sqs", endpoint_url=aws.endpoint_url, region_name=REGION)
    left = sqs.get_queue_attributes(QueueUrl=stack["QueueUrl"], AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert left == {"ApproximateNumberOfMessages": "0", "ApproximateNumberOfMessagesNotVisible": "0"}


@pytest.mark.parametrize("purchase_tags", [(), ("karpenter.sh/discovery=train", "team=ml")], ids=["key-only", "selector-tags"])
def test_a_purchase_may_carry_exactly_the_purchase_key_and_the_purchase_tags_keys(
        aws: MotoServer, purchase_tags: tuple[str, ...]) -> None:
    """PurchaseCapacityBlock's aws:TagKeys condition equals what Ec2Capacity.purchase tags a block
    with: resilienced.io/purchase-key plus the keys of --purchase-tags (CapacityBlockTagKeys)."""
    keys = list(CapacityPolicy(purchase_tags=purchase_tags).purchase_tag_map)
    cfn = boto3.client("cloudformation", endpoint_url=aws.endpoint_url, region_name=REGION)
    parameters = {**PARAMETERS, "AllowCapacityBlockPurchase": "true", "CapacityBlockTagKeys": ",".join(keys)}
    cfn.create_stack(StackName="resilienced-buy", TemplateBody=STACK.read_text(),
                     Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()],
                     Capabilities=["CAPABILITY_IAM"])
    (described,) = cfn.describe_stacks(StackName="resilienced-buy")["Stacks"]
    assert described["StackStatus"] == "CREATE_COMPLETE", described.get("StackStatusReason")
    arn = {o["OutputKey"]: o["OutputValue"] for o in described["Outputs"]}["CapacityBlockPurchasePolicyArn"]
    iam = boto3.client("iam", endpoint_url=aws.endpoint_url, region_name=REGION)
    version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
    document = iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"]
    document = json.loads(document) if isinstance(document, str) else document
    (buy,) = [s for s in document["Statement"] if s["Action"] == "ec2:PurchaseCapacityBlock"]
    assert buy["Condition"]["ForAllValues:StringEquals"]["aws:TagKeys"] == [PURCHASE_KEY_TAG, *keys]
