"""Your own Ray Train script, protected by resilienced: a complete example (docs/your-trainer.md).

    python examples/resilient_train.py --checkpoint-dir /fsx/runs/demo [--ray-address auto]
        [--num-workers 2] [--steps 60] [--every 10] [--wrap fsdp2|ddp|plain] [--losses-out FILE]

A small residual MLP classifier on synthetic data (a pure function of seed and step), trained
with AdamW and a warm-up-then-decay ``LambdaLR``, wrapped with FSDP2, DDP, or left plain (the
gradients then averaged by hand).  The lines that make it preemption-safe are marked
``# resilience``: build the ``state`` dict, make a ``Checkpointer``, ``restore`` before the
loop, ``after_step`` after every optimizer step, ``finish`` at the end.  Everything else is an
ordinary Ray Train (V2) script; as a RayJob entrypoint it runs unchanged.

``--losses-out`` (rank 0) appends ``{"restored": N, "ray_checkpoint": M}`` once per attempt
and ``{"step": N, "loss": x}`` per step; ``--result-out`` gets the driver's view of the run
(Ray Train's last checkpoint and metrics).  tests/trainer/test_your_trainer.py runs this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.resilience import Checkpointer  # resilience

FEATURES, CLASSES, HIDDEN, BLOCKS = 24, 5, 64, 3


class Residual(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.relu(self.fc1(self.norm(x)))))


class Classifier(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.blocks = nn.ModuleList(Residual(dropout) for _ in range(BLOCKS))
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batch(seed: int, step: int, rank: int, world_size: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch: the same rows whatever the world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, FEATURES, generator=g)
    w = torch.Generator().manual_seed(seed)
    labels = (x @ torch.randn(FEATURES, CLASSES, generator=w)).argmax(dim=1)
    per_rank = size // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], labels[rows]


def wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model  # plain: a full replica per rank, gradients averaged in train_one_step


def train_one_step(model: nn.Module, optim: torch.optim.Optimizer, x, y, *, average_grads: bool) -> float:
    model.train()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    world_size = dist.get_world_size()
    if average_grads and world_size > 1:  # gloo has no AVG: sum, then divide
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
    optim.step()
    optim.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.item()) / world_size


def _append(path: str | None, record: dict) -> None:
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _ray_checkpoint_step() -> int | None:
    """The step of the checkpoint Ray Train last saw (its pointer), when running on Ray Train."""
    try:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
    except RuntimeError:  # not in a Ray Train worker (the tests also run this function without Ray)
        return None
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        return json.loads((Path(d) / "pointer.json").read_text())["step"]


def train_func(config: dict) -> None:
    """Ray Train's train_loop_per_worker: the process group is up when it starts."""
    torch.set_num_threads(1)  # bit-for-bit reproducible on CPU
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config["seed"])  # the same initial weights on every rank
    model = wrap(Classifier(config.get("dropout", 0.1)), config["wrap"])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10) * 0.97 ** s)
    torch.manual_seed(config["seed"] + 1 + rank)  # dropout differs per rank (restored on resume)

    state = {"model": model, "optim": optim, "sched": sched}  # resilience
    ckpt = Checkpointer(config["checkpoint_dir"], every=config["every"], keep=config["keep"],  # resilience
                        total_steps=config["steps"])
    step = ckpt.restore(state)  # resilience: steps already trained (0 when nothing is saved)
    _append(config.get("losses_out"), {"restored": step, "ray_checkpoint": _ray_checkpoint_step()})

    while step < config["steps"]:
        x, y = batch(config["seed"], step + 1, rank, world_size)
        loss = train_one_step(model, optim, x, y, average_grads=config["wrap"] == "plain")
        sched.step()
        step += 1
        _append(config.get("losses_out"), {"step": step, "loss": loss})
        if config.get("step_seconds"):  # stands in for a bigger model (tests need time to drain)
            time.sleep(config["step_seconds"])
        ckpt.after_step(step, state, metrics={"loss": loss})  # resilience
    ckpt.finish(state)  # resilience


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True, help="checkpoint root on shared storage (FSx)")
    p.add_argument("--ray-address", default=None, help="Ray cluster (default: RAY_ADDRESS or auto)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="periodic checkpoint every N steps")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--wrap", choices=("fsdp2", "ddp", "plain"), default="fsdp2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--losses-out", default=None)
    p.add_argument("--result-out", default=None)
    args = p.parse_args(argv)

    # Ray Train's watcher polls the GCS for drains every 5 s by default; 0.5 s hears one sooner.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.ray_address or os.environ.get("RAY_ADDRESS") or "auto")
    root = Path(args.checkpoint_dir).resolve()
    config = {**vars(args), "checkpoint_dir": str(root)}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(
            name=root.name,
            storage_path=str(root / ".ray-train"),  # Ray Train's pointers, next to the checkpoints
            failure_config=FailureConfig(max_failures=3, max_preemption_failures=-1),
            checkpoint_config=CheckpointConfig(num_to_keep=args.keep),
        ),
    )
    result = trainer.fit()
    pointer = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as d:
            pointer = json.loads((Path(d) / "pointer.json").read_text())
    if args.result_out:
        Path(args.result_out).write_text(json.dumps({"pointer": pointer, "metrics": result.metrics,
                                                     "error": str(result.error) if result.error else None}))
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
