"""The drivers: Ray Train's ``TorchTrainer``, or local processes without Ray.

``run_with_ray``: joins the Ray cluster at ``--ray-address`` (or ``RAY_ADDRESS``; with neither,
starts a local Ray sized for the workers), ships this package to the workers
(``runtime_env.py_modules``) and runs ``trainer.loop.ray_train_fn`` on ``--num-workers`` workers
(1 CPU each; with ``--use-gpu`` 1 GPU each and ``cpu:gloo,cuda:nccl``); with ``--min-workers``
an elastic run (``ScalingConfig(num_workers=(min, max))`` and ``trainer.elastic.ElasticCallback``).  Ray Train's run
directory is ``<checkpoint root>/.ray-train/<run name>``; it receives a small pointer per
committed checkpoint (see ``trainer.runtime``).  A preemption is not
charged to ``--max-failures`` (Ray Train's ``max_preemption_failures``, ``--max-preemptions``).

``run_local`` (``--ray-address local``): ``--num-workers`` processes (forked) with gloo on
127.0.0.1, the same loop; SIGTERM to the launcher is forwarded to every rank.  Exit code 0 when
finished, 75 when preempted after saving (run it again to resume), 1 on a failure.  Same world
size, same seed: the same losses, bit for bit, as on Ray.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.errors import EXIT_PREEMPTED, PreemptedError, TrainerError

log = logging.getLogger(__name__)

#: Ray Train's run directory, under the checkpoint root (pointers to checkpoints, run snapshot).
RAY_TRAIN_DIR = ".ray-train"

#: Set for the Ray Train controller (and propagated by it) unless already set: Ray's default
#: poll of the GCS drain state is every 5 s; 0.5 s gets the notice to the ranks ~1 s after a drain.
#: The controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (Ray's default 2 s),
#: and that poll is when it sees a preemption deadline pass or considers a resize: 0.5 s starts a
#: restart ~0.75 s sooner on average (docs/benchmarks.md, issue #24).
RAY_ENV_DEFAULTS = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}


# ---------------------------------------------------------------------- Ray
def run_with_ray(cfg: TrainConfig) -> int:
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if not address and "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
        # Ray 2.60 turns token auth on for a new local cluster and would write the token to
        # ~/.ray/auth_token; keep it in this process's environment instead (the local
        # cluster's processes inherit it).  Set before Ray is imported: it caches the token.
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    import trainer
    from trainer.elastic import scaling_kwargs
    from trainer.loop import ray_train_fn

    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)  # Ray Train propagates them to its controller
    runtime_env: dict[str, Any] = {}
    if cfg.ship_code:
        runtime_env["py_modules"] = [str(Path(trainer.__file__).parent)]
    init_kwargs: dict[str, Any] = {"runtime_env": runtime_env, "log_to_driver": True}
    if address:
        init_kwargs["address"] = address
    else:  # a fresh local Ray: never join somebody else's cluster by accident
        init_kwargs.update(
            address="local",
            num_cpus=max(cfg.num_workers, os.cpu_count() or 1),
            include_dashboard=False,
        )
    try:
        ray.init(**init_kwargs)
    except Exception as e:
        raise TrainerError(f"cannot connect to Ray at {address or 'a new local cluster'}: {e}") from e

    root = cfg.checkpoint_dir
    root.mkdir(parents=True, exist_ok=True)
    resources = {"CPU": 1, **({"GPU": 1} if cfg.use_gpu else {})}
    from trainer.warmup import WarmupCallback

    # every new worker imports FSDP2 and DCP while Ray Train still sets the group up (trainer.warmup)
    callbacks: list[Any] = [WarmupCallback(("trainer.loop", "torch.distributed.fsdp", "torch._dynamo"))]
    if cfg.elastic:
        from trainer.elastic import ElasticCallback

        callbacks.append(ElasticCallback(root, max_workers=cfg.num_workers,
                                         save_timeout_s=cfg.resize_save_timeout_s,
                                         resize_interval_s=cfg.resize_interval_s))
    trainer_ = TorchTrainer(
        ray_train_fn,
        train_loop_config=cfg.as_dict(),
        torch_config=TorchConfig(
            backend="cpu:gloo,cuda:nccl" if cfg.use_gpu else "gloo",
            timeout_s=int(timedelta(minutes=10).total_seconds()),
        ),
        scaling_config=ScalingConfig(
            **scaling_kwargs(min_workers=cfg.min_workers, max_workers=cfg.num_workers,
                             resize_interval_s=cfg.resize_interval_s),
            use_gpu=cfg.use_gpu, resources_per_worker=resources,
        ),
        run_config=RunConfig(
            name=cfg.run_name or root.name,
            storage_path=str(root / RAY_TRAIN_DIR),
            failure_config=FailureConfig(
                max_failures=cfg.max_failures, max_preemption_failures=cfg.max_preemptions
            ),
            # Ray Train keeps pointers to the checkpoints (and prunes them itself); the
            # checkpoints' own retention is the trainer's (it knows which are complete).
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep),
            callbacks=callbacks,
        ),
    )
    try:
        result = trainer_.fit()
    except Exception as e:  # TrainingFailedError and friends: say what failed, exit non-zero
        raise TrainerError(f"Ray Train run failed: {e}") from e
    finally:
        ray.shutdown()
    if result.error:
        raise TrainerError(f"Ray Train run failed: {result.error}")
    return 0


# ---------------------------------------------------------------------- local processes
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher dies, so no rank is ever orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _local_rank_main(config: dict[str, Any], rank: int, port: int, parent_pid: int) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    import torch.distributed as dist

    from trainer.loop import COLLECTIVE_TIMEOUT, run

    logging.basicConfig(level=logging.INFO, format=f"rank={rank} level=%(levelname)s logger=%(name)s %(message)s")
    cfg = TrainConfig.from_dict(config)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=cfg.num_workers, timeout=COLLECTIVE_TIMEOUT,
        init_method=f"tcp://127.0.0.1:{port}",
    )
    code = 0
    try:
        run(cfg)
    except PreemptedError as e:
        log.warning(f"preempted: {e}")
        code = EXIT_PREEMPTED
    finally:
        if code == 0:
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_local(cfg: TrainConfig) -> int:
    """Run the ranks as local processes; returns 0 (finished), 75 (preempted) or 1 (failed)."""
    # fork, after importing everything the ranks need: each rank starts in milliseconds instead
    # of importing torch again (seconds of CPU each).  Safe here: local mode is CPU-only and the
    # launcher has run no torch op (no thread pool, no process group) before forking.
    import torch._dynamo  # noqa: F401  (FSDP2 imports it lazily: ~1 s of CPU)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import trainer.loop  # noqa: F401
    import trainer.resilience  # noqa: F401

    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_local_rank_main, args=(cfg.as_dict(), rank, port, os.getpid()),
            name=f"trainer-rank{rank}",
        )
        for rank in range(cfg.num_workers)
    ]

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    previous = signal.getsignal(signal.SIGTERM)
    try:
        for p in procs:
            p.start()
        signal.signal(signal.SIGTERM, forward)  # after the forks: the ranks install their own
        while True:
            codes = [p.exitcode for p in procs]
            failed = [c for c in codes if c is not None and c not in (0, EXIT_PREEMPTED)]
            if failed:  # a rank died: the others would wait in a collective forever
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                for p in procs:
                    p.join()
                log.error(f"a rank failed; stopped the others exit_code={failed[0]}")
                return 1
            if all(c is not None for c in codes):
                return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        signal.signal(signal.SIGTERM, previous)
