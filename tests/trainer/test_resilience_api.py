"""``trainer.resilience``: the public checkpointer API, on a model and data that are not trainer/'s.

The model and the train function are examples/resilient_train.py's (a residual MLP classifier,
AdamW, a ``LambdaLR`` whose factor changes every step), run as they are on local ranks with a
real gloo process group (``tests.support.ranks``); wrong use is checked in this process, with no
process group at all.  The drained-and-resumed run on a real multi-node Ray cluster is in
test_your_trainer.py.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import example_ranks
from tests.support.ranks import run_ranks
from trainer.errors import CheckpointError, CorruptCheckpoint, StateError, UsageError
from trainer.resilience import Checkpointer, verify, write_manifest

pytestmark = pytest.mark.unit


def read_losses(path: Path) -> tuple[list[dict], list[int]]:
    """(step lines, restored steps) of the example's --losses-out file."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [x for x in lines if "step" in x], [x["restored"] for x in lines if "restored" in x]


def train(world_size: int, cfg: dict, target=example_ranks.train, *args) -> list:
    return run_ranks(target, world_size, cfg, *args)


# ---------------------------------------------------------------------- exactness (local ranks)
@pytest.mark.e2e
# DDP: saved in the next test, resumed in test_framework_callbacks. The plain module's run is in
# make test-long (docs/development.md, "Long stories"): make test resumes a plain module exactly in
# the next test, and runs this story with FSDP2.
@pytest.mark.parametrize("wrap", ["fsdp2", pytest.param("plain", marks=pytest.mark.long(
    "tests/trainer/test_resilience_api.py::test_a_resumed_run_trains_each_step_once_and_reproduces_every_loss_bit_for_bit[fsdp2]",
    "tests/trainer/test_resilience_api.py::test_a_checkpoint_of_two_ranks_resumes_on_one[ddp-plain]"))])
def test_a_resumed_run_trains_each_step_once_and_reproduces_every_loss_bit_for_bit(tmp_path: Path, wrap: str) -> None:
    reference = example_ranks.config(tmp_path / "ref", tmp_path / "ref.jsonl", steps=10, wrap=wrap)
    for result in train(2, reference):
        result.unwrap()
    cfg = example_ranks.config(tmp_path / "ck", tmp_path / "run.jsonl", steps=4, wrap=wrap)
    for steps in (4, 10):
        for result in train(2, {**cfg, "steps": steps}):
            result.unwrap()

    expected, _ = read_losses(tmp_path / "ref.jsonl")
    got, restored = read_losses(tmp_path / "run.jsonl")
    assert restored == [0, 4]
    assert Counter(x["step"] for x in got) == {s: 1 for s in range(1, 11)}  # no step trained twice
    assert got == expected  # model, AdamW, the LR schedule and every rank's dropout RNG restored
    assert verify(tmp_path / "ck" / "step-4").reason == "final"


@pytest.mark.e2e
@pytest.mark.parametrize(("saved_as", "resumed_as"), [("fsdp2", "fsdp2"), ("ddp", "plain")])
def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path: Path, saved_as: str, resumed_as: str) -> None:
    reference = example_ranks.config(tmp_path / "ref", tmp_path / "ref.jsonl", steps=8, wrap=saved_as, dropout=0.0)
    for result in train(2, reference):
        result.unwrap()
    cfg = example_ranks.config(tmp_path / "ck", tmp_path / "run.jsonl", steps=4, wrap=saved_as, dropout=0.0)
    for result in train(2, cfg):
        result.unwrap()
    train(1, {**cfg, "steps": 8, "wrap": resumed_as})[0].unwrap()

    expected, _ = read_losses(tmp_path / "ref.jsonl")
    got, restored = read_losses(tmp_path / "run.jsonl")
    assert restored == [0, 4]
    assert verify(tmp_path / "ck" / "step-4").world_size == 2 and verify(tmp_path / "ck" / "step-8").world_size == 1
    # The same weights, AdamW state and schedule in another layout: equal to float32 rounding
    # (the reduction order differs).  Lost optimizer or scheduler state would show at once.
    for mine, theirs in zip(got, expected, strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=2e-5), mine["step"]


