"""Generate resilienced-dashboard.json, the Grafana dashboard of resilienced (stdlib only).

    python deploy/kubernetes/components/monitoring/dashboard.py   # rewrites the JSON next to it

Grafana's dashboard JSON model (schemaVersion 39: Grafana 10/11), written by code rather than
by hand so that every panel has the same shape.  tests/deploy/test_monitoring.py checks that
the JSON is what this script writes, that it is a well-formed dashboard (unique panel ids,
grid positions, one Prometheus datasource variable) and that every query names only metrics
the daemon exports.  Import it in Grafana, or let the monitoring component's ConfigMap (label
grafana_dashboard=1) be picked up by Grafana's dashboard sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("resilienced-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24


def q(expr: str, legend: str = "") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, label: str) -> list[dict[str, Any]]:
    return [q(f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket[$__rate_interval])))",
              f"{label} p{int(p * 100)}") for p in (0.5, 0.9, 0.99)]


#: (row title, [(panel title, type, unit, [queries], description)])
ROWS: list[tuple[str, list[tuple[str, str, str, list[dict[str, Any]], str]]]] = [
    ("Daemon health", [
        ("Ready replicas", "stat", "none", [q("sum(resilienced_ready)", "ready")],
         "Replicas whose /readyz is 200 (the queue answered within the last minute)."),
        ("Queue depth", "timeseries", "none",
         [q("max by (state) (resilienced_queue_messages)", "{{state}}")],
         "The queue's approximate number of messages, read once a minute."),
        ("Since the last message received", "stat", "s",
         [q("time() - max(resilienced_last_message_received_timestamp_seconds)", "seconds")],
         "Long while the queue has visible messages: the daemon is not consuming."),
        ("Backend errors", "timeseries", "ops",
         [q("sum by (backend) (rate(resilienced_backend_errors_total[$__rate_interval]))", "{{backend}}"),
          q("sum by (operation) (rate(resilienced_queue_errors_total[$__rate_interval]))", "sqs {{operation}}")],
         "Temporary failures of the Ray GCS, Kubernetes and AWS; every one is retried."),
        ("In flight", "timeseries", "none", [q("sum(resilienced_in_flight)", "messages")],
         "Messages being handled now."),
        ("CPU and memory", "timeseries", "none",
         [q("rate(process_cpu_seconds_total[$__rate_interval])", "{{pod}} cpu s/s"),
          q("process_resident_memory_bytes / 2^20", "{{pod}} MiB")],
         "The daemon's process metrics."),
        ("Versions", "table", "none", [q("max by (version, ray_version) (resilienced_build_info)")],
         "resilienced and Ray versions running."),
    ]),
    ("Notices", [
        ("Notices by kind", "timeseries", "none",
         [q("sum by (kind) (increase(resilienced_events_received_total[$__rate_interval]))", "{{kind}}")],
         "Messages received, by the kind they parsed to."),
        ("Decisions by outcome", "timeseries", "none",
         [q("sum by (outcome) (increase(resilienced_events_decided_total[$__rate_interval]))", "{{outcome}}")],
         "done, duplicate, not_actionable, invalid, retry, failed."),
        ("Event age at receive", "timeseries", "s",
         quantiles("resilienced_event_age_at_receive_seconds", "age"),
         "From the event's time to its receive: what is left of the 120 s notice is 120 s minus this."),
        ("Interruptions per pool (1h)", "timeseries", "none",
         [q("sum by (instance_type, availability_zone) (increase(resilienced_interruptions_total[1h]))",
            "{{instance_type}} {{availability_zone}}")],
         "Spot interruptions the capacity decision counted, per instance type and AZ."),
        ("Handling time", "timeseries", "s", quantiles("resilienced_handling_seconds", "handling"),
         "Receive to settled (deleted, kept or released)."),
    ]),
    ("Checkpoints", [
        ("Notice -> checkpoint saved", "timeseries", "s",
         quantiles("resilienced_notice_to_checkpoint_seconds", "saved"),
         "From the notice to the save of the checkpoint that became durable."),
        ("Notice -> checkpoint durable", "timeseries", "s",
         quantiles("resilienced_notice_to_durable_seconds", "durable"),
         "From the notice to the checkpoint verified in S3; it must stay under the deadline."),
        ("Checkpoint outcomes", "timeseries", "none",
         [q("sum by (outcome) (increase(resilienced_checkpoints_total[$__rate_interval]))", "{{outcome}}")],
         "durable, not_durable, no_checkpoint_uri."),
        ("Steps lost", "timeseries", "none",
         [q("sum(increase(resilienced_steps_lost_total[$__rate_interval]))", "steps")],
         "Steps repeated because the newest durable checkpoint predates the notice."),
        ("Drains", "timeseries", "none",
         [q("sum by (outcome) (increase(resilienced_drains_total[$__rate_interval]))", "{{outcome}}")],
         "Ray node drains sent, by outcome."),
    ]),
    ("After the requeue: training again", [
        ("Notice -> training again", "timeseries", "s",
         quantiles("resilienced_notice_to_training_seconds", "training"),
         "From the notice to the first step the requeued run trained again (the end of a recovery)."),
        ("Runs recovering, by stage", "timeseries", "none",
         [q("max by (stage) (resilienced_runs_recovering)", "{{stage}}"),
          q("max(resilienced_runs_overdue)", "overdue")],
         "Requeued runs not training again yet (admitted, scheduled, joined, training; stuck), and those past their bound."),
        ("Fallbacks", "timeseries", "none",
         [q("sum by (from, to, reason) (increase(resilienced_recovery_fallbacks_total[$__rate_interval]))",
            "{{from}} -> {{to}} ({{reason}})")],
         "Runs moved to the next capacity because a stage stalled."),
        ("Recoveries by outcome", "timeseries", "none",
         [q("sum by (outcome) (increase(resilienced_recoveries_total[$__rate_interval]))", "{{outcome}}")],
         "resumed, stuck, superseded."),
    ]),
    ("What interruptions cost: the ledger", [
        ("Lost GPU-seconds, by part", "timeseries", "s",
         [q("sum by (part) (increase(resilienced_lost_gpu_seconds_total[$__rate_interval]))", "{{part}}")],
         "GPU-seconds the interruptions cost (steps trained twice, the save's pause, idle until training "
         "again, the capacity wait), each recovery's ledger (resilienced report RUN shows one run's)."),
        ("Run goodput", "timeseries", "percentunit",
         [q("min by (run) (resilienced_run_goodput_ratio)", "{{run}}"),
          q("max(resilienced_goodput_floor_ratio)", "floor (--goodput-floor)")],
         "Productive GPU-seconds / GPU-seconds held, per run with a follow-up record; the alert "
         "ResilienceRunGoodputLow fires below the floor."),
        ("Premium over Spot", "timeseries", "currencyUSD",
         [q("sum by (capacity) (increase(resilienced_capacity_premium_usd_total[$__rate_interval]))", "{{capacity}}")],
         "What the moves off Spot cost over Spot's price (Capacity Block fee per instance-hour, On-Demand)."),
    ]),
    ("Requeues and dead letters", [
        ("Requeues by capacity", "timeseries", "none",
         [q("sum by (capacity) (increase(resilienced_requeues_total[$__rate_interval]))", "{{capacity}}")],
         "Runs requeued, by the capacity they went to (wait: none yet, retried)."),
        ("Dead-lettered messages", "timeseries", "none",
         [q("sum(increase(resilienced_dead_lettered_total[$__rate_interval]))", "to the DLQ")],
         "Poison or invalid messages on their last receive before the DLQ."),
        ("Notifications", "timeseries", "none",
         [q("sum by (outcome) (increase(resilienced_notifications_total[$__rate_interval]))", "{{outcome}}")],
         "Webhook notifications sent, failed, dropped."),
    ]),
]


def panel(pid: int, title: str, kind: str, unit: str, targets: list[dict[str, Any]],
          description: str, x: int, y: int, w: int) -> dict[str, Any]:
    return {
        "id": pid, "type": kind, "title": title, "description": description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {},
        "targets": [{**t, "datasource": DATASOURCE, "refId": chr(ord("A") + i)}
                    for i, t in enumerate(targets)],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        per_line = 4 if len(row) > 4 else len(row)
        w = WIDTH // per_line
        for i, spec in enumerate(row):
            x = (i % per_line) * w
            if i and i % per_line == 0:
                y += 8
            panels.append(panel(pid, *spec, x=x, y=y, w=w))
            pid += 1
        y += 8
    return {
        "uid": "resilienced", "title": "resilienced", "tags": ["resilienced", "ray", "spot"],
        "timezone": "utc", "schemaVersion": 39, "version": 1, "editable": True,
        "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []}, "links": [], "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
