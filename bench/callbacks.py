"""The framework callbacks' cost per step with no notice, on a 100 ms step.

    python bench/callbacks.py [--blocks 6] [--steps 40]

Two local gloo ranks (processes of their own, one thread each, DDP) run the repository's examples'
tiny models: ``transformers.Trainer`` (examples/hf_trainer_train.py's Qwen2) and
``lightning.Trainer.fit`` (examples/lightning_train.py's Llama), each step padded with a sleep to
about 100 ms (the real compute is a few ms).  For each framework, ``--blocks`` pairs of runs of
``--steps`` steps, one with ``PreemptionCallback`` and one without (the baseline: the same
script), in alternating order, after an unmeasured warm-up pair.  Measured on rank 0:

* the step, from one step's end to the next, at the last callback (the baseline's and the
  callback's runs, median over the steps of every block);
* the callback's own time in its per-step hook (``on_step_end`` / ``on_train_batch_end``: the
  ``after_step`` equivalent: a boundary every ``k`` steps with the notice poll and one all-reduce
  of nine float64 on gloo, a clock read otherwise), mean over every step.

Printed per framework: the hook's mean time as a fraction of the baseline step (goal < 1 %), the
share of steps that were boundaries, and with / without of the median step (end to end: the
step's own noise on a shared machine is of the same order).  No notice comes and the callbacks
save only the last step (not timed: the steps measured end before it).  Figures go to
docs/benchmarks.md (## Framework callbacks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

PAD_S = 0.095  # + a few ms of compute: a step of about 100 ms


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- Hugging Face
def _hf_run(root: Path, steps: int, use: bool) -> dict[str, list[float]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_trainer_train as ex
    from trainer.integrations.transformers import PreemptionCallback

    times: dict[str, list[float]] = {"step_s": [], "hook_s": [], "boundaries": []}

    class Timed(PreemptionCallback):
        def on_step_end(self, args, state, control, **kwargs):
            t = time.perf_counter()
            out = super().on_step_end(args, state, control, **kwargs)
            if state.global_step < steps:  # the last step is saved (not the cost of a step)
                times["hook_s"].append(time.perf_counter() - t)
            times["boundaries"][:] = [self.guard.boundaries]
            return out

    class Pad(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(PAD_S)

    class Clock(TrainerCallback):
        last = None

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            if self.last is not None and state.global_step < steps:  # the last step saves: not timed
                times["step_s"].append(now - self.last)
            self.last = now

    args = TrainingArguments(output_dir=str(root), max_steps=steps, per_device_train_batch_size=4, seed=0,
                             save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    callbacks = [Pad(), *([Timed(keep=1)] if use else []), Clock()]
    Trainer(model=ex.tiny_model(0), args=args, train_dataset=ex.synthetic_dataset(0, 4096), callbacks=callbacks).train()
    return times


# --------------------------------------------------------------------------- Lightning
def _lightning_run(root: Path, steps: int, use: bool) -> dict[str, list[float]]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_train as ex
    from trainer.integrations.lightning import PreemptionCallback, ResumableDataLoader

    times: dict[str, list[float]] = {"step_s": [], "hook_s": [], "boundaries": []}

    class Timed(PreemptionCallback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            t = time.perf_counter()
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if trainer.global_step < steps:  # the last step is saved here (not the cost of a step)
                times["hook_s"].append(time.perf_counter() - t)
            times["boundaries"][:] = [self.guard.boundaries]

    class Clock(pl.Callback):
        last = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            if self.last is not None and trainer.global_step < steps:
                times["step_s"].append(now - self.last)
            self.last = now

    os.environ["WORLD_SIZE"] = "2"  # Lightning's environment deletes it at the end of each fit()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=2,
                         strategy=DDPStrategy(process_group_backend="gloo"), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[*([Timed(root, keep=1)] if use else []), Clock()])
    model = ex.TinyLM(seed=0, step_seconds=PAD_S)
    trainer.fit(model, train_dataloaders=ResumableDataLoader(ex.synthetic_tokens(0, 4096), batch_size=4))
    return times


# --------------------------------------------------------------------------- the ranks
def _rank(rank: int, world: int, port: int, framework: str, blocks: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run = _hf_run if framework == "hf" else _lightning_run
    result: dict[str, list[float]] = {"with_step_s": [], "without_step_s": [], "hook_s": [], "boundaries": []}
    shared = Path(out).parent / f"root-{framework}"  # the same directory on both ranks
    for block in range(1 + blocks):  # block 0 warms up, not kept
        for use in ((False, True) if block % 2 else (True, False)):
            times = run(shared / f"{block}-{int(use)}", steps, use)
            if block:
                result["with_step_s" if use else "without_step_s"] += times["step_s"]
                result["hook_s"] += times["hook_s"]
                result["boundaries"] += times["boundaries"]
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def bench(framework: str, *, blocks: int, steps: int, workdir: Path) -> dict:
    import torch.multiprocessing as mp

    out = workdir / f"{framework}.json"
    mp.start_processes(_rank, args=(2, _free_port(), framework, blocks, steps, str(out)), nprocs=2,
                       start_method="spawn")
    m = json.loads(out.read_text())
    base = statistics.median(m["without_step_s"])
    hook = statistics.fmean(m["hook_s"])
    boundaries = sum(m["boundaries"]) / len(m["hook_s"])
    return {
        "framework": framework, "blocks": blocks, "steps_per_run": steps,
        "baseline_step_ms_p50": round(base * 1e3, 2),
        "with_callback_step_ms_p50": round(statistics.median(m["with_step_s"]) * 1e3, 2),
        "hook_us_mean": round(hook * 1e6, 1),
        "hook_us_p50": round(statistics.median(m["hook_s"]) * 1e6, 1),
        "hook_us_max": round(max(m["hook_s"]) * 1e6, 1),
        "boundaries_share": round(boundaries, 3),
        "hook_fraction_of_step": round(hook / base, 5),
        "with_over_without_p50": round(statistics.median(m["with_step_s"]) / base, 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=6, help="pairs of runs, with and without the callback")
    p.add_argument("--steps", type=int, default=40, help="steps per run")
    p.add_argument("--frameworks", default="hf,lightning")
    args = p.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''} nproc={os.cpu_count()} "
          f"load={os.getloadavg()[0]:.2f} python={platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="bench-callbacks-") as tmp:
        for framework in args.frameworks.split(","):
            r = bench(framework, blocks=args.blocks, steps=args.steps, workdir=Path(tmp))
            print(json.dumps(r))
            print(f"{framework}: the callback's per-step hook {r['hook_us_mean']} us mean "
                  f"(p50 {r['hook_us_p50']} us) = {100 * r['hook_fraction_of_step']:.3f} % of the "
                  f"{r['baseline_step_ms_p50']} ms step (goal < 1 %); end to end with / without: "
                  f"{r['with_over_without_p50']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