@pytest.mark.e2e
def test_a_checkpoint_torn_mid_save_or_damaged_after_it_is_never_restored(tmp_path: Path) -> None:
    cfg = example_ranks.config(tmp_path / "ck", tmp_path / "run.jsonl", steps=12, every=4)
    reference = example_ranks.config(tmp_path / "ref", tmp_path / "ref.jsonl", steps=14)
    for result in train(2, reference):
        result.unwrap()
    crashed = train(2, cfg, example_ranks.train_and_crash, "manifest-torn", 8)
    assert crashed[0].exitcode == 70  # rank 0 died with manifest.json.tmp half way
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-4", "step-8.partial"]

    for result in train(2, cfg):
        result.unwrap()
    _, restored = read_losses(tmp_path / "run.jsonl")
    assert restored == [0, 4]  # the torn step 8 was skipped (and deleted), step 4 restored

    damaged = tmp_path / "ck" / "step-12" / "__1_0.distcp"
    damaged.write_bytes(damaged.read_bytes()[:-1])  # committed, then damaged on storage
    for result in train(2, {**cfg, "steps": 14}):
        result.unwrap()
    got, restored = read_losses(tmp_path / "run.jsonl")
    assert restored == [0, 4, 8]
    assert verify(tmp_path / "ck" / "step-12").reason == "periodic"  # rejected, deleted, saved anew
    expected, _ = read_losses(tmp_path / "ref.jsonl")
    last = {x["step"]: x["loss"] for x in got}  # each step's last attempt
    assert last == {x["step"]: x["loss"] for x in expected}


@pytest.mark.e2e
def test_ranks_that_disagree_on_the_step_fail_together_naming_it(tmp_path: Path) -> None:
    results = run_ranks(example_ranks.disagree_on_the_step, 2, str(tmp_path / "ck"))
    for r in results:
        assert r.error is not None and r.error.startswith("UsageError: ranks disagree on the step")
        assert "steps 1 to 2" in r.error


# ---------------------------------------------------------------------- one process, no group
def small_state() -> dict:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched}


def one_step(state: dict) -> None:
    state["model"](torch.ones(4, 3)).sum().backward()
    state["optim"].step()
    state["optim"].zero_grad()
    state["sched"].step()


def test_without_a_process_group_it_saves_and_restores_one_process(tmp_path: Path, own_sigterm) -> None:
    torch.manual_seed(0)
    state = small_state()
    ckpt = Checkpointer(tmp_path, every=2)
    assert ckpt.restore(state) == 0 and ckpt.restored_from is None
    for step in (1, 2, 3):
        one_step(state)
        ckpt.after_step(step, state)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2"]
    ckpt.finish(state)

    fresh = small_state()
    again = Checkpointer(tmp_path)
    assert again.restore(fresh) == 3 and again.restored_from == tmp_path / "step-3"
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert fresh["sched"].get_last_lr() == state["sched"].get_last_lr() == [0.1 * 0.5**3]
    assert fresh["optim"].state_dict()["state"][0]["step"] == 3


class NotSaveable:
    pass


def linear_and_foreign_optimizer() -> dict:
    other = torch.nn.Linear(2, 2)
    return {"model": torch.nn.Linear(2, 2), "optim": torch.optim.SGD(other.parameters(), lr=0.1)}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (lambda: {"model": torch.nn.Linear(2, 2), "thing": NotSaveable()},
         "state['thing']: cannot save a value of type NotSaveable"),
        (lambda: {"model": torch.nn.Linear(2, 2), "count": 3}, "state['count']: cannot save a value of type int"),
        (linear_and_foreign_optimizer, "state['optim']: the optimizer updates parameters of no module in state"),
        (lambda: {"a.b": torch.nn.Linear(2, 2)}, "state['a.b']: names must be non-empty strings without '.'"),
        (lambda: {"checkpointer": torch.nn.Linear(2, 2)}, "state['checkpointer']: this name is the checkpointer's own"),
        (lambda: {}, "state: must be a non-empty dict"),
        (lambda: [torch.nn.Linear(2, 2)], "state: must be a non-empty dict"),
    ],
    ids=["no-state-dict", "plain-int", "optimizer-without-its-module", "dot-in-name", "reserved-name", "empty",
         "not-a-dict"],
)
def test_state_it_cannot_save_is_refused_naming_the_entry(tmp_path: Path, own_sigterm, state, message: str) -> None:
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(StateError, match="^" + _escape(message)):
        ckpt.restore(state())
    assert list(tmp_path.glob("step-*")) == []


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ((1, 1), r"after_step\(step=1\): the step does not advance \(the last was 1\)"),
        ((2, 1), r"after_step\(step=1\): the step does not advance \(the last was 2\)"),
        ((0,), r"after_step\(step=0\): the step does not advance \(the last was 0\)"),
        ((True,), r"after_step\(step=True\): step must be an int"),
    ],
    ids=["repeated", "backwards", "zero", "bool"],
)
def test_a_step_that_does_not_advance_is_refused(tmp_path: Path, own_sigterm, steps, message: str) -> None:
    state = small_state()
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(state)
    with pytest.raises(UsageError, match=message):
        for step in steps:
            ckpt.after_step(step, state)


