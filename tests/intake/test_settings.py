"""Settings: flags over environment over defaults, parsed and validated once, errors name the flag."""

from __future__ import annotations

import argparse

import pytest

from resilienced.errors import ConfigError
from resilienced.settings import QueueSettings, Settings, documented_options

pytestmark = pytest.mark.unit

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/interruptions"


def settings(argv=(), environ=None) -> Settings:
    return Settings.from_args(list(argv), environ or {})


def test_defaults():
    s = settings()
    assert (s.queue.wait_seconds, s.queue.batch_size, s.queue.concurrency) == (20, 10, 10)
    assert (s.queue.visibility_timeout, s.queue.shutdown_timeout, s.queue.allow_no_dlq) == (60, 30.0, False)
    assert s.intake.rebalance_policy == "notify" and s.intake.asg_deadline_seconds == 120.0
    assert s.intake.allowed_accounts == () and s.http.http_port == 8080 and s.log.log_level == "info"


def test_environment_gives_defaults_and_flags_override_it():
    environ = {"RESILIENCED_QUEUE_URL": QUEUE, "RESILIENCED_CONCURRENCY": "4",
               "RESILIENCED_ALLOWED_ACCOUNTS": "123456789012, 210987654321",
               "RESILIENCED_ALLOW_NO_DLQ": "true", "RESILIENCED_REBALANCE_POLICY": "drain"}
    s = settings(["--concurrency", "7"], environ).validate()
    assert s.queue.queue_url == QUEUE
    assert s.queue.concurrency == 7
    assert s.queue.allow_no_dlq is True
    assert s.intake.allowed_accounts == ("123456789012", "210987654321")
    assert s.intake.rebalance_policy == "drain"


def test_region_falls_back_to_aws_region_then_to_the_queue_url():
    assert settings(["--queue-url", QUEUE], {"AWS_REGION": "us-west-2"}).queue.effective_region == "us-west-2"
    assert settings(["--queue-url", QUEUE], {"RESILIENCED_REGION": "us-east-2", "AWS_REGION": "us-west-2"}) \
        .queue.effective_region == "us-east-2"
    assert settings(["--queue-url", QUEUE]).queue.effective_region == "eu-west-1"


def test_endpoint_url_falls_back_to_the_standard_aws_variables():
    s = settings([], {"AWS_ENDPOINT_URL": "http://127.0.0.1:5000"})
    assert s.queue.endpoint_url == "http://127.0.0.1:5000"


def test_switch_flag_sets_true():
    assert settings(["--allow-no-dlq"]).queue.allow_no_dlq is True


BAD = [
    ("queue-url-missing", [], {}, "--queue-url", "required"),
    ("queue-url-not-a-url", ["--queue-url", "interruptions"], {}, "--queue-url", "expected an http(s) URL"),
    ("region-unknown", ["--queue-url", "http://127.0.0.1:5000/1/q"], {}, "--region", "not set"),
    ("region-malformed", ["--queue-url", QUEUE, "--region", "mars"], {}, "--region", "'mars' is not an AWS region"),
    ("endpoint-not-a-url", ["--queue-url", QUEUE, "--endpoint-url", "localhost:5000"], {}, "--endpoint-url", "http(s) URL"),
    ("concurrency-not-a-number", ["--queue-url", QUEUE], {"RESILIENCED_CONCURRENCY": "lots"}, "--concurrency",
     "expected a whole number, got 'lots' (from env RESILIENCED_CONCURRENCY)"),
    ("concurrency-zero", ["--queue-url", QUEUE, "--concurrency", "0"], {}, "--concurrency", "between 1 and 1000"),
    ("batch-over-ten", ["--queue-url", QUEUE, "--batch-size", "11"], {}, "--batch-size", "between 1 and 10"),
    ("wait-over-twenty", ["--queue-url", QUEUE, "--wait-seconds", "21"], {}, "--wait-seconds", "between 0 and 20 s"),
    ("visibility-too-short", ["--queue-url", QUEUE, "--visibility-timeout", "1"], {}, "--visibility-timeout", "between 2"),
    ("shutdown-negative", ["--queue-url", QUEUE, "--shutdown-timeout", "-1"], {}, "--shutdown-timeout", "between 0"),
    ("shutdown-nan", ["--queue-url", QUEUE, "--shutdown-timeout", "nan"], {}, "--shutdown-timeout", "finite"),
    ("bool-garbage", ["--queue-url", QUEUE], {"RESILIENCED_ALLOW_NO_DLQ": "maybe"}, "--allow-no-dlq", "true or false"),
    ("account-malformed", ["--queue-url", QUEUE, "--allowed-accounts", "12345"], {}, "--allowed-accounts", "'12345'"),
    ("region-list-malformed", ["--queue-url", QUEUE, "--allowed-regions", "us-east-1,moon"], {}, "--allowed-regions", "'moon'"),
    ("rebalance-unknown", ["--queue-url", QUEUE, "--rebalance-policy", "panic"], {}, "--rebalance-policy", "notify, checkpoint-ahead, drain"),
    ("asg-deadline-zero", ["--queue-url", QUEUE, "--asg-deadline-seconds", "0"], {}, "--asg-deadline-seconds", "between 1"),
    ("port-too-big", ["--queue-url", QUEUE, "--http-port", "70000"], {}, "--http-port", "between 0 and 65535"),
    ("log-level-unknown", ["--queue-url", QUEUE, "--log-level", "loud"], {}, "--log-level", "debug, info"),
]


