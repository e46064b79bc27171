"""Preemption-safe ``lightning.Trainer.fit()`` runs under Ray Train (docs/your-trainer.md).

::

    from trainer.integrations.lightning import PreemptionCallback, ResumableDataLoader, newest_checkpoint

    loader = ResumableDataLoader(dataset, batch_size=8, shuffle=True)                  # 1
    trainer = pl.Trainer(strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
                         callbacks=[PreemptionCallback(root)], ...)                     # 2
    trainer = ray.train.lightning.prepare_trainer(trainer)
    trainer.fit(model, loader, ckpt_path=newest_checkpoint(root))                      # 3

Lightning does the saving and most of the resuming (lightning 2.6: ``Trainer.save_checkpoint``
from ``on_train_batch_end``, as its own ``ModelCheckpoint`` does, writes the model, optimizers,
LR schedulers, loop progress and callback states; with ``RayFSDPStrategy(state_dict_type=
"sharded")`` every rank writes its shards into a directory; ``fit(ckpt_path=...)`` restores
them).  Two things it does not restore, which this module adds:

* **RNG states**: the callback writes each rank's (torch, CUDA, numpy, Python) next to
  Lightning's file (``rng-rank<R>.pt``, trainer/checkpoint.py's format) and restores them in
  ``on_train_start`` when the world size is the same;
* **the data position in the epoch**: Lightning restores it only for a train dataloader with
  ``state_dict()`` / ``load_state_dict()`` (``FitLoop._load_combined_loader_states``); a plain
  ``DataLoader`` starts the epoch over, training its first batches twice.
  :class:`ResumableDataLoader` is a ``DataLoader`` with that interface.

Each save is ``<root>/step-<N>.partial/`` (``lightning.ckpt`` and the RNG files), committed as
``step-<N>/`` with the manifest written last: the layout the daemon counts as durable.

Requires the ``lightning`` extra: ``pip install 'resilienced[lightning]'``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError as e:  # the daemon's image and the plain trainer image have no lightning
    raise ImportError(
        "trainer.integrations.lightning needs PyTorch Lightning: install the extra with "
        "pip install 'resilienced[lightning]'"
    ) from e

from torch.utils.data import DataLoader

from trainer.checkpoint import MANIFEST, Manifest, capture_rng, restore_rng, rng_file
from trainer.config import PreemptionConfig
from trainer.integrations.guard import EventHook, PreemptionGuard, resume_point

__all__ = ["CHECKPOINT_NAME", "PreemptionCallback", "ResumableDataLoader", "newest_checkpoint"]

log = logging.getLogger(__name__)

#: Lightning's checkpoint inside a step directory (a file; a directory for sharded FSDP).
CHECKPOINT_NAME = "lightning.ckpt"

_DEFAULTS = PreemptionConfig()


def newest_checkpoint(root: str | Path) -> str | None:
    """The ``ckpt_path`` for ``Trainer.fit``: Lightning's checkpoint in the newest ``step-<N>``
    under ``root`` that verifies (None: start afresh).  Collective (every rank, process group up)."""
    point = resume_point(Path(root).resolve())
    return None if point is None else str(point.path / CHECKPOINT_NAME)


class ResumableDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` whose position in the epoch Lightning saves and restores.

    Same arguments as ``DataLoader`` (Lightning re-creates it with its distributed sampler, as it
    does a ``DataLoader``).  ``state_dict()`` is the number of batches served in this epoch;
    after ``load_state_dict()`` the next iteration skips that many batches of the epoch's order
    without loading them (the batch sampler's indices are dropped), so a run resumed mid-epoch
    trains the batches an uninterrupted run would.  Lightning 2.6 fetches no batch ahead from a
    loader with a length (``_PrefetchDataFetcher``), so the count is the batches trained.
    """

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(self.__dict__.get("_served", 0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        served = int(state["batches"])
        self.__dict__["_resume_at"] = served if served < len(self) else 0  # a whole epoch: the next starts afresh

    @property
    def _index_sampler(self):  # DataLoader's own (torch/utils/data/dataloader.py), skipping on resume
        sampler = super()._index_sampler
        skip = self.__dict__.get("_skip_now", 0)
        return _Skipping(sampler, skip) if skip else sampler

    def __iter__(self):
        skip = self.__dict__.pop("_resume_at", 0)
        self.__dict__["_skip_now"] = skip
        try:
            inner = super().__iter__()  # the iterator takes the (skipping) index sampler now
        finally:
            self.__dict__["_skip_now"] = 0
        self.__dict__["_served"] = skip
        return _Counting(self, inner)


class _Skipping:
    """A batch sampler without its first ``skip`` batches (drawn lazily: the epoch is set by then)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self):
        for i, indices in enumerate(self.sampler):
            if i >= self.skip:
                yield indices

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)


class _Counting:
    def __init__(self, loader: ResumableDataLoader, inner: Any) -> None:
        self.loader, self.inner = loader, inner

    def __iter__(self) -> "_Counting":
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.loader.__dict__["_served"] += 1
        return batch

    def __len__(self) -> int:
        return len(self.loader)


class PreemptionCallback(pl.Callback):
    """Saves the step ``fit()`` is on at a preemption notice, commits it durably, and holds.

    Args:
        checkpoint_dir: the checkpoint root on shared storage (FSx): ``step-<N>/`` go here.
        keep: committed checkpoints kept.
        agree_interval_s, save_margin_factor, save_margin_s, sigterm_grace_s, no_deadline_s,
        teardown_timeout_s: as :class:`trainer.resilience.Checkpointer`'s.
        on_event: ``on_event(name, **fields)`` on every rank.

    The run's last step is always saved (reason ``final``).  Lightning's own ``ModelCheckpoint``
    may stay (its files are not committed checkpoints: the daemon does not count them).
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        keep: int = 3,
        agree_interval_s: float = 0.5,
        save_margin_factor: float = _DEFAULTS.save_margin_factor,
        save_margin_s: float = _DEFAULTS.save_margin_s,
        sigterm_grace_s: float = _DEFAULTS.sigterm_grace_s,
        no_deadline_s: float = _DEFAULTS.no_deadline_s,
        teardown_timeout_s: float = _DEFAULTS.teardown_timeout_s,
        on_event: EventHook | None = None,
    ) -> None:
        super().__init__()
        self.guard = PreemptionGuard(
            Path(checkpoint_dir).resolve(), keep=keep, agree_interval_s=agree_interval_s, on_event=on_event,
            preemption=PreemptionConfig(save_margin_factor=save_margin_factor, save_margin_s=save_margin_s,
                                        sigterm_grace_s=sigterm_grace_s, no_deadline_s=no_deadline_s,
                                        teardown_timeout_s=teardown_timeout_s),
        )
        self.rng_restored = False
        """Whether ``on_train_start`` restored this rank's RNG states (same world size only)."""

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        resumed_from = Path(trainer.ckpt_path).parent if trainer.ckpt_path else None
        self.guard.start(step=trainer.global_step, resumed=resumed_from is not None)
        if resumed_from is not None:
            self.rng_restored = _restore_rng(resumed_from, rank=self.guard.rank, world_size=self.guard.world_size)
        loaders = trainer.train_dataloader
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        if self.guard.rank == 0 and not all(callable(getattr(dl, "load_state_dict", None)) for dl in loaders):
            log.warning("the train dataloader is not resumable (no state_dict/load_state_dict): a run resumed "
                        "mid-epoch trains the epoch's first batches again; use ResumableDataLoader")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.guard.step:  # gradient accumulation: no optimizer step in this batch
            return
        last = 0 < trainer.max_steps <= step
        reason = self.guard.step_end(step, last=last)
        if reason is not None:
            self._save(trainer, step=step, reason=reason, last=last)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.guard.store is not None and self.guard.last_saved != trainer.global_step:
            self._save(trainer, step=trainer.global_step, reason="final", last=True)

    def _save(self, trainer: "pl.Trainer", *, step: int, reason: str, last: bool) -> None:
        started = time.perf_counter()
        assert self.guard.store is not None
        partial = self.guard.store.open_partial(step)
        trainer.save_checkpoint(partial / CHECKPOINT_NAME)  # collective; rank 0 writes unless sharded
        torch.save(capture_rng(), partial / rng_file(self.guard.rank))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
        self.guard.committed(partial, step=step, reason=reason, started=started, metrics=metrics, last=last)


def _restore_rng(step_dir: Path, *, rank: int, world_size: int) -> bool:
    """This rank's RNG states from a committed step directory, when it was saved at this world size."""
    manifest = Manifest.parse((step_dir / MANIFEST).read_text(), where=str(step_dir))
    path = step_dir / rng_file(rank)
    if manifest.world_size != world_size or not path.exists():
        return False
    restore_rng(torch.load(path, weights_only=True))
    return True
