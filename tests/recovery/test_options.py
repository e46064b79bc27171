"""The recovery's and the follow-up's options are their settings in their own terms: built by one
``from_settings`` each, with the settings' defaults (issue #41, item 7)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from resilienced.followup.follower import FollowUpOptions
from resilienced.followup.rules import Bounds
from resilienced.recovery.responder import RecoveryOptions
from resilienced.settings import Mode, Settings

pytestmark = pytest.mark.unit

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/interruptions"


def settings(*argv: str) -> Settings:
    return Settings.from_args(["--queue-url", QUEUE, *argv], {}).validate()


def test_the_options_defaults_are_the_settings_defaults() -> None:
    assert FollowUpOptions() == FollowUpOptions.from_settings(settings("--mode", "kubernetes"))
    assert FollowUpOptions().bounds == Bounds()  # 10, 15, 15 minutes, as docs/requeue.md says
    assert RecoveryOptions() == RecoveryOptions.from_settings(settings("--mode", "kubernetes"))


def test_the_follow_up_options_come_from_the_follow_up_settings() -> None:
    options = FollowUpOptions.from_settings(settings(
        "--mode", "ray", "--ray-address", "10.0.0.5:6379", "--admitted-bound-seconds", "60",
        "--scheduled-bound-seconds", "120", "--training-bound-seconds", "180", "--max-fallbacks", "1",
        "--fallback-cooldown-seconds", "600", "--follow-up-interval-seconds", "0.5",
        "--follow-up-claim-ttl-seconds", "30", "--dedupe-seconds", "3600"))
    assert options == FollowUpOptions(
        bounds=Bounds(admitted=timedelta(seconds=60), scheduled=timedelta(seconds=120),
                      training=timedelta(seconds=180)),
        max_fallbacks=1, cooldown=timedelta(minutes=10), interval_s=0.5, claim_ttl_s=30.0,
        keep=timedelta(hours=1), mode=Mode.RAY)


def test_the_recovery_options_come_from_the_recovery_settings() -> None:
    auto = RecoveryOptions.from_settings(settings(
        "--durable-grace-seconds", "5", "--durable-poll-seconds", "0.5", "--checkpoint-ahead-seconds", "30",
        "--visibility-timeout", "90", "--node-join-seconds", "spot=200"))
    assert (auto.durable_grace_seconds, auto.durable_poll_seconds, auto.checkpoint_ahead_seconds,
            auto.claim_ttl_seconds, auto.node_join_seconds) == (5.0, 0.5, 30.0, 90.0, {"spot": 200.0})
    assert auto.export_paths is None and auto.file_system_id is None  # auto-export: no export task
    task = RecoveryOptions.from_settings(settings(
        "--export-mode", "task", "--fsx-file-system-id", "fs-0123456789abcdef0",
        "--fsx-file-system-path", "/checkpoints", "--fsx-data-repository-path", "s3://bucket/ckpt"))
    assert task.file_system_id == "fs-0123456789abcdef0" and task.export_paths is not None
    assert task.export_paths("s3://bucket/ckpt/run-1") == ["/checkpoints/run-1"]
