"""The Helm chart (deploy/helm/resilienced) against the kustomize base, the daemon and the checkers.

- ``helm lint --strict`` is clean, with the defaults and with ``ci/full-values.yaml`` (every value
  set away from its default);
- one source of truth: ``helm template`` with the defaults renders the objects of
  ``kubectl kustomize deploy/kubernetes/base``, field for field, once the few differences that
  are the Helm way are taken out, each of them named and asserted here (Helm's labels, the
  release's namespace instead of a Namespace object, a checksum annotation instead of a hashed
  ConfigMap name, no IRSA placeholder); the PrometheusRule and the dashboard are the monitoring
  component's files, byte for byte;
- both renders validate strictly (kubernetes-validate at 1.33 and 1.37, the vendored CRD schemas)
  and checkov finds nothing but the two answered checks (the full values pin the image by digest,
  so only one is left there);
- the RBAC is exactly ``resilienced.ops.permissions``; the settings are ones the daemon accepts;
- a wrong value is refused by ``helm template`` and ``helm install`` with the field named;
- the chart's version and appVersion are the package's.

helm is built from source (``make helm``, tests/support/controlplane/build.py) and its absence
FAILS these tests, as a missing deploy tool does.  The install, upgrade and uninstall on the real
control plane are tests/cluster/test_helm.py.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilienced.ops import permissions
from resilienced.ops.permissions import CONDITIONAL_RBAC_RULES, NAMESPACED_RBAC_RULES, RBAC_RULES
from resilienced.options import ENV_PREFIX
from resilienced.settings import Settings, documented_options
from tests.support import layers
from tests.support.controlplane.build import HELM_VERSION, MissingBuild, program

from . import crd
from .test_manifests import K8S_VERSIONS, _is_builtin, _k8s_validate
from .tools import DEPLOY, KUBERNETES, REPO, build, dumps, run, tool

pytestmark = pytest.mark.integration

CHART = DEPLOY / "helm" / "resilienced"
FULL_VALUES = CHART / "ci" / "full-values.yaml"
MONITORING = KUBERNETES / "components" / "monitoring"
RELEASE = NAMESPACE = "resilienced"
#: The labels Helm's way adds (helm.sh/chart and app.kubernetes.io/{instance,version,managed-by}).
HELM_LABELS = {"app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
               "helm.sh/chart"}
IRSA = "eks.amazonaws.com/role-arn"


def helm() -> str:
    """The built helm, or fail saying how to build it."""
    try:
        path = program("helm")
    except MissingBuild as err:
        pytest.fail(f"{err} (`make test` builds it too)", pytrace=False)
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is not an executable: run `make helm`", pytrace=False)
    return str(path)


_HOME = tempfile.mkdtemp(prefix="resilienced-helm-home-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)


def run_helm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """helm with its cache, config and data in a folder of the session (nothing in ~)."""
    env = {f"HELM_{kind}_HOME": str(Path(_HOME) / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    return run([helm(), *args], timeout=timeout, env=env)


@cache
def _template(values: tuple[str, ...], sets: tuple[str, ...], release: str, namespace: str) -> tuple[dict, ...]:
    args = ["template", release, str(CHART), "-n", namespace]
    for path in values:
        args += ["-f", path]
    for item in sets:
        args += ["--set", item]
    done = run_helm(*args)
    assert done.returncode == 0, f"helm {' '.join(args)} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(*values: Path, sets: tuple[str, ...] = (), release: str = RELEASE,
           namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """``helm template`` of the chart, parsed (each distinct render once per session; a deep copy)."""
    layers.started("integration", "helm template (rendered once per session)")
    return copy.deepcopy(list(_template(tuple(map(str, values)), sets, release, namespace)))


def the(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


# ---------------------------------------------------------------- the tool and the chart
def test_helm_is_the_pinned_build() -> None:
    done = run_helm("version", "--template", "{{.Version}}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == HELM_VERSION


@pytest.mark.parametrize("values", [(), (FULL_VALUES,)], ids=["defaults", "full-values"])
def test_helm_lint_strict_is_clean(values: tuple[Path, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for path in values:
        args += ["-f", str(path)]
    done = run_helm(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout
    assert not re.search(r"\[(WARNING|ERROR)\]", done.stdout), done.stdout


def test_the_chart_version_and_app_version_are_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (version, version)
    (container,) = the(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/resilienced/resilienced:{version}"


def test_the_chart_refuses_a_kubernetes_older_than_the_manifests_claim() -> None:
    oldest = K8S_VERSIONS[0]
    done = run_helm("template", RELEASE, str(CHART), "--kube-version", oldest)
    assert done.returncode == 0, done.stderr
    older = run_helm("template", RELEASE, str(CHART), "--kube-version", "1.32.9")
    assert older.returncode != 0 and "kubeVersion" in older.stderr, older.stderr


# ---------------------------------------------------------------- one source of truth
def _strip_helm_labels(node: Any) -> Any:
    """Helm's labels out of every label map and selector (they appear nowhere else)."""
    if isinstance(node, dict):
        return {k: _strip_helm_labels(v) for k, v in node.items() if k not in HELM_LABELS}
    if isinstance(node, list):
        return [_strip_helm_labels(v) for v in node]
    return node


