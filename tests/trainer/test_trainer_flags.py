"""Flags: bad input gets a clear error naming the flag; the config travels to the ranks intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import TrainConfig, parse_args
from trainer.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--num-workers", "3"], "--batch-size"),  # 8 sequences over 3 workers
        (["--steps", "0"], "--steps"),
        (["--n-heads", "5"], "--n-heads"),
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--keep", "0"], "--keep"),
        (["--dropout", "1.0"], "--dropout"),
        (["--save-margin-factor", "0.5"], "--save-margin-factor"),
        (["--ray-address", "local", "--use-gpu"], "--use-gpu"),
        (["--crash-at", "nowhere:3"], "--crash-at"),
        (["--crash-at", "committed"], "--crash-at"),
        (["--num-workers", "3", "--min-workers", "0"], "--min-workers"),
        (["--num-workers", "3", "--min-workers", "4"], "--min-workers"),
        (["--num-workers", "3", "--min-workers", "2", "--ray-address", "local"], "--min-workers"),
        (["--num-workers", "3", "--min-workers", "2", "--batch-size", "2"], "--batch-size"),
        (["--num-workers", "3", "--min-workers", "2", "--resize-save-timeout-s", "0"], "--resize-save-timeout-s"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_a_bad_flag_is_named_in_the_error(tmp_path: Path, argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(["--checkpoint-dir", str(tmp_path), *argv])
    assert info.value.setting == flag
    assert str(info.value).startswith(f"{flag}: ")


def test_the_config_survives_the_trip_to_the_ranks(tmp_path: Path) -> None:
    cfg = parse_args([
        "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-out", str(tmp_path / "m.jsonl"),
        "--num-workers", "4", "--d-model", "32", "--crash-at", "manifest-written:6", "--async-save",
        "--step-seconds-file", str(tmp_path / "pace"),
    ])
    again = TrainConfig.from_dict(cfg.as_dict())
    assert again == cfg
    assert again.crash_at == ("manifest-written", 6) and again.model.d_model == 32
    assert again.step_seconds_file == tmp_path / "pace"


def test_a_step_lasts_what_the_step_seconds_file_holds_while_it_exists(tmp_path: Path) -> None:
    """The test hook that keeps a run from ending before what a test waits for happens."""
    pace = tmp_path / "pace"
    cfg = parse_args(["--checkpoint-dir", str(tmp_path / "ck"), "--min-step-seconds", "0.2",
                      "--step-seconds-file", str(pace)])
    assert cfg.step_seconds_now() == 0.2  # no file: --min-step-seconds
    pace.write_text("2.5")
    assert cfg.step_seconds_now() == 2.5
    pace.unlink()
    assert cfg.step_seconds_now() == 0.2
    assert parse_args(["--checkpoint-dir", str(tmp_path / "ck")]).step_seconds_now() == 0.0


def test_an_elastic_run_takes_a_batch_that_splits_unevenly(tmp_path: Path) -> None:
    cfg = parse_args(["--checkpoint-dir", str(tmp_path), "--num-workers", "3", "--min-workers", "2",
                      "--resize-interval-s", "5"])
    assert cfg.elastic and (cfg.min_workers, cfg.num_workers, cfg.batch_size) == (2, 3, 8)
    assert TrainConfig.from_dict(cfg.as_dict()) == cfg
    assert not parse_args(["--checkpoint-dir", str(tmp_path)]).elastic


@pytest.mark.e2e  # it starts `python -m trainer`
def test_the_cli_exits_2_and_names_the_flag(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--checkpoint-dir", str(tmp_path), "--num-workers", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "--batch-size: 8 sequences cannot be split evenly over 3 workers" in result.stderr


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        parse_args(["--checkpoint-dir", str(tmp_path / "f")])
