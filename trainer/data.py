"""Synthetic token data that is a pure function of (seed, step).

A resumed run reads exactly the batches the uninterrupted run would have read, with no data
loader state to save: the "data position" is the step number.  The global batch of a step is the
same whatever the world size; each rank takes its contiguous share of rows (:func:`batch_share`),
so a checkpoint saved by 3 ranks resumes on 2 (or the other way round) on the same data: an
elastic run trains the samples of an uninterrupted one.

When the global batch does not divide evenly over the ranks (8 rows over 3 ranks), the shares are
uneven (3, 3, 2: the first ``batch % world`` ranks take one row more) and each rank weights its
mean loss by :func:`loss_weight` (its rows x world size / batch), so that the gradient averaged
over the ranks (FSDP2's and DDP's reduction) is the gradient of the mean over the whole batch, as
on any other world size.  When it divides evenly the weight is exactly 1.0 and nothing changes.

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


def batch_share(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch of ``batch_size`` that ``rank`` of ``world_size`` trains.

    Contiguous, in rank order, every row exactly once; the first ``batch_size % world_size`` ranks
    take one row more.  Raises ``ValueError`` when a rank would get no row (``batch_size <
    world_size``) or the rank is not in ``[0, world_size)``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of a world of {world_size}")
    if batch_size < world_size:
        raise ValueError(f"a global batch of {batch_size} leaves ranks of a world of {world_size} without a row")
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def loss_weight(batch_size: int, rank: int, world_size: int) -> float:
    """The factor of this rank's mean loss that makes the ranks' average the whole batch's mean.

    ``rows x world_size / batch_size``: exactly 1.0 when the batch divides evenly.
    """
    start, stop = batch_share(batch_size, rank, world_size)
    rows = stop - start
    return 1.0 if rows * world_size == batch_size else rows * world_size / batch_size


def rank_batch(
    *, seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for the step: its share of the global batch (:func:`batch_share`)."""
    start, stop = batch_share(batch_size, rank, world_size)
    rows = global_batch(seed=seed, step=step, batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    mine = rows[start:stop]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