def _normalized_chart(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for obj in _strip_helm_labels(objects):
        if obj["kind"] == "Deployment":
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            annotations.pop("checksum/config")
            if not annotations:
                del obj["spec"]["template"]["metadata"]["annotations"]
        out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


def _normalized_base() -> dict[tuple[str, str], dict[str, Any]]:
    objects = copy.deepcopy([o for o in build("base") if o["kind"] != "Namespace"])
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    hashed = config["metadata"]["name"]
    plain = re.fullmatch(r"(.+)-[a-z0-9]{10}", hashed)
    assert plain, f"{hashed}: not a configMapGenerator name"
    objects = json.loads(json.dumps(objects).replace(f'"{hashed}"', f'"{plain.group(1)}"'))
    account = next(o for o in objects if o["kind"] == "ServiceAccount")
    assert "set-by-overlay" in account["metadata"]["annotations"].pop(IRSA)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_the_defaults_render_the_kustomize_base_object_for_object() -> None:
    chart, base = _normalized_chart(render()), _normalized_base()
    assert sorted(chart) == sorted(base)
    different = {f"{kind}/{name}": {"chart": chart[(kind, name)], "base": base[(kind, name)]}
                 for kind, name in base if chart[(kind, name)] != base[(kind, name)]}
    assert not different, dumps(different)


def test_the_comparison_sees_a_changed_field() -> None:
    """The normalisation hides only what it names: a chart that drifted is caught."""
    drifted = render()
    deployment = the(drifted, "Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 61
    chart, base = _normalized_chart(drifted), _normalized_base()
    assert chart[("Deployment", "resilienced")] != base[("Deployment", "resilienced")]
    rules = the(drifted, "ClusterRole")["rules"]
    rules[0]["verbs"] = [*rules[0]["verbs"], "delete"]
    assert _normalized_chart(drifted)[("ClusterRole", "resilienced")] != base[("ClusterRole", "resilienced")]


def test_the_differences_from_the_base_are_the_helm_way_and_only_these() -> None:
    objects = render()
    base = build("base")
    # 1. the release's namespace (helm install -n ... --create-namespace), not a Namespace object;
    #    every namespaced object is in it
    assert not [o for o in objects if o["kind"] == "Namespace"]
    assert [o["kind"] for o in base if o["kind"] == "Namespace"] == ["Namespace"]
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] not in cluster_scoped} == {NAMESPACE}
    # 2. Helm's labels on every object, and the release in every selector
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert HELM_LABELS <= set(labels), obj["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    deployment = the(objects, "Deployment")
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    # 3. the ConfigMap keeps its name; the pod template carries its checksum (a change rolls the pods)
    config = the(objects, "ConfigMap")
    assert config["metadata"]["name"] == "resilienced"
    checksum = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert re.fullmatch(r"[0-9a-f]{64}", checksum)
    # 4. no IRSA placeholder: the annotation is there only when serviceAccount.roleArn is set
    account = the(objects, "ServiceAccount")
    assert IRSA not in account["metadata"]["annotations"]
    arn = "arn:aws:iam::111122223333:role/resilienced-DaemonRole-EXAMPLE"
    assert the(render(sets=(f"serviceAccount.roleArn={arn}",)), "ServiceAccount")["metadata"]["annotations"][IRSA] == arn


def test_another_release_name_renames_every_object_and_selects_only_its_pods() -> None:
    objects = render(release="blue", namespace="team-a")
    assert {o["metadata"]["name"] for o in objects} == {"blue-resilienced", "blue-resilienced-claims"}
    pod = the(objects, "Deployment")["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "blue-resilienced"
    assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "blue"
    for binding in [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "blue-resilienced", "namespace": "team-a"}]
    policy = the(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert policy["app.kubernetes.io/instance"] == "blue"


# ---------------------------------------------------------------- the monitoring component's files
@pytest.mark.parametrize("name", ["prometheusrule.yaml", "resilienced-dashboard.json"])
def test_the_charts_monitoring_files_are_the_components(name: str) -> None:
    assert (CHART / "files" / name).read_bytes() == (MONITORING / name).read_bytes(), (
        f"deploy/helm/resilienced/files/{name} differs from {MONITORING.relative_to(REPO)}/{name}: "
        "the component's is the one tested (promtool, the dashboard generator); copy it over")


def test_the_rendered_alerts_and_dashboard_are_the_components() -> None:
    objects = render(sets=("monitoring.prometheusRule.enabled=true", "monitoring.dashboard.enabled=true"))
    overlay = build("overlay")
    rule = the(objects, "PrometheusRule")
    assert rule["spec"] == the(list(overlay), "PrometheusRule")["spec"]
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "daemon"
    dashboard = the(objects, "ConfigMap", "resilienced-dashboard")
    assert dashboard["data"] == the(list(overlay), "ConfigMap", "resilienced-dashboard")["data"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    # off by default, as the base leaves them to the component; the ServiceMonitor is on, as in the base
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render()}
    assert ("PrometheusRule", "resilienced") not in kinds and ("ConfigMap", "resilienced-dashboard") not in kinds
    assert ("ServiceMonitor", "resilienced") in kinds


# ---------------------------------------------------------------- the checkers
@pytest.mark.parametrize("values", [(), (FULL_VALUES,)], ids=["defaults", "full-values"])
def test_every_rendered_object_validates_strictly(values: tuple[Path, ...]) -> None:
    objects = render(*values)
    builtins = [o for o in objects if _is_builtin(o)]
    customs = [o for o in objects if not _is_builtin(o)]
    assert len(builtins) >= 10 and {o["kind"] for o in customs} >= {"ServiceMonitor"}
    results = _k8s_validate(builtins)
    assert len(results) == len(builtins) * len(K8S_VERSIONS)
    bad = [r for r in results if r["result"] != "ok"]
    assert not bad, dumps(bad)
    errors = {f"{o['kind']}/{o['metadata']['name']}": crd.errors(o) for o in customs}
    assert not {k: v for k, v in errors.items() if v}, dumps(errors)


@pytest.fixture(scope="module")
def checkov(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """checkov (kubernetes) on the default and the full render: name -> its report."""
    folder = tmp_path_factory.mktemp("checkov-helm")
    reports = {}
    for name, values in (("defaults", ()), ("full-values", (FULL_VALUES,))):
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(render(*values), sort_keys=False))
        done = run([tool("checkov"), "--skip-download", "--output", "json", "--framework", "kubernetes",
                    "-f", str(path)], timeout=300, env={"BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_OUTPUT_COLOR": "1"})
        assert done.returncode == 0 or done.stdout.strip(), done.stderr
        parsed = json.loads(done.stdout)
        (report,) = parsed if isinstance(parsed, list) else [parsed]
        reports[name] = report
    return reports


def test_checkov_finds_nothing_unanswered_in_the_chart(checkov: dict[str, dict]) -> None:
    for name, report in checkov.items():
        assert report["summary"]["parsing_errors"] == 0, name
        assert report["summary"]["passed"] >= 100, name
        failed = [(c["check_id"], c["resource"], c["check_name"]) for c in report["results"]["failed_checks"]]
        assert not failed, f"{name}: {json.dumps(failed, indent=1)}"
    skipped = {name: {c["check_id"] for c in report["results"]["skipped_checks"]} for name, report in checkov.items()}
    # the answers of docs/deploy.md; with a digest (the full values) the image check passes instead
    assert skipped == {"defaults": {"CKV_K8S_43", "CKV_K8S_38"}, "full-values": {"CKV_K8S_38"}}
    passed = {c["check_id"] for c in checkov["full-values"]["results"]["passed_checks"]}
    assert "CKV_K8S_43" in passed


# ---------------------------------------------------------------- RBAC
def test_the_default_rbac_is_exactly_permissions() -> None:
    objects = render()
    assert _grants(the(objects, "ClusterRole")["rules"]) == permissions.grants(RBAC_RULES)
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _grants(role["rules"]) == permissions.grants(NAMESPACED_RBAC_RULES["daemon"])
    rules = [r for o in objects if o["kind"] in ("Role", "ClusterRole") for r in o["rules"]]
    flat = {x for r in rules for key in ("apiGroups", "resources", "verbs") for x in r[key]}
    assert "*" not in flat and "secrets" not in flat
    assert not {"escalate", "bind", "impersonate", "pods/exec"} & flat


def test_the_full_values_rbac_adds_exactly_the_conditional_rule_and_the_named_token_secrets() -> None:
    objects = render(FULL_VALUES)
    values = yaml.safe_load(FULL_VALUES.read_text())
    conditional = (r for rules in CONDITIONAL_RBAC_RULES.values() for r in rules)
    assert _grants(the(objects, "ClusterRole")["rules"]) == permissions.grants(RBAC_RULES) | permissions.grants(conditional)
    roles = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "Role"}
    claims = roles.pop(values["claimsNamespace"])
    assert _grants(claims["rules"]) == permissions.grants(NAMESPACED_RBAC_RULES["daemon"])
    assert sorted(roles) == sorted(entry["namespace"] for entry in values["rayTokenSecrets"])
    for entry in values["rayTokenSecrets"]:
        assert roles[entry["namespace"]]["rules"] == permissions.as_rbac(
            NAMESPACED_RBAC_RULES["run"], resource_names=entry["secrets"])
    account = values["serviceAccount"]["name"]
    assert the(objects, "ServiceAccount")["metadata"]["name"] == account
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bindings) == 2 + len(values["rayTokenSecrets"])
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]


