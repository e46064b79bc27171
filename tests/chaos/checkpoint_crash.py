"""Scenario 5: the trainer SIGKILLed at each phase of a save; neither the daemon nor the resume
trusts the partial checkpoint, and the run goes on from the newest whole one.

Each trial, in a checkpoint root of its own (the FSx file system):

1. the trainer (tests/chaos/ckpt_ranks.py, 2 gloo ranks in processes of their own, the real
   :class:`trainer.resilience.Checkpointer`) saves step 2, then is SIGKILLed at one phase of the
   save of step 4 (or, the control, just after step 4 is committed);
2. the layout left on disk is checked: the kill landed where it was meant to (the shard cut
   short, the manifest torn ...);
3. the FSx stand-in (``LocalExporter``, auto-export of committed directories) exports the root to
   moto S3, and the partial directory is uploaded too, as FSx's auto-export of every file does;
   the daemon's durability check runs against S3: ``wait_durable`` for a notice given after step 2
   was saved must find nothing durable and name step 2 as the fallback (the control: step 4 is
   durable), and ``newest_durable`` must be step 2;
4. the trainer restarts on the same root (as Ray restarts the gang): ``restore`` must load step 2
   (every parameter holds 2), reject the partial directory with its reason, train a step and save
   it; that save must become durable in S3 (the run goes on). The time from the kill to that is
   the time to recover.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from aiobotocore.session import get_session

from resilienced.aws.s3 import S3Store
from resilienced.local.aws import FAKE_CREDENTIALS, MotoServer
from resilienced.local.fsx import LocalExporter
from resilienced.recovery.durable import newest_durable, wait_durable
from tests.chaos import ckpt_ranks
from tests.chaos.scenarios import Tally
from tests.support.ranks import run_ranks

REGION = "us-east-1"
BUCKET = "ckpt"
WORLD = 2
EVERY = 2
AT = 4  # the save killed; step EVERY is the newest whole checkpoint before it
PREVIOUS = AT - EVERY


# --------------------------------------------------------------------------- what the kill left
def landed(root: Path, phase: str) -> str | None:
    """None when the directory shows the kill at ``phase``; else what is wrong."""
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    whole = [f"step-{PREVIOUS}", f"step-{AT}"] if phase == "committed" else [f"step-{PREVIOUS}", f"step-{AT}.partial"]
    if names != whole:
        return f"left {names}, want {whole}"
    if phase == "committed":
        return None
    partial = root / f"step-{AT}.partial"
    have = {p.name for p in partial.iterdir()}
    shards = [p for p in partial.glob("__*_*.distcp")]
    want: dict[str, bool] = {  # file -> present
        "shard-mid-write": {".metadata": False, "manifest.json": False},
        "async-in-flight": {".metadata": False, "manifest.json": False},
        "files-written": {".metadata": True, "manifest.json": False, "manifest.json.tmp": False},
        "manifest-torn": {"manifest.json.tmp": True, "manifest.json": False},
        "manifest-written": {"manifest.json": True, "manifest.json.tmp": False},
    }[phase]
    wrong = [f"{name} {'missing' if present else 'present'}" for name, present in want.items() if (name in have) != present]
    if phase in ("shard-mid-write", "async-in-flight") and not any(p.stat().st_size for p in shards):
        wrong.append("no shard bytes written")
    return f"step-{AT}.partial: {', '.join(wrong)}" if wrong else None


# --------------------------------------------------------------------------- the daemon's view
class DaemonView:
    """The FSx stand-in and the daemon's durability check, on one event loop of their own."""

    def __init__(self, endpoint_url: str) -> None:
        self.endpoint_url = endpoint_url
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout=120))

    async def export(self, root: Path, prefix: str) -> None:
        """Auto-export ``root`` (the stand-in), and the ``.partial`` files FSx exports as well."""
        exporter = LocalExporter(root=root, bucket=BUCKET, prefix=prefix, endpoint_url=self.endpoint_url,
                                 region=REGION, poll_interval=0.02)
        async with exporter:
            await exporter.wait_idle(timeout=60)
        if exporter.errors:
            raise AssertionError(f"export errors: {exporter.errors}")
        async with get_session().create_client("s3", region_name=REGION, endpoint_url=self.endpoint_url) as s3:
            for path in sorted(root.glob("step-*.partial/**/*")):
                if path.is_file():
                    key = f"{prefix}/{path.relative_to(root).as_posix()}"
                    await s3.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    async def check(self, prefix: str, *, notice: datetime) -> tuple[Any, Any]:
        """``wait_durable`` for a notice at ``notice`` (deadline now) and ``newest_durable``."""
        async with get_session().create_client("s3", region_name=REGION, endpoint_url=self.endpoint_url) as s3:
            store = S3Store(client=s3)
            uri = f"s3://{BUCKET}/{prefix}"
            waited = await wait_durable(store=store, uri=uri, notice_time=notice, deadline=datetime.now(timezone.utc),
                                        poll_interval=0.05)
            return waited, await newest_durable(store=store, uri=uri)


