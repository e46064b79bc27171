"""A throwaway Redis server (Debian's ``redis-server``) for Ray's GCS fault tolerance in tests.

:func:`redis_server` starts ``redis-server`` on a free 127.0.0.1 port, with no persistence
(``--save ""``, ``--appendonly no``: the Redis outlives only the GCS, not itself), in a directory
of its own, waits until it answers ``PING`` (RESP, https://redis.io/docs/latest/develop/reference/protocol-spec/),
and stops it (SIGTERM, then SIGKILL) on leaving, also on failure. :data:`REDIS_SERVER` is the
binary on the PATH or None: a caller that needs one reports itself skipped when it is None
(``make chaos`` installs it, see the Makefile).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REDIS_SERVER: str | None = shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, *, timeout: float = 1.0) -> bool:
    """Whether the Redis on 127.0.0.1:``port`` answers ``PING`` with ``+PONG``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(*, start_timeout_s: float = 30.0) -> Iterator[str]:
    """A running ``redis-server``; yields its ``127.0.0.1:port``. Stopped on leaving."""
    if REDIS_SERVER is None:
        raise FileNotFoundError("redis-server is not on the PATH (Debian: apt-get install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="redis-", dir="/tmp"))
    port = _free_port()
    log = open(workdir / "redis.log", "wb")
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--daemonize", "no"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not ping(port):
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: "
                                   f"{(workdir / 'redis.log').read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server did not answer PING within {start_timeout_s} s")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
