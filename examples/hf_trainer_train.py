"""A Hugging Face ``Trainer`` run on Ray Train, protected by resilienced (docs/your-trainer.md).

    python examples/hf_trainer_train.py --checkpoint-dir /fsx/runs/hf-demo [--ray-address auto]
        [--num-workers 2] [--steps 40] [--every 0] [--losses-out FILE]

A causal LM fine-tuning run as teams write it: ``transformers.Trainer`` with ``TrainingArguments``
under Ray Train's ``TorchTrainer`` (``ray.train.huggingface.transformers.prepare_trainer``),
DDP across the workers.  The model is a two-layer Qwen2 built from a config with random weights
(a few thousand parameters, nothing downloaded) and the data synthetic tokens, so that it runs
anywhere; put your own model and dataset in their place.  The lines that make it
preemption-safe are marked ``# resilience``: the callback, and the checkpoint to resume from.

``--losses-out`` (rank 0) appends ``{"restored": N}`` once per attempt and ``{"step": N,
"loss": x}`` per step (the Trainer's logged loss: the mean over the ranks, not rounded).
tests/trainer/test_framework_callbacks.py runs this file on Ray, and its train function on local ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainerCallback, TrainingArguments

from trainer.integrations.transformers import PreemptionCallback, newest_checkpoint  # resilience

VOCAB, SEQ = 64, 16


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    """Two decoder layers, hidden size 16: 6,800 parameters with random weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def synthetic_dataset(seed: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """Token sequences drawn from a fixed seed; each its own label (causal LM)."""
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    return [{"input_ids": row, "labels": row} for row in tokens]


class LossRecorder(TrainerCallback):
    """Rank 0 writes the attempt's starting step and each step's logged loss (the tests read them)."""

    def __init__(self, path: str | None, step_seconds: float) -> None:
        self.path, self.step_seconds = path, step_seconds

    def _append(self, state, record: dict) -> None:
        if self.path and state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._append(state, {"restored": state.global_step})

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_seconds:  # stands in for a bigger model (the tests need time to drain a node)
            time.sleep(self.step_seconds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._append(state, {"step": state.global_step, "loss": logs["loss"]})


def train_func(config: dict) -> None:
    """Ray Train's train_loop_per_worker (the process group is up); runs without Ray too."""
    torch.set_num_threads(1)  # bit-for-bit reproducible on CPU
    args = TrainingArguments(
        output_dir=config["checkpoint_dir"],  # the checkpoint root, on shared storage (FSx)
        max_steps=config["steps"], per_device_train_batch_size=4, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.01, seed=config["seed"],
        logging_steps=1, save_strategy="steps" if config["every"] else "no", save_steps=config["every"] or 500,
        use_cpu=not torch.cuda.is_available(), report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=tiny_model(config["seed"]), args=args, train_dataset=synthetic_dataset(config["seed"], 512),
        callbacks=[PreemptionCallback(keep=config["keep"]),  # resilience
                   LossRecorder(config.get("losses_out"), config.get("step_seconds", 0.0))],
    )
    if config.get("on_ray", True):
        from ray.train.huggingface.transformers import prepare_trainer

        trainer = prepare_trainer(trainer)
    trainer.train(resume_from_checkpoint=newest_checkpoint(args.output_dir))  # resilience


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True, help="checkpoint root on shared storage (the output_dir)")
    p.add_argument("--ray-address", default=None, help="Ray cluster (default: RAY_ADDRESS or auto)")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=0, help="the Trainer's own save_steps (0: none)")
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
