"""The command registry, help, and the intake demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilienced.app import cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_commands_are_all_registered():
    # demo and drill come from the package's entry points: an install without them loses them
    assert set(cli.commands()) == {"run", "replay", "status", "inject", "report", "demo", "drill"}


def test_every_registered_command_has_configure_and_main():
    import importlib
    for name, (module_name, help_text) in cli.commands().items():
        module = importlib.import_module(module_name)
        assert callable(module.configure) and callable(module.main), name
        assert help_text and module.__doc__


@pytest.mark.parametrize("command", sorted(cli.commands()), ids=sorted(cli.commands()))
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main([command, "--help"])
    assert caught.value.code == 0
    assert f"usage: resilienced {command}" in capsys.readouterr().out


def test_an_unknown_command_is_a_usage_error():
    with pytest.raises(SystemExit) as caught:
        cli.main(["explode"])
    assert caught.value.code == 2


def test_run_help_lists_every_setting_with_its_environment_variable(capsys):
    from resilienced.settings import documented_options
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for _, flag, env, _, _ in documented_options():
        assert flag in out
        assert env.split(" / ")[0] in out


def test_demo_runs_eventbridge_to_sqs_to_the_daemon_and_drains():
    result = subprocess.run([sys.executable, "-m", "resilienced", "demo", "--json"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 23
    by_sample = {row["sample"]: row for row in rows}
    spot = by_sample["nth/nth-spot-itn.json"]
    assert (spot["via"], spot["kind"], spot["outcome"], spot["verdict"]) == (
        "eventbridge", "spot_interruption", "done", "delete")
    poison = by_sample["karpenter/karpenter-unparseable-message.json"]
    assert (poison["via"], poison["outcome"], poison["receives"]) == ("sqs", "invalid", 3)
    direct = by_sample["nth/nth-asg-terminate-lifecycle-direct-sqs.json"]
    assert direct["kind"] == "asg_lifecycle" and direct["steps"][-1] == "complete_lifecycle"
    assert all(row["outcome"] for row in rows)
