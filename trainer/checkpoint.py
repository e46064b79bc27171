"""Checkpoints: save, commit, verify, resume, clean up; the manifest.

Layout under the checkpoint root (the contract with the daemon, which exports it to S3)::

    <root>/step-<N>.partial/     a save in progress (never resumed, never exported)
    <root>/step-<N>/             committed: renamed from .partial after manifest.json was written
        .metadata                DCP's global metadata (rank 0)
        __<rank>_0.distcp        DCP data, one file per rank (every entry of the state, sharded)
        rng-rank<R>.pt           rank R's RNG states (torch, CUDA, numpy, python)
        manifest.json            written last

``manifest.json``::

    {"format": "resilienced-checkpoint/1", "step": N, "world_size": W,
     "time": "2026-11-30T00:00:00.123456Z", "saved_at_unix": 1796083200.123456,
     "reason": "preemption" | "periodic" | "final" | "resize",
     "files": [{"path": "__0_0.distcp", "size": 123, "sha256": "<hex>"}, ...]}

``files`` lists every file of the directory except ``manifest.json`` itself, by posix path
relative to the step directory; nothing outside that list is needed to resume.  ``step-<N>``
holds the state after N optimizer steps (steps 1..N were trained).  ``trainer.resilience``
drives this module; ``write_manifest`` and ``verify`` are also public through it.

A save is a collective over a dedicated gloo process group (so ``dcp.async_save`` can run its
collectives in a background thread while training uses the default group):

1. rank 0 makes ``step-<N>.partial/`` (removing a stale one); barrier;
2. every rank writes its RNG file, then ``dcp.save`` (or ``dcp.async_save``) writes the DCP files;
3. every rank fsyncs and hashes the files it wrote (the two at once, all ranks in parallel) and
   rank 0 gathers the lists;
4. rank 0 writes ``manifest.json`` (to a temporary name, fsync, rename), fsyncs the directory,
   renames ``step-<N>.partial`` to ``step-<N>`` and fsyncs the root;
5. the caller reports the checkpoint to Ray Train and prunes old ones (rank 0).

A framework's own save (trainer.integrations: the Hugging Face Trainer's ``checkpoint-<N>``,
Lightning's ``save_checkpoint`` into ``step-<N>.partial``) is committed by
``CheckpointStore.commit_written``: steps 3-4 over whatever files every rank wrote (each rank
hashing a share of them), the same manifest, written last.

A crash anywhere before the rename leaves a ``.partial`` directory, which resume rejects and
deletes; a crash after it leaves a complete checkpoint.  Resume picks the newest committed
directory whose manifest parses and whose every listed file exists with its size and checksum;
anything newer that fails is rejected (with the reason) and deleted.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.errors import CheckpointError, CorruptCheckpoint
from trainer.manifest import MANIFEST, REASONS, STEP_DIR, FileEntry, Manifest, ManifestError

_COMMITTED = STEP_DIR
_PARTIAL = re.compile(r"^step-([0-9]+)\.partial$")
_HASH_CHUNK = 8 * 1024 * 1024


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}.partial"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(paths: list[Path]) -> list[tuple[int, str]]:
    """fsync and hash files at the same time: (size, sha256) of each, all durable on return.

    The hash reads the files back from the page cache (CPU) while the fsyncs wait for the disk
    (I/O); both release the GIL, so a save costs about the larger of the two, not their sum.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2 * len(paths), thread_name_prefix="ckpt-seal") as pool:
        syncs = [pool.submit(_fsync_file, p) for p in paths]
        hashes = [pool.submit(hash_file, p) for p in paths]
        for f in syncs:
            f.result()
        return [f.result() for f in hashes]


