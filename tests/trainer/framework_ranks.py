"""Rank functions for ``tests.support.ranks.run_ranks``: the framework examples without Ray.

``examples/hf_trainer_train.py`` and ``examples/lightning_train.py`` run their train function on
local gloo ranks (the uninterrupted reference of the Ray tests).  accelerate and Lightning read
the rank layout from the environment that Ray Train (and torchrun) set; the process group is up
already (``run_ranks``), so neither starts another.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))


def _environment(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0")


def hf(rank: int, world_size: int, cfg: dict[str, Any]) -> None:
    _environment(rank, world_size)
    import hf_trainer_train

    hf_trainer_train.train_func({**cfg, "on_ray": False})


def hf_evicted(rank: int, world_size: int, cfg: dict[str, Any]) -> None:
    """``hf`` evicted as a pod is outside Ray: rank ``cfg["evict_rank"]`` gets SIGTERM once rank 0
    logged step ``cfg["evict_after"]`` (a thread watching the losses file, so the signal lands
    wherever the rank is), and the callback gives a SIGTERM ``cfg["sigterm_grace_s"]`` of grace
    (``PreemptionCallback(sigterm_grace_s=...)``, as a user sets it)."""
    import functools
    import json
    import signal
    import threading
    import time

    _environment(rank, world_size)
    import hf_trainer_train
    from trainer.integrations.transformers import PreemptionCallback

    hf_trainer_train.PreemptionCallback = functools.partial(PreemptionCallback, sigterm_grace_s=cfg["sigterm_grace_s"])
    if rank == cfg["evict_rank"]:
        losses = Path(cfg["losses_out"])

        def evict() -> None:
            while not any(json.loads(x).get("step", 0) >= cfg["evict_after"]
                          for x in (losses.read_text().splitlines() if losses.exists() else [])):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=evict, daemon=True).start()
    hf_trainer_train.train_func({**cfg, "on_ray": False})


def lightning(rank: int, world_size: int, cfg: dict[str, Any]) -> None:
    _environment(rank, world_size)
    import lightning_train

    lightning_train.train_func({**cfg, "on_ray": False})


def commit_shards(rank: int, world_size: int, root: str) -> str:
    """Every rank writes its shards into a step directory, as a framework's FSDP save does; commit."""
    import time

    import torch.distributed as dist

    from trainer.checkpoint import CheckpointStore

    store = CheckpointStore(root=Path(root), rank=rank, world_size=world_size, group=dist.new_group(backend="gloo"))
    written = store.open_partial(3)
    (written / "pytorch_model_fsdp_0").mkdir(exist_ok=True)
    (written / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (1000 + rank))
    (written / f"rng_state_{rank}.pth").write_bytes(b"r" * 10)
    if rank == 0:
        (written / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"meta")
        (written / "trainer_state.json").write_text("{}")
    return str(store.commit_written(written, step=3, reason="preemption", started=time.perf_counter()).path)


def commit_nothing(rank: int, world_size: int, root: str) -> None:
    """A save that wrote no file: every rank must fail, none wait for the others."""
    import time

    import torch.distributed as dist

    from trainer.checkpoint import CheckpointStore

    store = CheckpointStore(root=Path(root), rank=rank, world_size=world_size, group=dist.new_group(backend="gloo"))
    store.commit_written(store.open_partial(4), step=4, reason="preemption", started=time.perf_counter())