def test_calls_out_of_order_are_refused(tmp_path: Path, own_sigterm) -> None:
    state = small_state()
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(UsageError, match=r"after_step\(\) before restore\(\)"):
        ckpt.after_step(1, state)
    ckpt.restore(state)
    with pytest.raises(UsageError, match=r"restore\(\) was called already"):
        ckpt.restore(state)
    ckpt.after_step(1, state)
    ckpt.finish(state)
    with pytest.raises(UsageError, match=r"after_step\(\) after finish\(\)"):
        ckpt.after_step(2, state)


def test_a_root_that_is_not_writable_is_refused_at_once(tmp_path: Path, own_sigterm) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=rf"checkpoint root {blocker}/ck is not writable \(rank 0: "):
        Checkpointer(blocker / "ck")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"every": -1}, "every must be >= 0"), ({"keep": 0}, "keep must be >= 1"),
     ({"every": 2.5}, "every must be an int"), ({"save_margin_factor": 0.5}, "save_margin_factor must be >= 1"),
     ({"sigterm_grace_s": 0}, "sigterm_grace_s must be a positive number")],
    ids=["negative-every", "keep-zero", "float-every", "factor-below-one", "no-grace"],
)
def test_bad_arguments_are_refused_naming_them(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        Checkpointer(tmp_path, **kwargs)


# ---------------------------------------------------------------------- write_manifest / verify
def test_a_checkpoint_written_another_way_counts_once_write_manifest_ran(tmp_path: Path) -> None:
    step_dir = tmp_path / "step-7"
    (step_dir / "shards").mkdir(parents=True)
    (step_dir / "shards" / "model.bin").write_bytes(b"weights" * 100)
    (step_dir / "optim.bin").write_bytes(b"adam")
    with pytest.raises(CorruptCheckpoint, match="manifest.json is missing"):
        verify(step_dir)

    manifest = write_manifest(step_dir, 7, world_size=4, reason="preemption")

    assert verify(step_dir) == manifest
    assert {(f.path, f.size) for f in manifest.files} == {("shards/model.bin", 700), ("optim.bin", 4)}
    assert (manifest.step, manifest.world_size, manifest.reason) == (7, 4, "preemption")
    (step_dir / "optim.bin").write_bytes(b"ADAM")
    with pytest.raises(CorruptCheckpoint, match="optim.bin sha256"):
        verify(step_dir)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [((-1,), {}, ValueError, "step must be a non-negative int"),
     ((1,), {"reason": "because"}, ValueError, "unknown checkpoint reason"),
     ((1,), {"world_size": 0}, ValueError, "world_size must be a positive int")],
    ids=["negative-step", "unknown-reason", "no-ranks"],
)
def test_write_manifest_refuses_bad_arguments(tmp_path: Path, args, kwargs, error, message: str) -> None:
    (tmp_path / "data").write_bytes(b"x")
    with pytest.raises(error, match=message):
        write_manifest(tmp_path, *args, **kwargs)
    assert not (tmp_path / "manifest.json").exists()


def _escape(text: str) -> str:
    import re

    return re.escape(text)
