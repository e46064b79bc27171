"""What deploy/ grants equals what resilienced calls (resilienced.ops.permissions), exactly.

RBAC: the ClusterRole, the Role in the daemon's namespace and the example overlay's token Role
against RBAC_RULES / NAMESPACED_RBAC_RULES.  IAM: every action of the CloudFormation policy (all
conditional statements included) against IAM_ACTIONS.  And permissions.py against the code:
each IAM action names real botocore operations; an adapter that exports its own IAM_ACTIONS is
fully covered; every Kubernetes call the kube package makes through ``api.call(verb, resource,
...)`` is granted.
"""

from __future__ import annotations

import ast
import importlib
import json
import importlib.util
import pkgutil
from collections import Counter
from pathlib import Path
from typing import Any

import botocore.session
import pytest

import resilienced
from resilienced.ops import permissions
from resilienced.ops.permissions import CONDITIONAL_RBAC_RULES, IAM_ACTIONS, NAMESPACED_RBAC_RULES, RBAC_RULES

from .tools import REPO, STACK, build, load_template, objects

pytestmark = pytest.mark.integration  # kubectl kustomize (tools.build)

DAEMON_NAMESPACE = "resilienced"
DAEMON_SA = {"kind": "ServiceAccount", "name": "resilienced", "namespace": DAEMON_NAMESPACE}


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


# ---------------------------------------------------------------- Kubernetes RBAC
@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_the_cluster_role_grants_exactly_rbac_rules(build_name: str) -> None:
    (role,) = [o for o in build(build_name) if o["kind"] == "ClusterRole"]
    assert _grants(role["rules"]) == permissions.grants(RBAC_RULES)
    assert all("resourceNames" not in rule for rule in role["rules"])


@pytest.mark.parametrize("build_name", ["base", "overlay"])
def test_the_daemon_namespace_role_grants_exactly_the_claim_leases(build_name: str) -> None:
    roles = [o for o in build(build_name) if o["kind"] == "Role"
             and o["metadata"]["namespace"] == DAEMON_NAMESPACE]
    assert len(roles) == 1
    assert _grants(roles[0]["rules"]) == permissions.grants(NAMESPACED_RBAC_RULES["daemon"])


def test_the_overlay_token_role_gets_named_secrets_only_in_the_training_namespace() -> None:
    roles = [o for o in build("overlay") if o["kind"] == "Role"
             and o["metadata"]["namespace"] != DAEMON_NAMESPACE]
    assert [r["metadata"]["namespace"] for r in roles] == ["ml-training"]
    (rule,) = roles[0]["rules"]
    assert _grants([rule]) == permissions.grants(NAMESPACED_RBAC_RULES["run"])
    assert rule["resourceNames"], "a Secret grant must name its Secrets"
    # The name the example RayJob's authOptions points at.
    (rayjob,) = [o for o in build("examples") if o["kind"] == "RayJob"]
    assert rule["resourceNames"] == [rayjob["spec"]["rayClusterSpec"]["authOptions"]["secretName"]]
    assert permissions.as_rbac(NAMESPACED_RBAC_RULES["run"], resource_names=rule["resourceNames"]) \
        == [{**rule, "verbs": sorted(rule["verbs"])}]


def test_the_base_grants_no_secret_at_all() -> None:
    rules = [r for o in build("base") if o["kind"] in ("Role", "ClusterRole") for r in o["rules"]]
    assert not [r for r in rules if "secrets" in r["resources"]]


def test_no_wildcard_no_exec_no_escalation_anywhere() -> None:
    rules = [r for o in objects("Role") + objects("ClusterRole") for r in o["rules"]]
    flat = [x for r in rules for key in ("apiGroups", "resources", "verbs") for x in r[key]]
    assert "*" not in flat
    assert not {"pods/exec", "pods/attach", "pods/portforward", "nodes/proxy"} & set(flat)
    assert not {"escalate", "bind", "impersonate"} & set(flat)


