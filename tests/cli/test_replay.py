"""``resilienced replay``: the CLI contract other work depends on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import resilienced
from resilienced.app import cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = Path(resilienced.__file__).parent / "samples"
KINDS = {"spot_interruption", "capacity_reservation_interruption", "capacity_block_expiry",
         "scheduled_change", "state_change", "rebalance_recommendation", "asg_lifecycle",
         "unknown", "invalid"}
REQUIRED = {"source_file", "event_id", "kind", "instance_ids", "capacity_reservation_id",
            "actionable", "deadline", "reason"}


def replay(*args: str, capsys) -> tuple[int, list[dict], str]:
    code = cli.main(["replay", *args])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()] if "--json" in args else []
    return code, rows, out + err


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_json_rows_for_a_directory_hold_the_contract_fields_in_name_order(capsys):
    code, rows, _ = replay("--dry-run", "--json", str(SAMPLES), capsys=capsys)
    assert code == 0
    files = [r["source_file"] for r in rows]
    assert files == sorted(files, key=lambda f: Path(f).relative_to(SAMPLES).parts)
    assert len(rows) == len(list(SAMPLES.rglob("*.*")))  # README.md included: it is a file too
    for row in rows:
        assert set(row) >= REQUIRED, row
        assert row["kind"] in KINDS
        assert isinstance(row["instance_ids"], list) and isinstance(row["actionable"], bool)
        if not row["actionable"]:
            assert row["reason"]
        if row["deadline"] is not None:
            assert row["deadline"].endswith("Z")
    readme = next(r for r in rows if r["source_file"].endswith("README.md"))
    assert readme["kind"] == "invalid" and "not JSON" in readme["reason"]


def test_values_of_an_actionable_row(capsys):
    code, [row], _ = replay("--dry-run", "--json", str(SAMPLES / "nth" / "nth-spot-itn.json"), capsys=capsys)
    assert code == 0
    assert row["event_id"] == "1e5527d7-bb36-4607-3370-4164db56a40e"
    assert row["kind"] == "spot_interruption" and row["actionable"] is True
    assert row["instance_ids"] == ["i-0b662ef9931388ba0"]
    assert row["capacity_reservation_id"] is None
    assert row["deadline"] == "1970-01-01T00:02:00Z"


def test_capacity_block_row_names_the_reservation(tmp_path, capsys):
    event = {"version": "0", "id": "cb-1", "detail-type": "Capacity Block Reservation Expiration Warning",
             "source": "aws.ec2", "account": "123456789012", "time": "2024-05-01T10:50:00Z",
             "region": "us-east-2", "resources": [],
             "detail": {"capacity-reservation-id": "cr-0123456789abcdef0", "end-date": "2024-05-01T11:30:00Z"}}
    path = write(tmp_path, "block.json", json.dumps(event))
    _, [row], _ = replay("--dry-run", "--json", str(path), capsys=capsys)
    assert row["capacity_reservation_id"] == "cr-0123456789abcdef0"
    assert row["instance_ids"] == [] and row["deadline"] == "2024-05-01T11:00:00Z"


@pytest.mark.parametrize("content, reason", [
    (b"", "body: empty"),
    (b"\xff\xfe\x00", "not UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, "nested deeper"),
    (b'{"source": "aws.ec2", "detail-type": 3}', "detail-type: expected a string"),
], ids=["empty", "not-utf8", "deep", "wrong-type"])
def test_malformed_files_are_invalid_rows_and_exit_0(tmp_path, capsys, content, reason):
    path = write(tmp_path, "bad.json", content)
    code, [row], _ = replay("--dry-run", "--json", str(path), capsys=capsys)
    assert code == 0
    assert row["kind"] == "invalid" and row["event_id"] is None and reason in row["reason"]


def test_allowed_accounts_flag(tmp_path, capsys):
    path = SAMPLES / "karpenter" / "karpenter-spot-interruption.json"  # account 000000000000
    _, [allowed], _ = replay("--dry-run", "--json", "--allowed-accounts", "000000000000", str(path), capsys=capsys)
    _, [refused], _ = replay("--dry-run", "--json", "--allowed-accounts", "123456789012,210987654321",
                             str(path), capsys=capsys)
    assert allowed["actionable"] is True
    assert refused["kind"] == "invalid" and "account: 000000000000 is not in the allowed accounts" in refused["reason"]


def test_table_output_lists_every_file(capsys):
    code, _, output = replay("--dry-run", str(SAMPLES / "nth"), capsys=capsys)
    lines = output.splitlines()
    assert code == 0
    assert lines[0].split()[:3] == ["FILE", "KIND", "ACT"]
    assert len(lines) == 1 + len(list((SAMPLES / "nth").iterdir()))
    assert any("nth-spot-itn.json" in line and "spot_interruption" in line and " yes " in line for line in lines)


def test_without_dry_run_the_responder_is_called_for_actionable_plans(capsys):
    code = cli.main(["replay", "--json", str(SAMPLES / "nth" / "nth-spot-itn.json")])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["actionable"] is True
    plan_lines = [json.loads(line) for line in err.splitlines() if '"plan"' in line]
    assert plan_lines and plan_lines[0]["instance_ids"] == ["i-0b662ef9931388ba0"]


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "/no/such/file.json"], "/no/such/file.json: no such file or directory"),
    (["--dry-run", "--allowed-accounts", "12", "x"], "--allowed-accounts: '12' is not a 12-digit"),
    (["--dry-run", "--rebalance-policy", "panic", "x"], "--rebalance-policy"),
], ids=["missing-path", "bad-account", "bad-policy"])
def test_usage_errors_and_unreadable_paths_exit_2(capsys, args, message):
    code = cli.main(["replay", *args])
    err = capsys.readouterr().err
    assert code == 2 and f"resilienced: error: {message}" in err


def test_an_unreadable_file_exits_2(tmp_path, capsys):
    path = write(tmp_path, "secret.json", "{}")
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file; reading this one fails for everybody (EIO)
        path = Path("/proc/self/mem")
    assert cli.main(["replay", "--dry-run", str(path)]) == 2
    assert f"resilienced: error: {path}: cannot read" in capsys.readouterr().err


def test_no_path_is_a_usage_error_exit_2():
    with pytest.raises(SystemExit) as caught:
        cli.main(["replay", "--dry-run"])
    assert caught.value.code == 2


def test_the_console_entry_point_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "resilienced", "replay", "--dry-run", "--json",
                             str(SAMPLES / "nth" / "nth-rebalance-recommendation.json")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "rebalance_recommendation"


def test_replay_judges_each_event_as_of_its_own_time_and_at_another_time_says_which_are_stale(
        tmp_path, capsys):
    from tests.intake import payloads as p
    inputs = [write(tmp_path, f"{n}.json", json.dumps(event)) for n, event in enumerate([
        p.spot("i-00000000000000001"),  # 2024-01-01T00:00:00Z, deadline 00:02
        p.spot("i-00000000000000002", time="2024-01-01T00:09:00Z"),  # deadline 00:11
        p.spot("i-00000000000000003", time="2099-01-01T00:00:00Z"),
    ])]
    paths = [str(i) for i in inputs]

    code, recorded, _ = replay("--dry-run", "--json", *paths, capsys=capsys)
    assert code == 0
    assert [(r["actionable"], r["stale"]) for r in recorded] == [(True, None)] * 3

    code, rows, _ = replay("--dry-run", "--json", "--at", "2024-01-01T00:10:00Z", *paths, capsys=capsys)
    assert code == 0
    old, fresh, ahead = rows
    assert (old["actionable"], old["stale"], old["steps"]) == (False, "past", [])
    assert old["reason"] == ("stale: its deadline 2024-01-01T00:02:00Z passed 00:08:00 before "
                             "2024-01-01T00:10:00Z (allowed: 300s, --stale-after-seconds): not acted on")
    assert (fresh["actionable"], fresh["stale"]) == (True, None)
    assert (ahead["actionable"], ahead["stale"]) == (False, "future")
    assert "--future-skew-seconds" in ahead["reason"]

    code, now_rows, _ = replay("--dry-run", "--json", "--at", "now", *paths, capsys=capsys)
    assert [r["stale"] for r in now_rows] == ["past", "past", "future"]


@pytest.mark.parametrize("value, message", [
    ("yesterday", "'yesterday' is not `now` or an ISO-8601 time"),
    ("2024-01-01T00:10:00", "'2024-01-01T00:10:00' has no time zone"),
], ids=["not-a-time", "no-zone"])
def test_at_that_is_not_a_time_is_a_usage_error_exit_2(tmp_path, capsys, value, message):
    path = write(tmp_path, "a.json", "{}")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["replay", "--at", value, str(path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
