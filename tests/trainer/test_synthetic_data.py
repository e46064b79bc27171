"""The data is a pure function of (seed, step), whatever the world size."""

from __future__ import annotations

import torch

from trainer.data import global_batch, rank_batch
import pytest

pytestmark = pytest.mark.unit

SHAPE = dict(batch_size=8, seq_len=16, vocab_size=64)


def test_a_step_reads_the_same_batch_every_time() -> None:
    a = global_batch(seed=3, step=17, **SHAPE)
    b = global_batch(seed=3, step=17, **SHAPE)
    assert torch.equal(a, b) and a.shape == (8, 17) and a.dtype == torch.int64


def test_steps_and_seeds_read_different_batches() -> None:
    base = global_batch(seed=3, step=17, **SHAPE)
    assert not torch.equal(base, global_batch(seed=3, step=18, **SHAPE))
    assert not torch.equal(base, global_batch(seed=4, step=17, **SHAPE))


def test_the_rank_slices_make_up_the_global_batch_for_any_world_size() -> None:
    whole = global_batch(seed=0, step=5, **SHAPE)
    for world_size in (1, 2, 4):
        parts = [rank_batch(seed=0, step=5, rank=r, world_size=world_size, **SHAPE) for r in range(world_size)]
        inputs = torch.cat([p[0] for p in parts])
        targets = torch.cat([p[1] for p in parts])
        assert torch.equal(inputs, whole[:, :-1]) and torch.equal(targets, whole[:, 1:])


def test_the_data_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    global_batch(seed=0, step=1, **SHAPE)
    assert torch.equal(torch.rand(3), expected)