def _manifest_time(root: Path, step: int) -> datetime:
    import json

    text = (root / f"step-{step}" / "manifest.json").read_text()
    return datetime.fromisoformat(json.loads(text)["time"])


# --------------------------------------------------------------------------- one trial
class Trial:
    """One kill at ``phase`` in ``root`` (exported to ``s3://ckpt/<name>``) and what it showed."""

    def __init__(self, workdir: Path, phase: str, repeat: int) -> None:
        self.phase, self.nth, self.name = phase, repeat, f"{phase}-{repeat}"
        self.root = workdir / self.name
        self.root.mkdir(parents=True)
        self.want = AT if phase == "committed" else PREVIOUS
        self.problems: list[str] = []
        self.killed_at = 0.0
        self.notice: datetime | None = None

    def kill(self) -> bool:
        """Step 1: train and be killed; False when the trainer was not killed as meant."""
        died = run_ranks(ckpt_ranks.train_and_die, WORLD, str(self.root), self.phase, AT, EVERY, self.nth,
                         timeout=300)
        self.killed_at = time.monotonic()
        if not _killed(died):
            self.problems.append(f"the trainer was not SIGKILLed at {self.phase}: {died}")
            return False
        return True

    def inspect(self, view: DaemonView) -> None:
        """Steps 2-3: where the kill landed, what the daemon sees."""
        if (why := landed(self.root, self.phase)) is not None:
            self.problems.append(f"the kill did not land at {self.phase}: {why}")
        view.run(view.export(self.root, self.name))
        self.notice = _manifest_time(self.root, PREVIOUS) + timedelta(milliseconds=1)
        waited, newest = view.run(view.check(self.name, notice=self.notice))
        if self.phase == "committed":
            if not (waited.durable and waited.step == AT):
                self.problems.append(f"daemon: the whole step {AT} is not durable: {waited.reason}")
        elif waited.durable or waited.fallback_step != PREVIOUS:
            self.problems.append(f"daemon trusted the partial save: durable {waited.durable} step {waited.step}, "
                                 f"fallback {waited.fallback_step} ({waited.reason})")
        if newest is None or newest.step != self.want:
            self.problems.append(f"daemon: newest durable checkpoint {newest and newest.step}, want {self.want}")

    def resumed(self, view: DaemonView, got: list[dict[str, Any]]) -> float:
        """Step 4, given what each rank's restart returned; the seconds from the kill to whole again."""
        self.problems += _check_resume(got, self.phase, self.want)
        view.run(view.export(self.root, self.name))
        assert self.notice is not None
        _, after = view.run(view.check(self.name, notice=self.notice))
        if after is None or after.step != self.want + 1 or after.reason != "final":
            self.problems.append(f"daemon: after the resume the newest durable is "
                                 f"{after and (after.step, after.reason)}, want step {self.want + 1} (final)")
        return time.monotonic() - self.killed_at