# ---------------------------------------------------------------- the daemon's settings
def test_the_full_values_are_settings_the_daemon_accepts() -> None:
    objects = render(FULL_VALUES)
    values = yaml.safe_load(FULL_VALUES.read_text())
    (container,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    (ref,) = container["envFrom"]
    config = the(objects, "ConfigMap", ref["configMapRef"]["name"])["data"]
    known = {env for _, _, envs, _, _ in documented_options() for env in envs.split(" / ")}
    assert all(k.startswith(ENV_PREFIX) for k in config) and not set(config) - known, sorted(set(config) - known)
    assert container["args"][0] == "run"
    settings = Settings.from_args(container["args"][1:], config).validate()
    assert settings.queue.queue_url == values["queueUrl"]
    assert settings.queue.effective_region == values["region"]
    assert settings.mode.claims_namespace == values["claimsNamespace"]
    assert settings.recovery.export_mode == "task"
    assert settings.recovery.durable_poll_seconds == 0.5
    assert settings.intake.allowed_accounts == tuple(values["allowedAccounts"])
    assert settings.http.http_port == values["httpPort"] == container["ports"][0]["containerPort"]
    assert settings.intake.rebalance_policy == "checkpoint-ahead"
    assert settings.follow_up.follow_up_interval_seconds == 10
    # the grace period outlasts the shutdown bound; the webhook URL is only in its Secret
    assert the(objects, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] \
        >= settings.queue.shutdown_timeout + 10
    secret = the(objects, "Secret")
    assert secret["metadata"]["name"] == values["notify"]["secretName"]
    assert secret["stringData"] == {values["notify"]["secretKey"]: values["notify"]["webhookUrl"]}
    assert not [v for v in config.values() if "hooks.slack.com" in v]
    volume = next(v for v in the(objects, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "notify")
    assert volume["secret"]["secretName"] == values["notify"]["secretName"]
    assert volume["secret"]["items"] == [{"key": values["notify"]["secretKey"], "path": "webhook-url"}]


def test_a_changed_setting_changes_the_pod_template_and_nothing_else_of_the_deployment() -> None:
    before = the(render(), "Deployment")
    after = the(render(sets=("concurrency=11",)), "Deployment")
    annotation = "checksum/config"
    old, new = (d["spec"]["template"]["metadata"]["annotations"][annotation] for d in (before, after))
    assert old != new
    after["spec"]["template"]["metadata"]["annotations"][annotation] = old
    assert after == before
    assert the(render(sets=("concurrency=11",)), "ConfigMap")["data"]["RESILIENCED_CONCURRENCY"] == "11"
    # a value that is not a setting (the NetworkPolicy's) leaves the pod template alone
    assert the(render(sets=("networkPolicy.prometheusNamespace=observability",)), "Deployment") == before


@pytest.mark.parametrize(("switch", "gone"), [
    ("networkPolicy.enabled=false", {"NetworkPolicy"}),
    ("podDisruptionBudget.enabled=false", {"PodDisruptionBudget"}),
    ("monitoring.serviceMonitor.enabled=false", {"ServiceMonitor"}),
    ("rbac.create=false", {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}),
])
def test_each_switch_removes_its_objects_and_nothing_else(switch: str, gone: set[str]) -> None:
    default = {(o["kind"], o["metadata"]["name"]) for o in render()}
    switched = {(o["kind"], o["metadata"]["name"]) for o in render(sets=(switch,))}
    assert {kind for kind, _ in default - switched} == gone
    assert switched <= default


def test_an_existing_service_account_is_bound_and_not_made() -> None:
    objects = render(sets=("serviceAccount.create=false", "serviceAccount.name=platform-sa"))
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    assert the(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-sa"
    for binding in [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]:
        assert binding["subjects"][0]["name"] == "platform-sa"
    refused = run_helm("template", RELEASE, str(CHART), "--set", "serviceAccount.create=false")
    assert refused.returncode != 0 and "serviceAccount.name" in refused.stderr, refused.stderr


# ---------------------------------------------------------------- wrong values are refused
#: (--set, the field the message must name): values.schema.json's refusals.
SCHEMA_REFUSALS = [
    ("replicas=two", "/replicas"),
    ("mode=k8s", "/mode"),
    ("queueUrl=ftp://sqs.us-east-1.amazonaws.com/111122223333/q", "/queueUrl"),
    ("queueUrl=sqs.us-east-1.amazonaws.com/111122223333/q", "/queueUrl"),
    ("replica=2", "replica"),  # a typo of a field is not ignored
    ("checkpoint.exportMode=s3", "/checkpoint/exportMode"),
    ("allowedAccounts={1111}", "/allowedAccounts/0"),
]
#: The template's own refusals: what the schema cannot say.
TEMPLATE_REFUSALS = [
    ("terminationGracePeriodSeconds=35", "terminationGracePeriodSeconds"),
    ("config.RESILIENCED_MODE=ray", "config.RESILIENCED_MODE"),
    ("mode=ray", "ray.address"),
    ("checkpoint.exportMode=task", "checkpoint.fsxFileSystemId"),
    ("replicas=1", "podDisruptionBudget.minAvailable"),
]


@pytest.mark.parametrize("command", ["template", "install"])
@pytest.mark.parametrize(("value", "field"), SCHEMA_REFUSALS + TEMPLATE_REFUSALS,
                         ids=[v for v, _ in SCHEMA_REFUSALS + TEMPLATE_REFUSALS])
def test_a_wrong_value_is_refused_naming_its_field(command: str, value: str, field: str) -> None:
    args = [command, RELEASE, str(CHART), "-n", NAMESPACE, "--set", value]
    if command == "install":
        args += ["--dry-run=client"]  # helm install itself, without a cluster to talk to
    done = run_helm(*args)
    assert done.returncode != 0, f"helm {command} accepted {value}:\n{done.stdout[:2000]}"
    assert field in done.stderr, done.stderr
    if (value, field) in SCHEMA_REFUSALS:
        assert "don't meet the specifications of the schema" in done.stderr, done.stderr


@pytest.mark.parametrize("value", ["replicas=3", "mode=plan", "queueUrl=http://127.0.0.1:5000/000000000000/q",
                                   "terminationGracePeriodSeconds=40", "config.RESILIENCED_DEDUPE_SECONDS=600",
                                   "mode=ray,ray.address=10.0.0.5:6379",
                                   "replicas=1,podDisruptionBudget.enabled=false"])
def test_the_right_values_next_to_them_are_accepted(value: str) -> None:
    objects = render(sets=(value,))
    assert the(objects, "Deployment")


# ---------------------------------------------------------------- NOTES.txt
def test_the_notes_say_how_to_check_the_daemon() -> None:
    done = run_helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", "-f", str(FULL_VALUES))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    values = yaml.safe_load(FULL_VALUES.read_text())
    assert f"kubectl -n {NAMESPACE} exec deploy/resilienced -- resilienced status" in notes
    assert "rollout status deploy/resilienced" in notes
    assert f"port {values['httpPort']}" in notes and "/metrics" in notes
    rules = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    alerts = [r["alert"] for g in rules["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 10
    assert all(re.search(rf"^\s+{a}$", notes, re.M) for a in alerts), notes
    assert "WARNING" not in notes  # the queue URL and the role are set
    bare = run_helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client")
    assert "queueUrl is empty" in bare.stdout.split("NOTES:", 1)[1]