def test_every_binding_binds_its_own_role_to_the_daemon_service_account_only() -> None:
    bindings = objects("RoleBinding") + objects("ClusterRoleBinding")
    assert Counter(b["kind"] for b in bindings) == Counter(
        {"RoleBinding": 3, "ClusterRoleBinding": 2})  # base + overlay builds
    for binding in bindings:
        assert binding["subjects"] == [DAEMON_SA]
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]


def test_rbac_rules_are_well_formed() -> None:
    for rule in (*RBAC_RULES, *(r for rules in NAMESPACED_RBAC_RULES.values() for r in rules)):
        assert rule.verbs and len(set(rule.verbs)) == len(rule.verbs), rule
        assert set(rule.verbs) <= {"get", "list", "watch", "create", "update", "patch", "delete"}
        assert rule.used_by and rule.why, rule
    assert len({(r.api_group, r.resource) for r in RBAC_RULES}) == len(RBAC_RULES), "one rule per resource"


def test_rbac_rules_equal_the_adapters_own_lists() -> None:
    """permissions.py against resilienced.kube.rbac + resilienced.requeue.rbac, scope by scope."""
    from resilienced.kube import rbac as kube_rbac
    from resilienced.requeue import rbac as requeue_rbac

    def triples(rules) -> set[tuple[str, str, str]]:
        return {(g, r, v) for rule in rules for g in rule.api_groups for r in rule.resources for v in rule.verbs}

    adapters = (*kube_rbac.RBAC_RULES, *requeue_rbac.RBAC_RULES)
    assert {r.scope for r in adapters} == {"cluster", "lease-namespace", "ray-namespace"}
    always = [r for r in adapters if r.scope == "cluster" and r.when == "always"]
    conditional = [r for r in adapters if r.scope == "cluster" and r.when != "always"]
    assert permissions.grants(RBAC_RULES) == triples(always)
    assert permissions.grants(r for rules in CONDITIONAL_RBAC_RULES.values() for r in rules) == triples(conditional)
    assert permissions.grants(NAMESPACED_RBAC_RULES["daemon"]) == triples(
        r for r in adapters if r.scope == "lease-namespace")
    assert permissions.grants(NAMESPACED_RBAC_RULES["run"]) == triples(
        r for r in adapters if r.scope == "ray-namespace")


# ---------------------------------------------------------------- the code's Kubernetes calls
def _kube_calls() -> set[tuple[str, str, str]]:
    """(module, verb, resource) of every ``call(verb=..., resource=...)`` with literal values in resilienced/kube."""
    found = set()
    for path in sorted((REPO / "resilienced" / "kube").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "call"):
                continue
            given = dict(zip(("verb", "resource"), node.args[:2]))
            given.update({k.arg: k.value for k in node.keywords if k.arg in ("verb", "resource")})
            verb, resource = given.get("verb"), given.get("resource")
            if all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in (verb, resource)):
                found.add((f"resilienced.kube.{path.stem}", verb.value, resource.value))
    return found


def test_every_literal_kubernetes_call_of_the_kube_package_is_granted() -> None:
    calls = _kube_calls()
    if not (REPO / "resilienced" / "kube").is_dir():
        pytest.fail("resilienced/kube is gone: point this test at the Kubernetes adapter")
    assert calls, "no call(verb, resource, ...) found: the kube package changed its boundary"
    granted = {(resource, verb) for _, resource, verb in permissions.grants(
        (*RBAC_RULES, *(r for rules in NAMESPACED_RBAC_RULES.values() for r in rules)))}
    missing = sorted((m, v, r) for m, v, r in calls if (r.split(".")[0], v) not in granted)
    assert not missing, f"calls without an RBAC grant in permissions.py: {missing}"


