"""Test support for real local Ray clusters: keep a node busy so that a drain keeps it alive.

An idle Ray node that is drained exits at once (seen here); a node running a task stays draining
until the deadline, as a training worker's node does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from resilienced.local.raycluster import LocalRayCluster

BUSY_DRIVER = """
import sys, time, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=1)
class Holder:
    def ping(self):
        return "pong"

holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(sys.argv[2], soft=False)).remote()
assert ray.get(holder.ping.remote(), timeout=120) == "pong"
print("READY", flush=True)
sys.stdin.read()  # hold the node busy until the test closes stdin or kills us
"""


@contextlib.contextmanager
def busy(cluster: LocalRayCluster, node_id: str, *, timeout: float = 120.0) -> Iterator[None]:
    """Keep a node busy (an actor holding its CPU, from a driver process) while inside."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(cluster.env)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", BUSY_DRIVER, cluster.address, node_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, cwd=cluster.workdir, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        lines = []
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.strip() == "READY":
                break
        else:
            raise TimeoutError("the busy driver did not get its actor placed in time")
        if not lines or lines[-1].strip() != "READY":
            raise RuntimeError("the busy driver failed:\n" + "".join(lines[-30:]))
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
