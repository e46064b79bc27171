"""A daemon as a real child process, whose JSON log lines the test can wait for."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class DaemonProcess:
    """``python -m resilienced ...`` (or a script) with stdout parsed as JSON lines."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        environ = dict(os.environ)
        environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
        environ.update(env or {})
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=environ,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _drain(self, timeout: float) -> bool:
        """Take one line if one comes within ``timeout``; False once stdout has ended."""
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            return True
        if line is None:
            self._queue.put(None)  # keep the end marker for later calls
            return False
        self.raw.append(line)
        try:
            self.lines.append(json.loads(line))
        except ValueError:
            pass
        return True

    def read_available(self) -> None:
        """Take every line already read from stdout, without waiting."""
        while not self._queue.empty() and self._drain(0):
            pass

    def wait_for(self, condition: Callable[[list[dict[str, Any]]], bool], *, timeout: float = 60.0) -> None:
        """Read log lines until ``condition(lines)`` holds (bounded); fail with the output if not."""
        end = time.monotonic() + timeout
        while not condition(self.lines):
            if time.monotonic() > end or (not self._drain(0.1) and self.proc.poll() is not None):
                raise AssertionError(f"condition not met; exit={self.proc.poll()}\n"
                                     f"stdout:\n{''.join(self.raw)}\nstderr:\n{self.stderr()}")

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("event") == name]

    def terminate(self, *, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit status (reading the rest of stdout)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout=timeout)

    def wait_exit(self, *, timeout: float = 60.0) -> int:
        """Wait for the exit status, reading the rest of stdout."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        while self._drain(1.0):
            pass
        return code

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        return self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