# ---------------------------------------------------------------- IAM
def _statements(template: dict[str, Any]) -> list[dict[str, Any]]:
    """Every statement of every managed policy of the stack (optional ones included)."""
    return [statement for resource in template["Resources"].values()
            if resource["Type"] == "AWS::IAM::ManagedPolicy"
            for statement in resource["Properties"]["PolicyDocument"]["Statement"]]


def _actions(statement: dict[str, Any]) -> list[str]:
    action = statement["Action"]
    return [action] if isinstance(action, str) else list(action)


def _resources(statement: dict[str, Any]) -> list[str]:
    resource = statement["Resource"]
    return [json.dumps(r, sort_keys=True) for r in (resource if isinstance(resource, list) else [resource])]


def test_the_iam_policy_grants_exactly_iam_actions() -> None:
    statements = _statements(load_template(STACK))
    actions = [a for s in statements for a in _actions(s)]
    assert set(actions) == set(IAM_ACTIONS), "an action missing or extra"
    grants = Counter((a, r) for s in statements for a in _actions(s) for r in _resources(s))
    assert not [g for g, n in grants.items() if n > 1], "an action granted twice on one resource"
    assert all(s["Effect"] == "Allow" for s in statements)
    assert not [a for a in actions if "*" in a]


def _granting(action: str) -> list[dict[str, Any]]:
    return [s for s in _statements(load_template(STACK)) if action in _actions(s)]


def test_instances_are_launched_tagged_tagged_at_launch_only_and_terminated_only_when_tagged() -> None:
    """The EC2 node provider's grants carry the tag conditions its code keeps (resilienced.aws.ec2nodes)."""
    from resilienced.aws.ec2nodes import LAUNCHED_BY_TAG

    owner = {"Ref": "Ec2NodeOwner"}
    run = _granting("ec2:RunInstances")
    tagged = [s for s in run if any("instance/*" in r or "volume/*" in r for r in _resources(s))]
    assert len(tagged) == 1 and tagged[0]["Condition"] == {
        "StringEquals": {f"aws:RequestTag/{LAUNCHED_BY_TAG}": owner}}
    assert all("Condition" in s or not any("instance/*" in r for r in _resources(s)) for s in run)
    # CreateTags: each grant limited to the one operation that tags, together exactly the Call's
    create = _granting("ec2:CreateTags")
    assert sorted(s["Condition"]["StringEquals"]["ec2:CreateAction"] for s in create) \
        == sorted(IAM_ACTIONS["ec2:CreateTags"].operations)
    [terminate] = _granting("ec2:TerminateInstances")
    assert terminate["Condition"] == {"StringEquals": {f"ec2:ResourceTag/{LAUNCHED_BY_TAG}": owner}}
    assert _resources(terminate) == [json.dumps(
        {"Fn::Sub": "arn:${AWS::Partition}:ec2:${AWS::Region}:${AWS::AccountId}:instance/*"})]
    [passrole] = _granting("iam:PassRole")
    assert passrole["Resource"] == {"Ref": "Ec2NodeRoleArn"}
    assert passrole["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}


def test_only_calls_without_resource_level_permissions_get_resource_star() -> None:
    star = {a for s in _statements(load_template(STACK)) if s["Resource"] == "*" for a in _actions(s)}
    assert star == {"ec2:DescribeInstances", "ec2:DescribeCapacityReservations",
                    "ec2:DescribeCapacityBlockOfferings", "fsx:DescribeDataRepositoryTasks",
                    "ec2:DescribeSpotPriceHistory", "pricing:GetProducts"}  # the ledger's prices


def test_every_iam_action_names_real_botocore_operations() -> None:
    session = botocore.session.get_session()
    for action, call in IAM_ACTIONS.items():
        model = session.get_service_model(call.service)
        # iam:PassRole is authorised on the call that passes the role (EC2's RunInstances)
        assert action.split(":")[0] in (model.signing_name, call.service) or action == "iam:PassRole", action
        for operation in call.operations:
            assert operation in model.operation_names, f"{action}: {call.service} has no {operation}"


def _defines_iam_actions(source: str) -> bool:
    """True when the module itself assigns IAM_ACTIONS (not when it re-exports another's)."""
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "IAM_ACTIONS" for t in targets):
            return True
    return False


