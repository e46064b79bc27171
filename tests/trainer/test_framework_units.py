"""The framework callbacks' parts, in one process: the extras, the resumable loader, the guard.

* a missing optional library fails the import with the extra to install;
* ``ResumableDataLoader`` resumes the epoch where it was (skipping without loading), and starts
  the next epoch afresh after a whole one;
* ``PreemptionGuard`` (no process group: one rank, the local runtime): agrees only at boundaries
  before a notice, saves at a SIGTERM, commits what a framework wrote as a ``step-<N>`` that
  verifies, holds (raises ``PreemptedError`` outside Ray) when no step fits before the deadline,
  and refuses to start behind a committed checkpoint;
* the Hugging Face callback refuses the Trainer settings that would make a resume inexact.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import verify
from trainer.errors import PreemptedError, UsageError
from trainer.integrations.guard import PreemptionGuard
from trainer.preemption import SIGTERM

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------- the extras
@pytest.mark.parametrize("module, missing, extra", [
    ("trainer.integrations.transformers", "transformers", "resilienced[hf]"),
    ("trainer.integrations.lightning", "lightning.pytorch", "resilienced[lightning]"),
], ids=["hf", "lightning"])
def test_a_missing_library_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch, module: str,
                                                      missing: str, extra: str) -> None:
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=re.escape(f"pip install '{extra}'")):
        importlib.import_module(module)


# --------------------------------------------------------------------------- the resumable loader
class Rows(torch.utils.data.Dataset):
    """Row i is i; remembers which rows were loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


def loader(rows: Rows):
    from trainer.integrations.lightning import ResumableDataLoader

    return ResumableDataLoader(rows, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(7))


def test_the_resumable_loader_goes_on_where_the_epoch_was_without_loading_the_skipped_rows() -> None:
    whole = [b.tolist() for b in loader(Rows(12))]
    first = loader(Rows(12))
    it = iter(first)
    served = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()

    rows = Rows(12)
    resumed = loader(rows)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]

    assert state == {"batches": 2} and served == whole[:2]
    assert rest == whole[2:] and len(resumed) == 6
    assert sorted(rows.loaded) == sorted(i for b in whole[2:] for i in b)  # the skipped rows were not read
    assert resumed.state_dict() == {"batches": 6}
    second_epoch = [i for b in resumed for i in b.tolist()]
    assert sorted(second_epoch) == list(range(12))  # the next epoch is whole again


def test_a_whole_epoch_saved_resumes_at_the_next_epoch() -> None:
    done = loader(Rows(8))
    for _ in done:
        pass
    resumed = loader(Rows(8))
    resumed.load_state_dict(done.state_dict())
    assert done.state_dict() == {"batches": 4} and len(list(resumed)) == 4


# --------------------------------------------------------------------------- the guard, one rank
def write_files(where: Path) -> None:
    (where / "shards").mkdir(parents=True)
    (where / "model.bin").write_bytes(b"m" * 100)
    (where / "shards" / "__0_0.distcp").write_bytes(b"s" * 10)


# 1000 s: the gap doubles from one step (1, 2, 4, 8), up to 1000 steps
@pytest.mark.parametrize("interval, boundaries", [(0.0, 10), (1000.0, 4)], ids=["every-step", "rarely"])
def test_before_a_notice_the_guard_agrees_only_at_boundaries(tmp_path: Path, own_sigterm: None,
                                                            interval: float, boundaries: int) -> None:
    guard = PreemptionGuard(tmp_path, agree_interval_s=interval)
    guard.start(step=0, resumed=False)
    reasons = [guard.step_end(step, last=False) for step in range(1, 11)]
    assert reasons == [None] * 10 and guard.boundaries == boundaries


