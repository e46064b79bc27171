"""Synthetic token data that is a pure function of (seed, step).

A resumed run reads exactly the batches the uninterrupted run would have read, with no data
loader state to save: the "data position" is the step number.  The global batch of a step is the
same whatever the world size; each rank takes its contiguous slice of rows, so a checkpoint saved
by 2 ranks resumes on 1 (or the other way round) on the same data.

Each row is an arithmetic progression modulo the vocabulary (random start and stride) with a
little noise, so the loss has something to learn and goes down.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A 63-bit seed for (seed, step, stream); different inputs give unrelated streams."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ step) ^ stream) & ((1 << 63) - 1)


def global_batch(*, seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """The step's whole batch: int64 tokens of shape (batch_size, seq_len + 1)."""
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    g = torch.Generator().manual_seed(step_seed(seed, step))
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    pos = torch.arange(seq_len + 1).unsqueeze(0)
    tokens = (start + stride * pos) % vocab_size
    noise = torch.rand((batch_size, seq_len + 1), generator=g) < 0.05
    random_tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
    return torch.where(noise, random_tokens, tokens)


def rank_batch(
    *, seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for the step: its contiguous slice of the global batch."""
    if batch_size % world_size:
        raise ValueError(f"batch size {batch_size} is not divisible by world size {world_size}")
    per_rank = batch_size // world_size
    rows = global_batch(seed=seed, step=step, batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    mine = rows[rank * per_rank : (rank + 1) * per_rank]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
