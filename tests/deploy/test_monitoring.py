"""The monitoring component (deploy/kubernetes/components/monitoring) against the daemon.

- the alert rules pass ``promtool check rules`` and their unit tests (``promtool test rules``,
  tests/deploy/alerts-test.yaml), which hold for every alert a series that fires it and one
  that does not; promtool comes from ``make deploy-tools`` and its absence FAILS the test;
- every alert has a severity, a summary and a runbook section that exists in docs/operations.md;
- the dashboard JSON is what its generator writes, is well formed, and every query of it (and of
  the alerts) names only metrics the daemon exports;
- docs/operations.md's metric table lists exactly the daemon's metrics (name, type, labels), and
  its Event table exactly the Event reasons in the code.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilienced.ops.metrics import Metrics
from resilienced.app.runtime import metric_groups

from .tools import KUBERNETES, REPO, run, tool

pytestmark = pytest.mark.integration

MONITORING = KUBERNETES / "components" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "resilienced-dashboard.json"
ALERT_TESTS = Path(__file__).parent / "alerts-test.yaml"
OPERATIONS = REPO / "docs" / "operations.md"

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                 "unless", "bool", "offset", "le", "inf", "nan"}


def _families() -> dict[str, Any]:
    metrics = Metrics()
    metric_groups(metrics)
    return {f.name: f for f in metrics.registry.collect()}


def _labels() -> dict[str, tuple[str, ...]]:
    """Family name -> label names (prometheus_client keeps them on the collector)."""
    metrics = Metrics()
    metric_groups(metrics)
    out = {}
    for collector in list(metrics.registry._collector_to_names):  # no public API lists labels
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            out[collector._name] = tuple(names)
    return out


def exported_series() -> set[str]:
    """Every series name a scrape of the daemon can show."""
    out = set()
    for name, family in _families().items():
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "gauge": ("",)}[family.type]
        out.update(name + s for s in suffixes)
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (strings, matchers, ranges and groupings removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(0), text[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS or word.startswith("__"):
            continue
        names.add(word)
    return names


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def _headings() -> set[str]:
    """GitHub anchors of docs/operations.md's headings."""
    slugs = set()
    for line in OPERATIONS.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return slugs


def _promtool_dir(tmp_path: Path, spec: dict[str, Any]) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts-test.yaml")
    return tmp_path