def resume(view: DaemonView, trials: list[Trial]) -> list[float]:
    """Restart the trainer on each trial's root (in one set of rank processes); the recovery times."""
    ranks = run_ranks(ckpt_ranks.resume_and_go_on, WORLD, [str(t.root) for t in trials], timeout=300)
    per_rank = [r.unwrap() for r in ranks]
    return [t.resumed(view, [rank[k] for rank in per_rank]) for k, t in enumerate(trials)]


def _killed(died: list[Any]) -> bool:
    """Rank 0 died of its SIGKILL; every other rank too, or lost its peer in a collective (a phase
    of rank 0 only: rank 1 waits for it and gloo reports the closed connection)."""
    lost_peer = ("Connection closed by peer", "Connection reset by peer")
    return died[0].exitcode == -signal.SIGKILL and all(
        r.exitcode == -signal.SIGKILL or any(text in (r.error or "") for text in lost_peer) for r in died[1:])


def _check_resume(resumed: list[dict[str, Any]], phase: str, want: int) -> list[str]:
    problems = []
    for rank, got in enumerate(resumed):
        if got["step"] != want or not got["weights_ok"]:
            problems.append(f"rank {rank} resumed step {got['step']} (weights match: {got['weights_ok']}), want {want}")
    rejected = resumed[0]["rejected"]
    if phase == "committed":
        if rejected:
            problems.append(f"the resume rejected a whole checkpoint: {rejected}")
    elif [name for name, _ in rejected] != [f"step-{AT}.partial"] or not rejected[0][1].startswith("incomplete"):
        problems.append(f"the resume did not reject step-{AT}.partial with its reason: {rejected}")
    return problems


def scenario_checkpoint(workdir: Path, *, repeats: int, batch: bool = False,
                        moto: MotoServer | None = None) -> Tally:
    """Scenario 5: every phase ``repeats`` times (the shard cut after a different tensor each time).

    ``batch`` (the quick form): the trainers of a repeat's phases run side by side (three at a
    time), and are restarted in one set of rank processes, one root after the other (fewer
    process starts); the time to recover then includes the other phases. Otherwise each trial is
    killed, checked and resumed on its own before the next.
    """
    tally = Tally("checkpoint", "SIGKILL of the trainer (2 gloo ranks) at " + ", ".join(ckpt_ranks.PHASES))
    for key, value in FAKE_CREDENTIALS.items():
        os.environ.setdefault(key, value)
    workdir.mkdir(parents=True, exist_ok=True)
    own = moto is None
    server = moto or MotoServer(log_path=workdir / "moto.log").start()
    if not own:
        server.reset()
    view = DaemonView(server.endpoint_url)
    try:
        view.run(_make_bucket(server.endpoint_url))
        for r in range(repeats):
            trials = [Trial(workdir, phase, r) for phase in ckpt_ranks.PHASES]
            if batch:  # the trainers side by side (each its own ranks and root), then one restart of all
                with ThreadPoolExecutor(max_workers=3) as pool:
                    killed = [t for t, ok in zip(trials, pool.map(Trial.kill, trials)) if ok]
                for trial in killed:
                    trial.inspect(view)
                tally.recover_s += [round(t, 1) for t in resume(view, killed)] if killed else []
            else:
                for trial in trials:
                    if trial.kill():
                        trial.inspect(view)
                        tally.recover_s += [round(t, 1) for t in resume(view, [trial])]
            for trial in trials:
                tally.injected += 1
                tally.violations += [f"{trial.name}: {p}" for p in trial.problems]
                tally.survived += not trial.problems
        tally.extra.update(phases=list(ckpt_ranks.PHASES), batched_resume=batch)
    finally:
        view.close()
        if own:
            server.stop()
    return tally


async def _make_bucket(endpoint_url: str) -> None:
    async with get_session().create_client("s3", region_name=REGION, endpoint_url=endpoint_url) as s3:
        await s3.create_bucket(Bucket=BUCKET)
