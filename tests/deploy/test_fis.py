"""deploy/aws/fis-spot-interruption.yaml: the game-day FIS experiment (cfn-lint and checkov run on
it with the other templates, test_cloudformation.py and test_scan.py); here, what it promises."""

from __future__ import annotations

from .tools import FIS_STACK, load_template
import pytest

pytestmark = pytest.mark.unit


def test_the_experiment_interrupts_running_spot_instances_of_the_nodepool_only() -> None:
    resources = load_template(FIS_STACK)["Resources"]
    (experiment,) = [r for r in resources.values() if r["Type"] == "AWS::FIS::ExperimentTemplate"]
    props = experiment["Properties"]
    (action,) = props["Actions"].values()
    assert action["ActionId"] == "aws:ec2:send-spot-instance-interruptions"
    assert action["Parameters"]["durationBeforeInterruption"] == {"Fn::Sub": "PT${MinutesBeforeInterruption}M"}
    (target_name,) = action["Targets"].values()
    target = props["Targets"][target_name]
    assert target["ResourceType"] == "aws:ec2:spot-instance"
    assert target["ResourceTags"] == {"karpenter.sh/nodepool": {"Ref": "NodePoolName"}}
    assert {"Path": "State.Name", "Values": ["running"]} in target["Filters"]
    assert props["RoleArn"] == {"Fn::GetAtt": ["FisRole", "Arn"]}


def test_the_role_is_for_fis_and_may_interrupt_only_the_nodepools_instances() -> None:
    role = load_template(FIS_STACK)["Resources"]["FisRole"]["Properties"]
    (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "fis.amazonaws.com"} and "aws:SourceAccount" in str(trust)
    statements = [s for p in role["Policies"] for s in p["PolicyDocument"]["Statement"]]
    actions = {s["Action"]: s for s in statements}
    assert set(actions) == {"ec2:SendSpotInstanceInterruptions", "ec2:DescribeInstances"}
    send = actions["ec2:SendSpotInstanceInterruptions"]
    assert send["Condition"] == {"StringEquals": {"aws:ResourceTag/karpenter.sh/nodepool": {"Ref": "NodePoolName"}}}
    assert "instance/*" in send["Resource"]["Fn::Sub"]