# ---------------------------------------------------------------- alerts
def test_the_rules_pass_promtool_check_and_their_unit_tests(tmp_path: Path) -> None:
    promtool = tool("promtool")
    where = _promtool_dir(tmp_path, yaml.safe_load(RULES.read_text())["spec"])
    checked = run([promtool, "check", "rules", str(where / "rules.yaml")], timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run([promtool, "test", "rules", str(where / "alerts-test.yaml")], timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_unit_tests_fail_when_an_alert_stops_firing(tmp_path: Path) -> None:
    """The promtool tests can fail: raise one threshold out of reach and they do."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    for rule in spec["groups"][0]["rules"]:
        if rule["alert"] == "ResilienceDeadLetters":
            rule["expr"] = rule["expr"].replace("> 0", "> 100")
    where = _promtool_dir(tmp_path, spec)
    tested = run([tool("promtool"), "test", "rules", str(where / "alerts-test.yaml")], timeout=120)
    assert tested.returncode != 0 and "ResilienceDeadLetters" in tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    cases: dict[str, set[bool]] = {}
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            cases.setdefault(check["alertname"], set()).add(bool(check["exp_alerts"]))
    alerts = {rule["alert"] for rule in _rules()}
    assert {name: {True, False} for name in alerts} == {name: cases.get(name) for name in alerts}


def test_the_issue_asks_for_these_alerts() -> None:
    assert {rule["alert"] for rule in _rules()} >= {
        "ResilienceDeadLetters", "CheckpointNotDurable", "ResilienceStepsLost", "ResilienceDaemonDown",
        "ResilienceNotConsuming", "ResilienceRequeueStuckWaiting", "ResilienceRayGcsFailing",
        "ResilienceKubernetesFailing", "ResilienceAwsFailing"}


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    anchors = _headings()
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert len(rule["annotations"]["summary"]) > 20, rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url.split("#", 1)[0].endswith("docs/operations.md"), url
        assert url.split("#", 1)[1] == rule["alert"].lower() in anchors, (rule["alert"], url)


def test_the_alerts_read_only_metrics_the_daemon_exports() -> None:
    exported = exported_series()
    for rule in _rules():
        assert metric_names(rule["expr"]) <= exported, (rule["alert"], metric_names(rule["expr"]) - exported)


# ---------------------------------------------------------------- dashboard
def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("dashboard", MONITORING / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_json_is_what_its_generator_writes() -> None:
    assert DASHBOARD.read_text() == _generator().render(), \
        "run: python deploy/kubernetes/components/monitoring/dashboard.py"


def test_the_dashboard_is_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    (variable,) = board["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_every_dashboard_query_names_only_metrics_the_daemon_exports() -> None:
    exported = exported_series()
    board = json.loads(DASHBOARD.read_text())
    seen = set()
    for p in board["panels"]:
        for target in p.get("targets", []):
            names = metric_names(target["expr"])
            assert names and names <= exported, (p["title"], target["expr"], names - exported)
            seen |= names
    # the panels the issue asks for
    for needed in ("resilienced_events_received_total", "resilienced_notice_to_checkpoint_seconds_bucket",
                   "resilienced_notice_to_durable_seconds_bucket", "resilienced_steps_lost_total",
                   "resilienced_requeues_total", "resilienced_dead_lettered_total", "resilienced_ready"):
        assert needed in seen, needed


def test_the_query_check_catches_a_metric_the_daemon_does_not_export() -> None:
    assert metric_names('sum by (kind) (rate(resilienced_nope_total{kind="x"}[5m])) / up') == {
        "resilienced_nope_total", "up"}
    assert not {"resilienced_nope_total"} <= exported_series()


# ---------------------------------------------------------------- the docs' tables
def _table(heading: str) -> list[list[str]]:
    """The rows (cells, stripped of backticks) of the first table after ``heading``."""
    lines = OPERATIONS.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            cells = [c.strip().replace("`", "") for c in line.strip("|").split("|")]
            if not set(cells[0]) <= {"-", " "} and cells[0] not in ("metric", "reason"):
                rows.append(cells)
        elif rows:
            break
    return rows


def test_the_metrics_table_lists_every_metric_with_its_type_and_labels() -> None:
    families, labels = _families(), _labels()
    documented = {}
    for name, kind, label_cell, meaning in _table("## Metrics"):
        documented[name] = (kind, tuple(sorted(x.strip() for x in label_cell.split(",") if x.strip() not in ("", "—"))))
        assert len(meaning) > 10, name
    actual = {}
    for name, family in families.items():
        shown = name + "_total" if family.type == "counter" else name
        actual[shown] = (family.type, tuple(sorted(labels.get(name, labels.get(shown, ())))))
    assert documented == actual


def _reasons_in_code() -> set[str]:
    """Every Event reason the code defines: REASON_* constants and the values of *_REASONS maps."""
    found = set()
    for path in (REPO / "resilienced").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target = node.targets[0]
            if not isinstance(target, ast.Name):
                continue
            if target.id.startswith("REASON_") and isinstance(node.value, ast.Constant):
                found.add(node.value.value)
            elif target.id.endswith("_REASONS") and isinstance(node.value, ast.Dict):
                found |= {v.value for v in node.value.values if isinstance(v, ast.Constant)}
    return found


def test_the_events_table_lists_every_reason_the_daemon_records() -> None:
    documented = {row[0] for row in _table("## Kubernetes Events")}
    assert documented == _reasons_in_code()
    assert {"CheckpointNotDurable", "Requeued", "Draining"} <= documented
