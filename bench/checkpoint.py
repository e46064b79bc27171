"""Checkpoint benchmark: the emergency save against plain writes, and drain-to-committed latency.

    python bench/checkpoint.py [--d-model 1024 --n-layers 4] [--repeats 3] [--drains 10]
                               [--blocks 10] [--skip-save] [--skip-drains] [--skip-after-step]
                               [--workdir DIR]

1. **Emergency-save throughput.**  Two ranks (local processes, FSDP2 on gloo) hold a model whose
   parameters plus AdamW state are >= 500 MB (default: d_model 1024, 4 layers: 50.9 M parameters,
   612 MB) after one training step.  Each repeat is the trainer's preemption save, timed on rank 0
   from the first barrier to the commit: ``CheckpointStore.save``, what ``trainer.resilience.Checkpointer``
   calls (partial dir, RNG files, DCP files,
   every rank fsyncing and hashing its own files at once, manifest written last with fsync,
   rename, fsync of the root).  The **baseline** writes the same bytes, file for file with the same sizes, with
   plain sequential ``write`` calls of 8 MiB and an ``fsync`` per file, from one process, into the
   same directory, in the same run, alternating with the saves; every measurement starts after
   ``os.sync()``, and a first unmeasured save learns the file sizes.  Printed: MB/s of both
   (medians) and their ratio (target >= 0.8).
2. **Drain -> manifest committed.**  A local Ray cluster (head without CPUs, two 1-CPU nodes)
   runs ``python -m trainer`` with 2 workers.  ``--drains`` times: drain the node of one rank
   through the GCS (reason PREEMPTION, deadline in ``--drain-window`` s, as the daemon does),
   time until the trainer's ``checkpoint_committed`` event of the preemption save (written after
   the rename, so the manifest is in place), wait for the deadline, kill the node, add a
   replacement, wait for the run to train again.  Printed: p50 / p99 (nearest rank) of the
   latency, and the steps trained twice per interruption (target 0), counted from
   ``--metrics-out``.
3. **after_step with no notice.**  The same kind of cluster runs a Ray Train job of 2 workers
   that trains the drill's model (``python -m trainer``'s defaults: FSDP2, 2 ranks, batch 8) and
   trains ``--blocks`` pairs of 30-step blocks, one block calling ``Checkpointer.after_step``
   (``every=0``: the notice poll and the agreement) after each step, the other not (the
   baseline), in alternating order.  Printed: the cost per step (the poll, timed alone, every
   step; the agreement, timed alone, at the share of steps that agreed), after_step's own time
   on the training thread averaged over every step (an upper bound: at the steps that agree it
   also waits for the slower rank, which the baseline pays in its next collective), the end-to-end
   difference of the blocks (noisy on a shared machine), and the cost as a fraction of the
   baseline step (the drill's model) and of a 100 ms step (goal < 1 %).

Figures go to docs/benchmarks.md (## Checkpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.journal import read_jsonl  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.model import parameter_count  # noqa: E402

CHUNK = 8 * 1024 * 1024


# ---------------------------------------------------------------------- 1. save throughput
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_rank(rank: int, world: int, port: int, model_cfg: dict, root: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointStore, prune
    from trainer.data import rank_batch
    from trainer.model import build_model, shard_model
    from trainer.state import RESERVED, dcp_entries

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    cfg = ModelConfig(**model_cfg)
    model = shard_model(build_model(cfg, seed=0), device_type="cpu", world_size=world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = rank_batch(seed=0, step=1, batch_size=2 * world, seq_len=cfg.seq_len,
                                 vocab_size=cfg.vocab_size, rank=rank, world_size=world)
    model.loss(inputs, targets).backward()  # one step: AdamW's state exists and is full size
    optim.step()
    optim.zero_grad()
    group = dist.new_group(backend="gloo")
    ckpt = CheckpointStore(root=Path(root), rank=rank, world_size=world, group=group)
    state = {**dcp_entries({"model": model, "optim": optim}), RESERVED: {"step": 1}}
    buffer = os.urandom(CHUNK)
    # A first save, not measured: it learns the file sizes for the plain writes (and warms DCP).
    warm = ckpt.save(state, step=1, reason="preemption")
    files = [(f["path"], f["size"]) for f in json.loads((warm.path / "manifest.json").read_text())["files"]]
    results = {"saves": [], "plain": [], "dcp_write": [], "commit": [], "bytes": warm.bytes,
               "files": len(files)}
    for i in range(repeats):
        # Plain writes and saves alternate, each starting with no dirty pages left (os.sync).
        if rank == 0:
            os.sync()
            results["plain"].append(_plain_write(files, Path(root) / "plain", buffer))
            os.sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        pending = ckpt.start(state, step=i + 2, reason="preemption")
        t1 = time.perf_counter()
        ckpt.commit(pending)
        t2 = time.perf_counter()
        results["saves"].append(t2 - t0)
        results["dcp_write"].append(t1 - t0)
        results["commit"].append(t2 - t1)
        if rank == 0:
            prune(Path(root), keep=1)
    if rank == 0:
        out.put(results)
    dist.barrier(group=group)
    dist.destroy_process_group()


def _plain_write(files: list[tuple[str, int]], directory: Path, buffer: bytes) -> float:
    """Seconds to write the files (name, size) sequentially with 8 MiB writes and an fsync each."""
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name, size in files:
        fd = os.open(directory / name.replace("/", "_"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left:
                n = os.write(fd, buffer[: min(left, CHUNK)])
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    shutil.rmtree(directory)
    return seconds


def bench_save(args: argparse.Namespace, workdir: Path) -> dict:
    model_cfg = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": 8, "seq_len": 32,
                 "vocab_size": 256, "dropout": 0.0}
    params = parameter_count(ModelConfig(**model_cfg))
    root = workdir / "ck"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_save_rank, args=(r, 2, port, model_cfg, str(root), args.repeats, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=600)
    saves, baseline = results["saves"], results["plain"]
    mb = results["bytes"] / 1e6
    save_mbps = mb / statistics.median(saves)
    plain_mbps = mb / statistics.median(baseline)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "parameters": params,
        "state_mb": round(mb, 1),
        "files": results["files"],
        "save_seconds": [round(s, 3) for s in saves],
        "of_which_dcp_write_seconds": [round(s, 3) for s in results["dcp_write"]],
        "of_which_commit_seconds": [round(s, 3) for s in results["commit"]],
        "plain_seconds": [round(s, 3) for s in baseline],
        "save_mb_per_s": round(save_mbps, 1),
        "plain_mb_per_s": round(plain_mbps, 1),
        "ratio": round(save_mbps / plain_mbps, 3),
    }


# ---------------------------------------------------------------------- 2. drains on Ray
def _wait(predicate, *, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"trainer exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _labels(n: int) -> dict[str, str]:
    from resilienced.ray.cluster import CAPACITY_TYPE_LABEL, INSTANCE_ID_LABEL

    return {INSTANCE_ID_LABEL: f"i-{n:017x}", CAPACITY_TYPE_LABEL: "spot"}


def bench_drains(args: argparse.Namespace, workdir: Path) -> dict:
    cluster_dir = Path(tempfile.mkdtemp(prefix="bc", dir="/tmp"))  # short: Ray's socket paths
    out = workdir / "drains"
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _drain_loop(args, cluster_dir=cluster_dir, out=out)
    finally:
        shutil.rmtree(cluster_dir, ignore_errors=True)


def _drain_loop(args: argparse.Namespace, *, cluster_dir: Path, out: Path) -> dict:
    from resilienced.local.raycluster import LocalRayCluster

    labels = _labels
    metrics, events = out / "metrics.jsonl", out / "events.jsonl"
    latencies, manifest_latencies, notice_latencies = [], [], []
    proc = None
    with LocalRayCluster(workdir=cluster_dir) as cluster:
        serial = 1
        for _ in range(2):
            cluster.add_node(labels=labels(serial))
            serial += 1
        env = {**os.environ, **cluster.env}
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "--ray-address", cluster.address, "--steps", "1000000",
             "--min-step-seconds", str(args.step_seconds), "--checkpoint-every", "50",
             "--checkpoint-dir", str(out / "ck"), "--metrics-out", str(metrics), "--events-out", str(events)],
            cwd=ROOT, env=env, stdout=open(out / "trainer.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            for i in range(args.drains):
                attempt = i + 1  # every drain costs one restart
                _wait(lambda attempt=attempt: len([m for m in read_jsonl(metrics) if m["attempt"] == attempt]) >= 3,
                      timeout=300, what=f"attempt {attempt} to train", proc=proc)
                alive = {n.node_id for n in cluster.nodes() if n.alive and not n.draining}
                victim = next(n for n in cluster.workers if n.running() and n.node_id in alive)
                seen = len(read_jsonl(events))
                sent = time.time()
                deadline = sent + args.drain_window
                cluster.drain_node(victim, deadline_ms=int(deadline * 1000))

                def committed(seen: int = seen) -> dict | None:
                    for e in read_jsonl(events)[seen:]:
                        if e["event"] == "checkpoint_committed" and e["reason"] == "preemption":
                            return e
                    return None

                _wait(lambda: committed() is not None, timeout=args.drain_window + 30,
                      what="the preemption checkpoint", proc=proc)
                event = committed()
                notice = next(e for e in read_jsonl(events)[seen:] if e["event"] == "preemption_notice")
                manifest = json.loads((Path(event["path"]) / "manifest.json").read_text())
                latencies.append(event["time"] - sent)
                manifest_latencies.append(manifest["saved_at_unix"] - sent)
                notice_latencies.append(notice["time"] - sent)
                print(f"drain {i + 1}: notice {notice_latencies[-1]:.2f}s, manifest committed "
                      f"{latencies[-1]:.2f}s after the drain (step {event['step']})", flush=True)
                _wait(lambda seen=seen: any(e["event"] == "waiting_for_teardown" for e in read_jsonl(events)[seen:]),
                      timeout=args.drain_window + 30, what="waiting_for_teardown", proc=proc)
                while time.time() < deadline:
                    time.sleep(0.05)
                cluster.kill_node(victim)
                cluster.add_node(labels=labels(serial))
                serial += 1
            # let the last restart train, so its duplicates (if any) are counted
            attempts = args.drains + 1
            _wait(lambda: len([m for m in read_jsonl(metrics) if m["attempt"] == attempts]) >= 3,
                  timeout=300, what="the last restart to train", proc=proc)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    counts: dict[int, int] = {}
    for m in read_jsonl(metrics):
        counts[m["step"]] = counts.get(m["step"], 0) + 1
    twice = sum(c - 1 for c in counts.values())
    return {
        "drains": args.drains,
        "drain_window_s": args.drain_window,
        "notice_p50_s": round(statistics.median(notice_latencies), 3),
        "committed_p50_s": round(_nearest_rank(latencies, 0.5), 3),
        "committed_p99_s": round(_nearest_rank(latencies, 0.99), 3),
        "manifest_written_p50_s": round(_nearest_rank(manifest_latencies, 0.5), 3),
        "latencies_s": [round(x, 3) for x in latencies],
        "steps_trained_twice_per_interruption": twice / args.drains,
    }


# ---------------------------------------------------------------------- 3. after_step, no notice
def _after_step_worker(config: dict) -> None:
    """Ray Train worker: the drill's training step with and without after_step, in alternating blocks."""
    import torch
    import torch.distributed as dist

    from trainer.config import TrainConfig
    from trainer.loop import _train_step
    from trainer.model import build_model, shard_model
    from trainer.preemption import Agreed, Agreement
    from trainer.resilience import Checkpointer
    from trainer.runtime import RayRuntime

    torch.set_num_threads(1)
    world = dist.get_world_size()
    cfg = TrainConfig(checkpoint_dir=Path(config["root"]), num_workers=world)  # the drill's model
    model = shard_model(build_model(cfg.model, seed=0), device_type="cpu", world_size=world)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    state = {"model": model, "optim": optim}
    agreed = [0]  # the boundaries: the ranks' per-step agreements, counted through the seam

    class CountingAgreement(Agreement):
        def agree(self, **kwargs: object) -> Agreed:
            agreed[0] += 1
            return super().agree(**kwargs)

    counting = type("CountingCheckpointer", (Checkpointer,), {"agreement_type": CountingAgreement})
    ckpt = counting(config["root"], every=0)  # no periodic save: what runs between saves
    step = ckpt.restore(state)
    cpu = torch.device("cpu")
    out: dict[str, list[float]] = {"plain_step_s": [], "with_after_step_s": [], "after_step_s": [],
                                   "boundaries": []}
    for block in range(1 + config["blocks"]):  # block 0 warms up, not kept
        for use in ((False, True) if block % 2 else (True, False)):  # alternate the order
            started, boundaries = time.perf_counter(), agreed[0]
            for _ in range(config["per_block"]):
                _train_step(cfg, model, optim, step=step + 1, device=cpu)
                step += 1
                if use:
                    t = time.perf_counter()
                    ckpt.after_step(step, state)
                    if block:
                        out["after_step_s"].append(time.perf_counter() - t)
            if block:
                key = "with_after_step_s" if use else "plain_step_s"
                out[key].append((time.perf_counter() - started) / config["per_block"])
                if use:
                    out["boundaries"].append(agreed[0] - boundaries)
    agreement, runtime = Agreement(group=dist.new_group(backend="gloo"), world_size=world), RayRuntime()
    out["poll_s"], out["agreement_s"] = [], []
    for _ in range(config["blocks"] * config["per_block"]):  # the two halves of a boundary, alone
        t0 = time.perf_counter()
        runtime.preemption_info()
        t1 = time.perf_counter()
        agreement.agree(ray_notice=False, sigterm=False, deadline_ms=None, step=step)
        out["poll_s"].append(t1 - t0)
        out["agreement_s"].append(time.perf_counter() - t1)
    if dist.get_rank() == 0:  # the same machine: a file is the simplest way back to the driver
        Path(config["out"]).write_text(json.dumps(out))