def test_a_fast_first_step_does_not_put_the_next_boundary_out_of_reach(tmp_path: Path, own_sigterm: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step took 1 ms (the guard's hook runs before a logger that sleeps), the others
    0.4 s: a notice after step 3 is heard at step 4. Planned from the first step alone, the next
    boundary was 500 steps on, and a preempted Hugging Face run trained on to its deadline
    without saving (the e2e test failed so on an idle machine)."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    guard = PreemptionGuard(tmp_path, agree_interval_s=0.5, preemption=_config(sigterm_grace_s=60.0))
    guard.start(step=0, resumed=False)
    reasons = []
    for step in range(1, 7):
        now[0] += 0.001 if step == 1 else 0.4
        if step == 4:
            SIGTERM.received_at = time.time()
        reasons.append(guard.step_end(step, last=False))
        if reasons[-1] == "preemption":
            break
    assert reasons == [None, None, None, "preemption"]


def test_a_sigterm_saves_the_step_then_holds_when_no_step_fits(tmp_path: Path, own_sigterm: None) -> None:
    events = []
    guard = PreemptionGuard(tmp_path / "ck", agree_interval_s=0.0, on_event=lambda name, **f: events.append(name),
                            preemption=_config(sigterm_grace_s=0.3))
    guard.start(step=0, resumed=False)
    assert guard.step_end(1, last=False) is None
    SIGTERM.received_at = time.time()  # what the flag's handler records
    assert guard.step_end(2, last=False) == "preemption"
    written = guard.store.open_partial(2)
    write_files(written)
    with pytest.raises(PreemptedError):  # outside Ray: the hold ends at the deadline
        guard.committed(written, step=2, reason="preemption", started=time.perf_counter())
    manifest = verify(tmp_path / "ck" / "step-2")
    assert manifest.reason == "preemption" and {f.path for f in manifest.files} == {"model.bin", "shards/__0_0.distcp"}
    assert not written.exists()
    assert events == ["preemption_notice", "checkpoint_committed", "waiting_for_teardown"]


def test_after_a_notice_the_guard_trains_on_while_the_deadline_leaves_room(tmp_path: Path,
                                                                          own_sigterm: None) -> None:
    guard = PreemptionGuard(tmp_path, agree_interval_s=0.0, preemption=_config(sigterm_grace_s=60.0))
    guard.start(step=0, resumed=False)
    SIGTERM.received_at = time.time()
    assert guard.step_end(1, last=False) == "preemption"
    written = guard.store.open_partial(1)
    write_files(written)
    guard.committed(written, step=1, reason="preemption", started=time.perf_counter())  # returns: room left
    assert guard.step_end(2, last=False) is None
    assert guard.step_end(3, last=True) == "final"  # the last step: saved, and the run may finish


def test_the_guard_refuses_to_start_behind_a_committed_checkpoint(tmp_path: Path, own_sigterm: None) -> None:
    (tmp_path / "step-5").mkdir()
    guard = PreemptionGuard(tmp_path)
    with pytest.raises(UsageError, match="step-5 is committed: pass the newest checkpoint"):
        guard.start(step=0, resumed=False)
    guard.start(step=5, resumed=True)


def _config(**kwargs):
    from trainer.config import PreemptionConfig

    return PreemptionConfig(**kwargs)


# --------------------------------------------------------------------------- Hugging Face settings
@pytest.mark.integration  # a Trainer made here sets up accelerate, which binds a local socket
@pytest.mark.parametrize("setting, why", [
    ({"save_only_model": True}, "save_only_model=True saves no optimizer"),
    ({"ignore_data_skip": True}, "ignore_data_skip=True makes a resumed run train its first batches again"),
])
def test_the_hf_callback_refuses_settings_that_break_an_exact_resume(tmp_path: Path, setting: dict, why: str) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainer.integrations.transformers import PreemptionCallback

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **setting)
    with pytest.raises(UsageError, match=why):
        PreemptionCallback().on_train_begin(args, TrainerState(), TrainerControl())


# --------------------------------------------------------------------------- Lightning's RNG states
@pytest.mark.parametrize("saved_world, restored", [(1, True), (2, False)], ids=["same-world", "other-world"])
def test_lightning_s_rng_states_come_back_only_at_the_same_world_size(tmp_path: Path, saved_world: int,
                                                                      restored: bool) -> None:
    from trainer.checkpoint import capture_rng, rng_file, write_manifest
    from trainer.integrations.lightning import _restore_rng

    step = tmp_path / "step-3"
    step.mkdir()
    torch.manual_seed(11)
    torch.save(capture_rng(), step / rng_file(0))
    expected = torch.rand(3)
    write_manifest(step, 3, world_size=saved_world, reason="preemption")
    torch.manual_seed(99)  # the restarted process's own state
    assert _restore_rng(step, rank=0, world_size=1) is restored
    assert torch.equal(torch.rand(3), expected) is restored