@pytest.mark.parametrize("argv, environ, setting, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_settings_raise_config_error_naming_the_flag(argv, environ, setting, message):
    with pytest.raises(ConfigError) as caught:
        settings(argv, environ).validate()
    assert caught.value.setting == setting
    assert message in caught.value.message


def test_a_group_can_be_read_alone_without_requiring_the_queue():
    group = QueueSettings.from_args(argparse.Namespace(region="us-east-1"), {})
    group.validate(require_queue=False)
    assert group.effective_region == "us-east-1"


def test_every_setting_is_documented_with_a_flag_and_an_environment_variable():
    rows = documented_options()
    assert len(rows) == sum(len(g.options()) for g in Settings.GROUPS.values())
    for group, flag, env, default, help_text in rows:
        assert flag.startswith("--") and "RESILIENCED_" in env and len(help_text) > 20, flag


def test_kueue_api_version_is_discovered_by_default_or_forced():
    assert settings().mode.kueue_api_version == "auto"
    assert settings([], {"RESILIENCED_KUEUE_API_VERSION": "v1beta1"}).mode.kueue_api_version == "v1beta1"
    assert settings(["--kueue-api-version", "V1BETA2"]).mode.kueue_api_version == "v1beta2"
    with pytest.raises(ConfigError, match="--kueue-api-version.*expected one of auto, v1beta2, v1beta1"):
        settings(["--kueue-api-version", "v1alpha1"])


def test_node_join_seconds_is_one_figure_for_every_kind_or_one_per_kind():
    assert settings().recovery.node_join_priors == {}
    assert settings(["--node-join-seconds", "240"]).recovery.node_join_priors == {
        "spot": 240.0, "capacity-block": 240.0, "on-demand": 240.0}
    assert settings([], {"RESILIENCED_NODE_JOIN_SECONDS": "spot=300, On-Demand=90"}).recovery.node_join_priors == {
        "spot": 300.0, "on-demand": 90.0}
    with pytest.raises(ConfigError, match="--node-join-seconds.*KIND one of spot, capacity-block, on-demand"):
        settings(["--node-join-seconds", "reserved=60"])
    with pytest.raises(ConfigError, match=r"--node-join-seconds \(spot\)"):
        settings(["--node-join-seconds", "spot=0"]).recovery.validate()


def test_a_range_is_declared_once_shown_in_the_help_and_checked_naming_the_flag():
    from datetime import timedelta

    from resilienced.capacity.policy import CapacityPolicy

    helps = {flag: help_text for _, flag, _, _, help_text in documented_options()}
    assert QueueSettings.bounds_of("wait_seconds") == (0, 20) and "in seconds (0-20)." in helps["--wait-seconds"]
    assert CapacityPolicy.bounds_of("interruption_window") == (timedelta(minutes=1), timedelta(days=7))
    assert "counted (1m-7d)." in helps["--interruption-window"]
    with pytest.raises(ConfigError, match=r"^--wait-seconds: must be between 0 and 20 s, got 21$"):
        settings(["--queue-url", QUEUE, "--wait-seconds", "21"]).validate()
    with pytest.raises(ConfigError, match=r"^--interruption-window: must be between 0:01:00 and 7 days"):
        CapacityPolicy(interruption_window=timedelta(seconds=59))
    with pytest.raises(ConfigError, match=r"^--goodput-floor: expected a ratio between 0 and 1, got '1.5'"):
        settings(["--goodput-floor", "1.5"])


def test_enum_settings_hold_the_member_parsed_once_and_name_the_flag_on_a_bad_value():
    from resilienced.settings import ExportMode, IntakeSettings, Mode, ModeSettings, RebalancePolicy

    s = settings(["--mode", "RAY", "--export-mode", "task"], {"RESILIENCED_REBALANCE_POLICY": "drain"})
    assert s.mode.mode is Mode.RAY and s.recovery.export_mode is ExportMode.TASK
    assert s.intake.rebalance_policy is RebalancePolicy.DRAIN
    assert settings().mode.mode is Mode.PLAN and settings().recovery.export_mode is ExportMode.AUTO
    # given its text in code (the drill, tests), an enum setting still holds the member
    assert ModeSettings(mode="kubernetes").mode is Mode.KUBERNETES
    assert IntakeSettings(rebalance_policy="checkpoint-ahead").rebalance_policy is RebalancePolicy.CHECKPOINT_AHEAD
    assert ModeSettings(mode="RAY").mode is Mode.RAY  # as its flag's text is read
    with pytest.raises(ConfigError, match=r"^--mode: expected one of plan, kubernetes, ray, got 'k8s'$"):
        ModeSettings(mode="k8s")
    with pytest.raises(ConfigError, match=r"^--mode: expected one of plan, kubernetes, ray, got 'k8s' "
                                          r"\(from env RESILIENCED_MODE\)$"):
        settings([], {"RESILIENCED_MODE": "k8s"})
    with pytest.raises(ConfigError, match=r"^--export-mode: expected one of auto, task, got 'push'"):
        settings(["--export-mode", "push"])


def test_the_capacity_names_are_the_model_s_capacities():
    from resilienced.model import CAPACITY_NAMES, Capacity

    assert CAPACITY_NAMES == ("spot", "capacity-block", "on-demand")
    assert all(Capacity(name) is not Capacity.WAIT for name in CAPACITY_NAMES)
    assert set(settings(["--node-join-seconds", "60"]).recovery.node_join_priors) == set(CAPACITY_NAMES)
