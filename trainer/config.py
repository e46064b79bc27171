"""The trainer's flags, grouped and validated once, before anything starts.

Every setting is a field of :class:`TrainConfig` with its unit and why its default is what it is.
``parse_args`` turns ``argv`` into a config or raises :class:`~trainer.errors.ConfigError` naming
the flag that is wrong.  The config travels to every rank as a plain dict (``as_dict`` /
``from_dict``) because Ray Train passes ``train_loop_config`` by value.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

#: ``--ray-address`` value meaning "no Ray: spawn the ranks as local processes with gloo".
LOCAL = "local"

#: Save phases at which ``--crash-at`` can kill the ranks (a test hook for crash safety).
CRASH_PHASES = ("files-written", "manifest-torn", "manifest-written", "committed")


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-only transformer.  Defaults keep 40 steps on 2 CPU ranks to a few seconds."""

    vocab_size: int = 256
    """Tokens; the synthetic data uses all of them."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks; each is its own FSDP2 unit."""
    n_heads: int = 4
    """Attention heads; must divide ``d_model``."""
    seq_len: int = 32
    """Tokens per sequence (the model predicts ``seq_len`` next tokens per row)."""
    dropout: float = 0.1
    """Dropout after attention and MLP.  Non-zero on purpose: it draws from the RNG, so an exact
    resume proves the RNG states were saved and restored."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""


@dataclass(frozen=True)
class PreemptionConfig:
    """How the last save is placed before a preemption deadline (see ``trainer.preemption``)."""

    save_margin_factor: float = 1.5
    """The budget kept for the last save is this many times the slowest save measured in this
    attempt, plus ``save_margin_s``.  1.5: a save on a busy file system can be half as slow
    again as the one just measured."""
    save_margin_s: float = 2.0
    """Seconds added to the save budget: rename, report and scheduling jitter."""
    sigterm_grace_s: float = 25.0
    """Deadline assumed after a SIGTERM that came without one (seconds after the signal).  Below
    Ray's default ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (30 s) and Kubernetes' default
    ``terminationGracePeriodSeconds`` (30 s)."""
    no_deadline_s: float = 90.0
    """Deadline assumed when Ray reports a preemption without one.  Ray Train's controller then
    waits 120 s from when it saw the drain; 90 s leaves room for its poll delay."""
    teardown_timeout_s: float = 120.0
    """After the last save, how long past the deadline to wait to be torn down before failing
    (Ray mode: so a drain that never ends does not hang the run forever)."""


@dataclass(frozen=True)
class TrainConfig:
    checkpoint_dir: Path
    """Checkpoint root (the FSx mount in production).  ``step-<N>/`` and ``step-<N>.partial/``
    live here; with Ray it is also the Ray Train run directory."""
    num_workers: int = 2
    """Ranks (Ray Train workers, or local processes); with ``min_workers``, the most ranks."""
    min_workers: int | None = None
    """Elastic run (Ray only): Ray Train 2.60 ``ScalingConfig(num_workers=(min_workers,
    num_workers))`` restarts a preempted run with the workers it can place, at least this many,
    and grows it back towards ``num_workers`` as nodes join.  None: a fixed world size."""
    resize_interval_s: float = 60.0
    """Elastic run: ``ScalingConfig.elastic_resize_monitor_interval_s``, how often Ray Train
    considers growing a running worker group (Ray's default, 60 s)."""
    resize_save_timeout_s: float = 60.0
    """Elastic run: how long Ray Train's controller waits for the ranks to save the step they
    are on before it restarts them at a larger size (``trainer.elastic``)."""
    steps: int = 40
    """Total optimizer steps of the run, counted from 1."""
    checkpoint_every: int = 10
    """Periodic checkpoint every this many steps (0: none; the final and preemption saves still
    happen)."""
    keep: int = 3
    """Committed checkpoints kept; older ones are deleted after each commit."""
    async_save: bool = False
    """Write periodic checkpoints with ``dcp.async_save`` so training goes on while they are
    written; the commit (manifest, rename) happens at the first step boundary after.  Emergency
    (preemption) saves are always synchronous."""
    seed: int = 0
    """Seeds the initial weights, the data (a pure function of seed and step) and dropout."""
    batch_size: int = 8
    """Global batch (sequences per step), the same at every world size.  A fixed run splits it
    evenly; an elastic run may split it unevenly (``trainer.data.batch_share``)."""
    metrics_out: Path | None = None
    """Rank 0 appends one JSON line per trained step."""
    events_out: Path | None = None
    """Rank 0 appends one JSON line per lifecycle event."""
    ray_address: str | None = None
    """Ray cluster to join; None: start or join a local Ray; ``local``: no Ray at all."""
    run_name: str | None = None
    """Ray Train run name; defaults to the checkpoint directory's name."""
    max_failures: int = 3
    """Ray Train ``FailureConfig.max_failures`` (real failures; preemptions are not counted)."""
    max_preemptions: int = -1
    """Ray Train ``FailureConfig.max_preemption_failures`` (-1: unlimited)."""
    ship_code: bool = True
    """Ship this package to the Ray workers (``runtime_env.py_modules``); off when the training
    image has it installed on every node already."""
    use_gpu: bool = False
    """Ray workers on GPUs: NCCL for training, a gloo group for checkpoints."""
    min_step_seconds: float = 0.0
    """Pad each step to at least this long (seconds): stands in for a bigger model in drills
    and tests without changing a single number the model computes."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    crash_at: tuple[str, int] | None = None
    """Test hook: every rank exits abruptly (``os._exit``) at this save phase of this step."""
    step_seconds_file: Path | None = None
    """Test hook: while this file exists, each step lasts at least the seconds it holds, in place
    of ``min_step_seconds`` (read at every step), so that a test can keep a run from ending
    before what it waits for happens, however slow the machine."""

    # ------------------------------------------------------------------ (de)serialisation
    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key in ("checkpoint_dir", "metrics_out", "events_out", "step_seconds_file"):
            if out[key] is not None:
                out[key] = str(out[key])
        if out["crash_at"] is not None:
            out["crash_at"] = list(out["crash_at"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        data = dict(data)
        for key in ("checkpoint_dir", "metrics_out", "events_out", "step_seconds_file"):
            if data.get(key) is not None:
                data[key] = Path(data[key])
        if data.get("crash_at") is not None:
            data["crash_at"] = (str(data["crash_at"][0]), int(data["crash_at"][1]))
        data["model"] = ModelConfig(**data.get("model", {}))
        data["optim"] = OptimConfig(**data.get("optim", {}))
        data["preemption"] = PreemptionConfig(**data.get("preemption", {}))
        config = cls(**data)
        config.validate()
        return config

    def step_seconds_now(self) -> float:
        """The least the next step lasts: what ``step_seconds_file`` holds while it exists (a test
        writes it whole: a rename), else ``min_step_seconds``."""
        if self.step_seconds_file is not None:
            with contextlib.suppress(FileNotFoundError):
                return float(self.step_seconds_file.read_text())
        return self.min_step_seconds

    @property
    def is_local(self) -> bool:
        return self.ray_address == LOCAL

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first flag that cannot work."""
        _positive("--num-workers", self.num_workers)
        _positive("--steps", self.steps)
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _positive("--keep", self.keep)
        _positive("--batch-size", self.batch_size)
        self._validate_elastic()
        if not self.elastic and self.batch_size % self.num_workers:
            raise ConfigError(
                "--batch-size",
                f"{self.batch_size} sequences cannot be split evenly over {self.num_workers} workers",
            )
        m = self.model
        _positive("--vocab-size", m.vocab_size)
        _positive("--d-model", m.d_model)
        _positive("--n-layers", m.n_layers)
        _positive("--n-heads", m.n_heads)
        _positive("--seq-len", m.seq_len)
        if m.d_model % m.n_heads:
            raise ConfigError("--n-heads", f"{m.n_heads} heads do not divide --d-model {m.d_model}")
        if not 0.0 <= m.dropout < 1.0:
            raise ConfigError("--dropout", f"must be in [0, 1), got {m.dropout}")
        _finite_positive("--lr", self.optim.lr)
        _at_least("--weight-decay", self.optim.weight_decay, 0.0)
        _at_least("--min-step-seconds", self.min_step_seconds, 0.0)
        p = self.preemption
        _at_least("--save-margin-factor", p.save_margin_factor, 1.0)
        _at_least("--save-margin-s", p.save_margin_s, 0.0)
        _finite_positive("--sigterm-grace-s", p.sigterm_grace_s)
        _finite_positive("--no-deadline-s", p.no_deadline_s)
        _finite_positive("--teardown-timeout-s", p.teardown_timeout_s)
        _at_least("--max-failures", self.max_failures, -1)
        _at_least("--max-preemptions", self.max_preemptions, -1)
        if self.ray_address is not None and not self.ray_address.strip():
            raise ConfigError("--ray-address", "must not be empty")
        if self.is_local and self.use_gpu:
            raise ConfigError("--use-gpu", "needs Ray (--ray-address local runs on CPU with gloo)")
        if self.crash_at is not None and self.crash_at[0] not in CRASH_PHASES:
            raise ConfigError("--crash-at", f"phase must be one of {CRASH_PHASES}")
        for flag, path in (("--metrics-out", self.metrics_out), ("--events-out", self.events_out)):
            if path is not None and path.exists() and path.is_dir():
                raise ConfigError(flag, f"{path} is a directory, not a file")
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():
            raise ConfigError("--checkpoint-dir", f"{self.checkpoint_dir} exists and is not a directory")


    def _validate_elastic(self) -> None:
        if self.min_workers is None:
            return
        if not 1 <= self.min_workers <= self.num_workers:
            raise ConfigError("--min-workers", f"must be between 1 and --num-workers ({self.num_workers}), "
                                               f"got {self.min_workers}")
        if self.is_local:
            raise ConfigError("--min-workers", "needs Ray (--ray-address local runs a fixed number of processes)")
        if self.batch_size < self.num_workers:
            raise ConfigError("--batch-size", f"{self.batch_size} sequences leave some of {self.num_workers} "
                                              "workers without a sequence")
        _at_least("--resize-interval-s", self.resize_interval_s, 0.0)
        _finite_positive("--resize-save-timeout-s", self.resize_save_timeout_s)


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise ConfigError(flag, f"must be at least 1, got {value}")


def _at_least(flag: str, value: float, low: float) -> None:
    if not value >= low:
        raise ConfigError(flag, f"must be at least {low}, got {value}")


def _finite_positive(flag: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(flag, f"must be a positive number, got {value}")


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="FSDP2 training on Ray Train that saves the step it is on when preempted "
        "and resumes it exactly.",
    )
    run = p.add_argument_group("run")
    run.add_argument("--num-workers", type=int, default=2, help="ranks (default 2); elastic: the most")
    run.add_argument("--min-workers", type=int, default=None,
                     help="elastic run (Ray): go on with at least this many workers after a node is "
                          "lost, grow back to --num-workers when nodes join (default: fixed size)")
    run.add_argument("--resize-interval-s", type=float, default=60.0,
                     help="elastic: how often Ray Train considers growing the run (default 60)")
    run.add_argument("--resize-save-timeout-s", type=float, default=60.0,
                     help="elastic: how long to wait for the save before a resize (default 60)")
    run.add_argument("--steps", type=int, default=40, help="total optimizer steps (default 40)")
    run.add_argument("--seed", type=int, default=0, help="seed of weights, data and dropout")
    run.add_argument("--ray-address", default=None,
                     help="Ray cluster to join (host:port, 'auto', ray://...); default: start or "
                          "join a local Ray; 'local': no Ray, local processes with gloo")
    run.add_argument("--run-name", default=None, help="Ray Train run name (default: checkpoint dir name)")
    run.add_argument("--max-failures", type=int, default=3, help="Ray Train max_failures (default 3)")
    run.add_argument("--max-preemptions", type=int, default=-1,
                     help="Ray Train max_preemption_failures (default -1: unlimited)")
    run.add_argument("--use-gpu", action="store_true", help="Ray workers on GPUs (NCCL + gloo)")
    run.add_argument("--no-ship-code", dest="ship_code", action="store_false",
                     help="do not ship the trainer package to Ray workers (it is installed there)")
    run.add_argument("--min-step-seconds", type=float, default=0.0,
                     help="pad each step to at least this long (drills)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--checkpoint-dir", type=Path, required=True, help="checkpoint root (FSx mount)")
    ck.add_argument("--checkpoint-every", type=int, default=10,
                    help="periodic checkpoint every K steps (0: none; default 10)")
    ck.add_argument("--keep", type=int, default=3, help="committed checkpoints kept (default 3)")
    ck.add_argument("--async-save", action="store_true",
                    help="periodic checkpoints with dcp.async_save (training goes on)")
    out = p.add_argument_group("outputs")
    out.add_argument("--metrics-out", type=Path, default=None, help="rank 0: one JSON line per step")
    out.add_argument("--events-out", type=Path, default=None, help="rank 0: one JSON line per event")
    mo = p.add_argument_group("model and batch")
    mo.add_argument("--vocab-size", type=int, default=ModelConfig.vocab_size)
    mo.add_argument("--d-model", type=int, default=ModelConfig.d_model)
    mo.add_argument("--n-layers", type=int, default=ModelConfig.n_layers)
    mo.add_argument("--n-heads", type=int, default=ModelConfig.n_heads)
    mo.add_argument("--seq-len", type=int, default=ModelConfig.seq_len)
    mo.add_argument("--dropout", type=float, default=ModelConfig.dropout)
    mo.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    mo.add_argument("--lr", type=float, default=OptimConfig.lr)
    mo.add_argument("--weight-decay", type=float, default=OptimConfig.weight_decay)
    pr = p.add_argument_group("preemption")
    pr.add_argument("--save-margin-factor", type=float, default=PreemptionConfig.save_margin_factor)
    pr.add_argument("--save-margin-s", type=float, default=PreemptionConfig.save_margin_s)
    pr.add_argument("--sigterm-grace-s", type=float, default=PreemptionConfig.sigterm_grace_s)
    pr.add_argument("--no-deadline-s", type=float, default=PreemptionConfig.no_deadline_s)
    pr.add_argument("--teardown-timeout-s", type=float, default=PreemptionConfig.teardown_timeout_s)
    p.add_argument("--crash-at", default=None, help=argparse.SUPPRESS)  # test hook: PHASE:STEP
    p.add_argument("--step-seconds-file", type=Path, default=None, help=argparse.SUPPRESS)  # test hook
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags -> validated config; argparse errors exit 2, semantic ones raise ConfigError."""
    ns = build_parser().parse_args(argv)
    crash_at = None
    if ns.crash_at is not None:
        phase, sep, step = ns.crash_at.rpartition(":")
        if not sep or not step.isdigit():
            raise ConfigError("--crash-at", f"expected PHASE:STEP, got {ns.crash_at!r}")
        crash_at = (phase, int(step))
    config = TrainConfig(
        checkpoint_dir=ns.checkpoint_dir.absolute(),
        num_workers=ns.num_workers,
        min_workers=ns.min_workers,
        resize_interval_s=ns.resize_interval_s,
        resize_save_timeout_s=ns.resize_save_timeout_s,
        steps=ns.steps,
        checkpoint_every=ns.checkpoint_every,
        keep=ns.keep,
        async_save=ns.async_save,
        seed=ns.seed,
        batch_size=ns.batch_size,
        metrics_out=ns.metrics_out.absolute() if ns.metrics_out else None,
        events_out=ns.events_out.absolute() if ns.events_out else None,
        ray_address=ns.ray_address,
        run_name=ns.run_name,
        max_failures=ns.max_failures,
        max_preemptions=ns.max_preemptions,
        use_gpu=ns.use_gpu,
        ship_code=ns.ship_code,
        min_step_seconds=ns.min_step_seconds,
        step_seconds_file=ns.step_seconds_file.absolute() if ns.step_seconds_file else None,
        model=ModelConfig(
            vocab_size=ns.vocab_size, d_model=ns.d_model, n_layers=ns.n_layers,
            n_heads=ns.n_heads, seq_len=ns.seq_len, dropout=ns.dropout,
        ),
        optim=OptimConfig(lr=ns.lr, weight_decay=ns.weight_decay),
        preemption=PreemptionConfig(
            save_margin_factor=ns.save_margin_factor, save_margin_s=ns.save_margin_s,
            sigterm_grace_s=ns.sigterm_grace_s, no_deadline_s=ns.no_deadline_s,
            teardown_timeout_s=ns.teardown_timeout_s,
        ),
        crash_at=crash_at,
    )
    config.validate()
    return config
