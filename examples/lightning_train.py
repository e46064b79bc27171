"""A Lightning ``Trainer.fit()`` run on Ray Train, protected by resilienced (docs/your-trainer.md).

    python examples/lightning_train.py --checkpoint-dir /fsx/runs/pl-demo [--ray-address auto]
        [--num-workers 2] [--steps 40] [--losses-out FILE]

A ``LightningModule`` training a causal LM, run as Ray Train's Lightning guide has it:
``RayDDPStrategy`` and ``RayLightningEnvironment``, ``ray.train.lightning.prepare_trainer``,
under ``TorchTrainer``.  The model is a two-layer Llama built from a config with random weights
(a few thousand parameters, nothing downloaded) and the data synthetic tokens; put your own in
their place.  The lines that make it preemption-safe are marked ``# resilience``: the callback,
a dataloader Lightning can resume mid-epoch, and the checkpoint to resume from.

``--losses-out`` (rank 0) appends ``{"restored": N}`` once per attempt and ``{"step": N,
"loss": x}`` per step (rank 0's loss).  tests/trainer/test_lightning_callback.py runs this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.integrations.lightning import PreemptionCallback, ResumableDataLoader, newest_checkpoint  # resilience

VOCAB, SEQ = 64, 16


class TinyLM(pl.LightningModule):
    """A two-layer Llama (hidden size 16: a few thousand parameters) with AdamW and warm-up-then-decay."""

    def __init__(self, *, seed: int, losses_out: str | None = None, step_seconds: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=SEQ, tie_word_embeddings=False))
        self.losses_out, self.step_seconds = losses_out, step_seconds

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.lm(input_ids=batch, labels=batch).loss
        self._append({"step": self.global_step + 1, "loss": loss.item()})
        if self.step_seconds:  # stands in for a bigger model (the tests need time to drain a node)
            time.sleep(self.step_seconds)
        return loss

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4) * 0.95 ** s)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        self._append({"restored": self.global_step})

    def _append(self, record: dict) -> None:
        if self.losses_out and self.trainer.is_global_zero:
            with open(self.losses_out, "a") as f:
                f.write(json.dumps(record) + "\n")


def synthetic_tokens(seed: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed + 1))


def train_func(config: dict) -> None:
    """Ray Train's train_loop_per_worker (the process group is up); runs without Ray too."""
    torch.set_num_threads(1)  # bit-for-bit reproducible on CPU
    root = config["checkpoint_dir"]
    if config.get("on_ray", True):
        from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

        placement = {"devices": "auto", "strategy": RayDDPStrategy(), "plugins": [RayLightningEnvironment()]}
    else:  # local ranks (the tests' reference): the same DDP, Lightning's own environment
        from lightning.pytorch.strategies import DDPStrategy

        placement = {"devices": int(os.environ["WORLD_SIZE"]), "strategy": DDPStrategy(process_group_backend="gloo")}
    trainer = pl.Trainer(
        max_steps=config["steps"], accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **placement,
        callbacks=[PreemptionCallback(root, keep=config["keep"])],  # resilience
    )
    if config.get("on_ray", True):
        trainer = prepare_trainer(trainer)
    model = TinyLM(seed=config["seed"], losses_out=config.get("losses_out"), step_seconds=config.get("step_seconds", 0.0))
    loader = ResumableDataLoader(synthetic_tokens(config["seed"], 512), batch_size=4, shuffle=True)  # resilience
    trainer.fit(model, train_dataloaders=loader, ckpt_path=newest_checkpoint(root))  # resilience


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True, help="checkpoint root on shared storage (FSx)")
    p.add_argument("--ray-address", default=None, help="Ray cluster (default: RAY_ADDRESS or auto)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--losses-out", default=None)
    args = p.parse_args(argv)

    # Ray Train's watcher polls the GCS for drains every 5 s by default; 0.5 s hears one sooner.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.ray_address or os.environ.get("RAY_ADDRESS") or "auto")
    root = Path(args.checkpoint_dir).resolve()
    result = TorchTrainer(
        train_func,
        train_loop_config={**vars(args), "checkpoint_dir": str(root)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(name=root.name, storage_path=str(root / ".ray-train"),
                             failure_config=FailureConfig(max_failures=3, max_preemption_failures=-1)),
    ).fit()
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
