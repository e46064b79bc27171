"""A checkpoint that a framework wrote from every rank, committed in the layout the daemon verifies.

``CheckpointStore.commit_written`` (the framework callbacks' commit) on two local gloo ranks, with
files laid out as an FSDP save lays them (each rank its shard, in a subdirectory; rank 0 the
metadata and the trainer state): the manifest, written last, lists every file of every rank with
its size and sha256, and the directory becomes ``step-<N>`` only then.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import framework_ranks
from tests.support.ranks import run_ranks
from trainer.checkpoint import verify

pytestmark = pytest.mark.e2e  # local trainer ranks (tests/support/ranks.py)


def test_every_rank_s_files_are_listed_and_the_step_verifies(tmp_path: Path) -> None:
    paths = {r.unwrap() for r in run_ranks(framework_ranks.commit_shards, 2, str(tmp_path))}
    assert paths == {str(tmp_path / "step-3")}
    manifest = verify(tmp_path / "step-3")
    assert (manifest.step, manifest.world_size, manifest.reason) == (3, 2, "preemption")
    assert {f.path: f.size for f in manifest.files} == {
        "pytorch_model_fsdp_0/__0_0.distcp": 1000, "pytorch_model_fsdp_0/__1_0.distcp": 1001,
        "pytorch_model_fsdp_0/.metadata": 4, "rng_state_0.pth": 10, "rng_state_1.pth": 10,
        "trainer_state.json": 2,
    }
    assert not (tmp_path / "step-3.partial").exists()


def test_a_save_that_wrote_nothing_fails_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(framework_ranks.commit_nothing, 2, str(tmp_path))
    assert [r.error.split(":")[0] for r in results] == ["CheckpointError", "CheckpointError"]
    assert all("holds no file" in r.error for r in results)
    assert not (tmp_path / "step-4").exists()