def _after_step_driver(address: str, out: str, blocks: int) -> int:
    """Run ``_after_step_worker`` on 2 Ray Train workers; rank 0 writes its timings to ``out``."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=address, runtime_env={"py_modules": [str(ROOT / "trainer")]}, log_to_driver=False)
    root = Path(out).parent / "ck-after-step"
    trainer = TorchTrainer(
        _after_step_worker, train_loop_config={"root": str(root), "blocks": blocks, "per_block": 30, "out": out},
        torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="after-step", storage_path=str(root / ".ray-train")),
    )
    result = trainer.fit()
    return 1 if result.error else 0


def bench_after_step(args: argparse.Namespace, workdir: Path) -> dict:
    from resilienced.local.raycluster import LocalRayCluster

    cluster_dir = Path(tempfile.mkdtemp(prefix="ba", dir="/tmp"))
    out = workdir / "after-step.json"
    try:
        with LocalRayCluster(workdir=cluster_dir) as cluster:
            for n in (1, 2):
                cluster.add_node(labels=_labels(n))
            env = {**os.environ, **cluster.env}
            subprocess.run([sys.executable, __file__, "--after-step-driver", cluster.address, str(out),
                            str(args.blocks)], cwd=ROOT, env=env, check=True, timeout=900)
    finally:
        shutil.rmtree(cluster_dir, ignore_errors=True)
    m = json.loads(out.read_text())
    med = {k: statistics.median(v) for k, v in m.items()}
    share = sum(m["boundaries"]) / len(m["after_step_s"])  # steps that agreed
    # the cost per step: the poll every step, the agreement at the share of steps that agree
    cost = med["poll_s"] + share * med["agreement_s"]
    # after_step's own time on the training thread, averaged over every step: an upper bound
    # (at the steps that agree it also waits for the slower rank, which the baseline pays in
    # the next step's collectives instead)
    wall = statistics.fmean(m["after_step_s"])
    # with minus without, block pair by block pair: the same thing measured end to end, but the
    # step's own noise (other work on the machine) is larger than what it measures
    end_to_end = statistics.median(w - p for w, p in zip(m["with_after_step_s"], m["plain_step_s"], strict=True))
    return {
        "blocks": len(m["plain_step_s"]),
        "steps_per_block": len(m["after_step_s"]) // len(m["plain_step_s"]),
        "cost_per_step_us": round(cost * 1e6, 1),
        "after_step_wall_mean_us": round(wall * 1e6, 1),
        "after_step_wall_us_p50": round(med["after_step_s"] * 1e6, 1),
        "after_step_wall_us_p99": round(_nearest_rank(m["after_step_s"], 0.99) * 1e6, 1),
        "boundaries_share": round(share, 3),
        "poll_us_p50": round(med["poll_s"] * 1e6, 2),
        "agreement_us_p50": round(med["agreement_s"] * 1e6, 1),
        "with_minus_without_us": round(end_to_end * 1e6, 1),
        "drill_step_ms_p50": round(med["plain_step_s"] * 1e3, 2),
        "fraction_of_drill_step": round(cost / med["plain_step_s"], 4),
        "fraction_of_100ms_step": round(cost / 0.1, 4),
        "wall_fraction_of_drill_step": round(wall / med["plain_step_s"], 4),
        "wall_fraction_of_100ms_step": round(wall / 0.1, 4),
    }

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drains", type=int, default=10)
    p.add_argument("--drain-window", type=float, default=10.0, help="seconds from drain to deadline")
    p.add_argument("--step-seconds", type=float, default=0.2, help="--min-step-seconds of the run")
    p.add_argument("--skip-save", action="store_true")
    p.add_argument("--skip-drains", action="store_true")
    p.add_argument("--skip-after-step", action="store_true")
    p.add_argument("--blocks", type=int, default=10,
                   help="part 3: pairs of 30-step blocks, with and without after_step")
    p.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    if len(sys.argv) == 5 and sys.argv[1] == "--after-step-driver":  # part 3's Ray driver process
        return _after_step_driver(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": {"platform": platform.platform(), "nproc": os.cpu_count(),
                                "python": platform.python_version()}}
    try:
        if not args.skip_save:
            report["save"] = s = bench_save(args, workdir)
            print(f"emergency save: {s['state_mb']} MB ({s['parameters'] / 1e6:.1f} M parameters + AdamW) "
                  f"in {s['files']} files: {s['save_mb_per_s']} MB/s; plain sequential writes + fsync: "
                  f"{s['plain_mb_per_s']} MB/s; ratio {s['ratio']} (target >= 0.8)", flush=True)
        if not args.skip_drains:
            report["drains"] = d = bench_drains(args, workdir)
            print(f"drain -> manifest committed over {d['drains']} drains: p50 {d['committed_p50_s']}s, "
                  f"p99 {d['committed_p99_s']}s; steps trained twice per interruption: "
                  f"{d['steps_trained_twice_per_interruption']} (target 0)", flush=True)
        if not args.skip_after_step:
            report["after_step"] = a = bench_after_step(args, workdir)
            print(f"after_step with no notice, 2 Ray Train workers: {a['cost_per_step_us']} us per step "
                  f"(poll {a['poll_us_p50']} us every step + agreement {a['agreement_us_p50']} us at "
                  f"{a['boundaries_share']} of the steps); the drill model's step {a['drill_step_ms_p50']} ms: "
                  f"fraction {a['fraction_of_drill_step']}; of a 100 ms step: {a['fraction_of_100ms_step']} "
                  f"(goal < 0.01).  Upper bound, after_step's wall time incl. waiting for the slower rank: mean "
                  f"{a['after_step_wall_mean_us']} us (p50 {a['after_step_wall_us_p50']}, p99 "
                  f"{a['after_step_wall_us_p99']}): {a['wall_fraction_of_100ms_step']} of 100 ms; with - without "
                  f"{a['with_minus_without_us']} us", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
