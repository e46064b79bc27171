"""Test support: run a function on N local ranks with a real gloo process group (no Ray).

``run_ranks(target, world_size, *args)`` starts ``world_size`` processes from a forkserver that
has torch imported already (each rank starts in well under a second), initialises
``torch.distributed`` with gloo on 127.0.0.1 in each, calls ``target(rank, world_size, *args)``
and returns one :class:`RankResult` per rank: the return value, or the exception's type and
message.  A rank that exits without a result (``os._exit`` in a crash hook) has its exit code.
Every process is killed when the call returns, also on a timeout or a failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tests.support import layers

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp"])


@dataclass(frozen=True)
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # "TypeName: message"
    exitcode: int | None = None

    def unwrap(self) -> Any:
        if self.error is not None or self.exitcode not in (None, 0):
            raise AssertionError(f"rank {self.rank} failed: {self.error or f'exit code {self.exitcode}'}")
        return self.value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: a rank's error when the rendezvous port was taken between :func:`_free_port` and rank 0's listen
_PORT_TAKEN = "PortTaken"


def _rank_main(target: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=120))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        queue.put((rank, None, f"{_PORT_TAKEN}: {e}"))  # run_ranks starts over on another port
        queue.close()
        queue.join_thread()
        os._exit(0)
    try:
        queue.put((rank, target(rank, world_size, *args), None))
    except BaseException as e:  # the test asserts on it
        queue.put((rank, None, f"{type(e).__name__}: {e}"))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no destroy_process_group: a peer that failed would make it wait


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[RankResult]:
    """``target(rank, world_size, *args)`` on every rank; one result per rank, by rank.

    When another process took the rendezvous port before rank 0 listened on it (a free port is
    picked, closed, then bound again), every rank is started again on another port (3 tries).
    """
    layers.started("e2e", f"{world_size} trainer rank(s) (tests/support/ranks.py)")
    for _ in range(3):
        results = _run_ranks_once(target, world_size, args, timeout=timeout)
        if not any((r.error or "").startswith(_PORT_TAKEN) for r in results):
            return results
    return results


def _run_ranks_once(target: Callable[..., Any], world_size: int, args: tuple, *, timeout: float) -> list[RankResult]:
    queue = _CTX.Queue()
    port = _free_port()
    procs = [_CTX.Process(target=_rank_main, args=(target, r, world_size, port, args, queue), name=f"rank{r}")
             for r in range(world_size)]
    results: dict[int, RankResult] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            while not queue.empty():
                rank, value, error = queue.get()
                results[rank] = RankResult(rank, value, error)
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead:
                time.sleep(0.2)  # a result put just before the exit
                while not queue.empty():
                    rank, value, error = queue.get()
                    results[rank] = RankResult(rank, value, error)
                for r in dead:
                    results.setdefault(r, RankResult(r, exitcode=procs[r].exitcode))
                if any(results[r].exitcode for r in dead):  # crashed: the others would wait forever
                    break
            if any((r.error or "").startswith(_PORT_TAKEN) for r in results.values()):
                break  # the others wait for rank 0's store: start over
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout}s (results so far: {results})")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.pid is None:
                continue
            if p.exitcode is None:
                p.kill()
            p.join(timeout=30)
    return [results.get(r, RankResult(r, exitcode=procs[r].exitcode)) for r in range(world_size)]