def _modules_exporting_iam_actions() -> dict[str, tuple[str, ...]]:
    found = {}
    for root in ("resilienced", "handlers"):
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            if info.name == "resilienced.ops.permissions":
                continue
            source = Path(importlib.util.find_spec(info.name).origin or "")
            if source.suffix == ".py" and _defines_iam_actions(source.read_text()):
                found[info.name] = tuple(importlib.import_module(info.name).IAM_ACTIONS)
    return found


def test_adapters_that_list_their_iam_actions_match_permissions_exactly() -> None:
    exported = _modules_exporting_iam_actions()
    assert "resilienced.capacity.ec2" in exported  # the first adapter that lists its own
    for module, actions in exported.items():
        claimed = {a for a, call in IAM_ACTIONS.items() if module in call.used_by.split(", ")}
        assert set(actions) == claimed, f"{module}: IAM_ACTIONS {sorted(actions)} vs permissions {sorted(claimed)}"


def test_the_package_imports_permissions_without_importing_adapters() -> None:
    assert resilienced.ops.permissions is permissions
    source = (REPO / "resilienced" / "ops" / "permissions.py").read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "collections.abc", "dataclasses"}


# ---------------------------------------------------------------- the code's AWS calls
#: Modules that talk only to the local stand-ins (moto) or are operator tools, not the daemon:
#: everything in resilienced/local/ (the drill and its FSx stand-in, the intake demo, moto's
#: wiring) and the game-day injector.
NOT_THE_DAEMON = {"local", "app/inject.py"}
#: Operations in the daemon's modules that only an operator tool calls (with the operator's own
#: credentials): SqsQueue.send serves `resilienced inject`.
TOOL_ONLY = {"sqs": {"SendMessage"}}


def _aws_calls() -> dict[str, set[str]]:
    """service -> botocore operations the daemon's code calls (``client.<operation>(...)`` or a
    paginator of it), found by reading every module of resilienced/ against the service models."""
    import botocore.session
    from botocore import xform_name

    models = botocore.session.get_session()
    services = {call.service for call in IAM_ACTIONS.values()}
    by_method = {}
    for service in services:
        for op in models.get_service_model(service).operation_names:
            by_method.setdefault(xform_name(op), set()).add((service, op))
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "resilienced").rglob("*.py")):
        relative = path.relative_to(REPO / "resilienced")
        if NOT_THE_DAEMON & {relative.parts[0], relative.as_posix()}:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            # client.receive_message(...), and helpers named by string: self._call("delete_message"),
            # client.get_paginator("list_objects_v2"), self._pages("describe_instances", ...)
            names = [node.func.attr]
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
            for name in names:
                for service, op in by_method.get(name, ()):
                    found.setdefault(service, set()).add(op)
    return found


def test_every_aws_operation_the_daemon_calls_is_granted_and_every_grant_is_called() -> None:
    called = _aws_calls()
    declared: dict[str, set[str]] = {}
    for call in IAM_ACTIONS.values():
        declared.setdefault(call.service, set()).update(call.operations)
    # names shared between services (e.g. describe_instances on ec2 only) are resolved by the
    # declared service; an operation found under a service it does not belong to is ignored
    assert {s: ops & declared.get(s, set()) for s, ops in called.items() if ops & declared.get(s, set())} \
        == declared, "declared IAM operations that no module calls"
    ungranted = {s: sorted(ops - declared.get(s, set()) - TOOL_ONLY.get(s, set())) for s, ops in called.items()}
    # other services' operations that happen to share a Python method name are not AWS calls
    ungranted = {s: ops for s, ops in ungranted.items() if ops}
    assert not ungranted, f"AWS operations the daemon calls without an IAM grant: {ungranted}"