def verify(step_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of a committed checkpoint whose files all match it, else CorruptCheckpoint.

    ``step_dir`` is a ``step-<N>`` directory; it verifies when its ``manifest.json`` parses, says
    step N, and every file it lists exists with the listed size and sha256.
    """
    path = Path(step_dir)
    where = str(path)
    m = _COMMITTED.match(path.name)
    if not m:
        raise CorruptCheckpoint(where, "not a committed step directory name (step-<N>)")
    manifest_path = path / MANIFEST
    try:
        text = manifest_path.read_text()
    except FileNotFoundError:
        raise CorruptCheckpoint(where, "manifest.json is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(where, f"manifest.json cannot be read: {e}") from e
    try:
        manifest = Manifest.parse(text, where=where)
    except ManifestError as e:
        raise CorruptCheckpoint(where, f"manifest {e.why}") from e
    if manifest.step != int(m.group(1)):
        raise CorruptCheckpoint(where, f"manifest says step {manifest.step}, directory says {m.group(1)}")
    if manifest.world_size < 1:
        raise CorruptCheckpoint(where, f"manifest world_size {manifest.world_size} is not positive")
    for entry in manifest.files:
        file = path / entry.path
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(where, f"{entry.path} is listed but missing") from None
        if size != entry.size:
            raise CorruptCheckpoint(where, f"{entry.path} has {size} bytes, manifest says {entry.size}")
        _, digest = hash_file(file)
        if digest != entry.sha256:
            raise CorruptCheckpoint(where, f"{entry.path} sha256 {digest} does not match the manifest")
    return manifest


# ---------------------------------------------------------------------- scanning (one process)
@dataclass(frozen=True)
class Rejected:
    path: Path
    why: str


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    manifest: Manifest


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed-looking directory (not verified), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _COMMITTED.match(child.name)
        if m and child.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_resume_point(root: Path, *, clean_up: bool = True) -> tuple[ResumePoint | None, list[Rejected]]:
    """The newest complete checkpoint, and what was rejected on the way (deleted if clean_up).

    Partial directories are always rejected; committed ones newer than the one chosen are
    rejected when their manifest or files do not check out.  Older committed checkpoints are not
    read at all.
    """
    rejected: list[Rejected] = []
    if not root.is_dir():
        return None, rejected
    for child in sorted(root.iterdir()):
        if clean_up and child.name.startswith(".trash-step-"):  # a delete cut short by a crash
            shutil.rmtree(child, ignore_errors=True)
            continue
        m = _PARTIAL.match(child.name)
        if m:
            has_manifest = (child / MANIFEST).exists()
            why = (
                "incomplete: manifest.json written but the directory was never committed (renamed)"
                if has_manifest
                else "incomplete: the save did not finish (no manifest.json)"
            )
            rejected.append(Rejected(child, why))
    chosen: ResumePoint | None = None
    for step in reversed(committed_steps(root)):
        path = step_dir(root, step)
        try:
            chosen = ResumePoint(path, verify(path))
            break
        except CorruptCheckpoint as e:
            rejected.append(Rejected(path, e.why))
    if clean_up:
        for r in rejected:
            _remove_tree(r.path)
    return chosen, rejected


def prune(root: Path, *, keep: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep``; returns what was deleted."""
    steps = committed_steps(root)
    doomed = [step_dir(root, s) for s in steps[: max(0, len(steps) - keep)]]
    for path in doomed:
        _remove_tree(path)
    return doomed


def _remove_tree(path: Path) -> None:
    """Delete a checkpoint directory: rename it out of the step-* namespace first, then remove."""
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- RNG states
def capture_rng() -> dict[str, Any]:
    """This process's RNG states, in a form ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- the manifest, written
def build_manifest(
    step_dir: Path, step: int, *, world_size: int, reason: str, hashed: tuple[FileEntry, ...] = (),
    save_seconds: float | None = None,
) -> Manifest:
    """The manifest of a step directory: ``hashed`` entries as given, every other file hashed here."""
    files = {e.path: e for e in hashed}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(step_dir).as_posix()
        if rel not in files and rel not in (MANIFEST, MANIFEST + ".tmp"):
            (size, digest), = _seal([path])  # a file no rank claimed: list it all the same
            files[rel] = FileEntry(rel, size, digest)
    now = time.time()
    return Manifest(
        step=step, world_size=world_size, time=datetime.fromtimestamp(now, tz=timezone.utc), saved_at_unix=now, reason=reason,
        files=tuple(files[k] for k in sorted(files)), save_seconds=save_seconds,
    )


def put_manifest(step_dir: Path, manifest: Manifest, *, torn: Callable[[], None] = lambda: None) -> None:
    """Write ``manifest.json`` atomically (temporary name, fsync, rename, fsync of the directory)."""
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    torn()
    os.replace(tmp, step_dir / MANIFEST)
    _fsync_dir(step_dir)


def write_manifest(
    step_dir: str | os.PathLike[str], step: int, *, world_size: int = 1, reason: str = "final"
) -> Manifest:
    """Hash (and fsync) every file of ``step_dir`` and write its ``manifest.json`` last.

    For checkpoints written some other way than :class:`trainer.resilience.Checkpointer`: write
    every data file into the step directory first, then call this; the daemon counts the
    checkpoint once ``step-<step>/manifest.json`` and every file it lists are in S3.
    """
    path = Path(step_dir)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if reason not in REASONS:
        raise ValueError(f"unknown checkpoint reason {reason!r}; expected one of {REASONS}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    manifest = build_manifest(path, step, world_size=world_size, reason=reason)
    if not manifest.files:
        raise CheckpointError(f"{path} holds no file to list in a manifest")
    put_manifest(path, manifest)
    return manifest


# ---------------------------------------------------------------------- the collective writer
@dataclass
class PendingSave:
    """A save whose files are being (or have been) written; committed by :meth:`CheckpointStore.commit`."""

    step: int
    reason: str
    started: float  # perf_counter at the start of the save
    future: Future | None  # dcp.async_save's future; None for a synchronous save

    def written(self) -> bool:
        return self.future is None or self.future.done()


@dataclass(frozen=True)
class Committed:
    step: int
    reason: str
    path: Path
    save_seconds: float
    bytes: int


class CheckpointStore:
    """Writes and reads the checkpoints of one rank, collectively with every other rank.

    Args:
        root: the checkpoint root (shared by every rank: FSx in production).
        rank, world_size: this process's place in the job.
        group: a gloo process group over every rank, used only for checkpoints.

    :meth:`at_phase` is called at each phase of a commit; it does nothing here.  It is the seam a
    test fills, with a subclass that crashes there (``Checkpointer.store_type``;
    tests/support/crashing.py, and ``python -m trainer --crash-at``).
    """

    def __init__(
        self,
        *,
        root: Path,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.group = group
        # one process and no process group at all: DCP without collectives (and without its warning)
        self._no_dist = group is None and not (dist.is_available() and dist.is_initialized())

    def at_phase(self, phase: str, step: int) -> None:
        """A phase of the commit of ``step`` was reached: ``files-written`` (every rank: data and
        RNG files durable, no manifest), ``manifest-torn`` (rank 0: ``manifest.json.tmp``
        written, not yet renamed), ``manifest-written`` (rank 0: ``manifest.json`` in place,
        directory not renamed), ``committed`` (every rank: renamed to ``step-<N>``)."""

    # -------------------------------------------------------------- save
    def start(self, state: dict[str, Any], *, step: int, reason: str, use_async: bool = False) -> PendingSave:
        """Begin a save of ``state`` (DCP entries) as step ``step`` (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        if reason not in REASONS:
            raise ValueError(f"unknown checkpoint reason {reason!r}; expected one of {REASONS}")
        started = time.perf_counter()
        partial = partial_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                _remove_tree(partial)
            partial.mkdir()
        self._barrier()
        torch.save(capture_rng(), partial / rng_file(self.rank))
        # No fsync inside DCP: commit() fsyncs every file while it hashes them (both at once).
        writer = FileSystemWriter(partial, single_file_per_rank=True, sync_files=False, thread_count=1)
        if use_async:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group, no_dist=self._no_dist)
            return PendingSave(step, reason, started, future)
        dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self._no_dist)
        return PendingSave(step, reason, started, None)

    def commit(self, pending: PendingSave) -> Committed:
        """Hash, write the manifest, rename (collective).  Waits for an async save's files."""
        if pending.future is not None:
            pending.future.result()
        step = pending.step
        partial = partial_dir(self.root, step)
        mine = [partial / rng_file(self.rank)]
        mine += sorted(partial.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(partial / ".metadata")
        entries = [
            FileEntry(path.relative_to(partial).as_posix(), size, digest)
            for path, (size, digest) in zip(mine, _seal(mine), strict=True)
        ]
        return self._gather_and_commit(partial, entries, step=step, reason=pending.reason, started=pending.started)

    def save(self, state: dict[str, Any], *, step: int, reason: str) -> Committed:
        """A synchronous save and commit (collective)."""
        return self.commit(self.start(state, step=step, reason=reason))

    # -------------------------------------------------------------- checkpoints another writer made
    def open_partial(self, step: int) -> Path:
        """Rank 0 makes an empty ``step-<N>.partial/`` (removing a stale one); every rank gets it
        after a barrier (collective).  For a framework's own save (trainer.integrations)."""
        partial = partial_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                _remove_tree(partial)
            partial.mkdir()
        self._barrier()
        return partial

    def commit_written(self, written: Path, *, step: int, reason: str, started: float) -> Committed:
        """Commit a directory whose files every rank has written some other way (collective).

        ``written`` (``step-<N>.partial``, or a framework's own directory such as the Hugging Face
        Trainer's ``checkpoint-<N>``, on the same file system as the root) becomes ``step-<N>``
        with the same manifest as :meth:`commit`, written last: after a barrier (every rank's
        files are written) rank 0 lists the files, the ranks fsync and hash a share each (every
        ``world_size``-th file), rank 0 gathers the entries, writes ``manifest.json``, renames the
        directory and fsyncs the root.  ``started``: ``perf_counter()`` when the save began.
        """
        if reason not in REASONS:
            raise ValueError(f"unknown checkpoint reason {reason!r}; expected one of {REASONS}")
        self._barrier()
        names: list[Any] = [None]
        if self.rank == 0:
            names = [sorted(p.relative_to(written).as_posix() for p in written.rglob("*")
                            if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp"))]
        if self.world_size > 1:
            dist.broadcast_object_list(names, src=0, group=self.group)
        if not names[0]:  # every rank raises: none waits for the others
            raise CheckpointError(f"{written} holds no file: the save wrote nothing")
        mine = names[0][self.rank::self.world_size]
        entries = [FileEntry(rel, size, digest)
                   for rel, (size, digest) in zip(mine, _seal([written / rel for rel in mine]) if mine else [],
                                                  strict=True)]
        return self._gather_and_commit(written, entries, step=step, reason=reason, started=started)

    def _gather_and_commit(self, directory: Path, entries: list[FileEntry], *, step: int, reason: str,
                         started: float) -> Committed:
        """Rank 0 gathers every rank's file entries, writes the manifest last and renames
        ``directory`` to ``step-<N>/``; every rank returns the commit (collective)."""
        gathered: list[list[FileEntry]] | None = [[] for _ in range(self.world_size)] if self.rank == 0 else None
        if self.world_size > 1:
            dist.gather_object(entries, gathered, dst=0, group=self.group)
        else:
            gathered = [entries]
        self.at_phase("files-written", step)
        committed_path = step_dir(self.root, step)
        total = 0
        if self.rank == 0:
            assert gathered is not None
            manifest = build_manifest(directory, step, world_size=self.world_size, reason=reason,
                                      hashed=tuple(e for rank_entries in gathered for e in rank_entries),
                                      save_seconds=time.perf_counter() - started)
            total = sum(f.size for f in manifest.files)
            put_manifest(directory, manifest, torn=lambda: self.at_phase("manifest-torn", step))
            self.at_phase("manifest-written", step)
            if committed_path.exists():  # a stale commit of the same step from an older attempt
                _remove_tree(committed_path)
            directory.rename(committed_path)
            _fsync_dir(self.root)
        self._barrier()
        self.at_phase("committed", step)
        total = self._broadcast_int(total)
        return Committed(step, reason, committed_path, time.perf_counter() - started, total)

    # -------------------------------------------------------------- load
    def load(self, point: ResumePoint, state: dict[str, Any]) -> bool:
        """Load ``state`` (DCP entries, in place) and, same world size, this rank's RNG states.

        Returns whether the RNG states were restored.
        """
        import torch.distributed.checkpoint as dcp

        try:
            dcp.load(state, checkpoint_id=point.path, process_group=self.group, no_dist=self._no_dist)
        except Exception as e:  # DCP raises several kinds; the boundary says which checkpoint
            raise CheckpointError(f"loading {point.path} failed: {e}") from e
        rng_path = point.path / rng_file(self.rank)
        if point.manifest.world_size == self.world_size and rng_path.exists():
            restore_rng(torch.load(rng_path, weights_only=True))
            return True
        return False

    # -------------------------------------------------------------- collectives
    def barrier(self) -> None:
        """Every rank waits for every other, on the checkpoint group."""
        self._barrier()

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def _broadcast_int(self, value: int) -> int:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return int(box[0])

    def broadcast_resume(self, clean_up: bool = True) -> tuple[ResumePoint | None, list[Rejected]]:
        """Rank 0 scans (and cleans up); every rank gets the same answer."""
        answer: list[Any] = [None]
        if self.rank == 0:
            answer = [find_resume_point(self.root, clean_up=clean_up)]
        if self.world_size > 1:
            dist.broadcast_object_list(answer, src=0, group=self.group)
        return answer[0]
