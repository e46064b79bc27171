"""A local stand-in for AWS: moto in server mode on 127.0.0.1, as a child process.

Used by the tests, the benchmarks and the local drill.  The server is a separate process so
that it does not share the GIL with the asyncio code under test, and so that it can be stopped
for certain (its own process group) also when the caller fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Credentials moto accepts; never real ones.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}
#: moto's default account id.
ACCOUNT_ID = "123456789012"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's server (``python -m resilienced.local.motoserver``: ``moto.server`` with SQS's
    delete made atomic) on 127.0.0.1 and a free port.

    Use as a context manager, or call :meth:`start` / :meth:`stop` (idempotent).
    ``endpoint_url`` is what aiobotocore/boto3 clients take.
    """

    def __init__(self, *, port: int | None = None, log_path: Path | None = None,
                 start_timeout: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._log_path = log_path
        self._start_timeout = start_timeout
        self._env = dict(env or {})  # more environment for the server (motoserver's settings)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = None

    def start(self) -> "MotoServer":
        if self._proc is not None:
            return self
        env = dict(os.environ)
        env.update(FAKE_CREDENTIALS)
        env.update(self._env)
        self._log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "resilienced.local.motoserver", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=self._log, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()
                raise RuntimeError(f"moto server exited during start-up with code {code}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not answer on {self.endpoint_url} within {self._start_timeout}s")

    def reset(self) -> None:
        """Forget every resource (between tests)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- the AWS wiring
async def create_queue_with_dlq(sqs: Any, *, name: str, max_receive_count: int = 3) -> tuple[str, str]:
    """An SQS queue whose redrive policy sends poison to ``<name>-dlq``: (queue URL, DLQ URL)."""
    dlq_url = (await sqs.create_queue(QueueName=f"{name}-dlq"))["QueueUrl"]
    dlq_arn = (await sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"]))[
        "Attributes"]["QueueArn"]
    policy = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_receive_count)})
    queue_url = (await sqs.create_queue(QueueName=name, Attributes={"RedrivePolicy": policy}))["QueueUrl"]
    return queue_url, dlq_url


async def create_rules(events: Any, *, queue_url: str, sqs: Any, prefix: str = "resilienced") -> list[str]:
    """One EventBridge rule per event kind the daemon reads, each targeting the queue."""
    from handlers import registry

    queue_arn = (await sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"]))[
        "Attributes"]["QueueArn"]
    names = []
    for module in registry.MODULES:
        name = f"{prefix}-{module.KIND.value.replace('_', '-')}"
        pattern = {"source": [module.SOURCE], "detail-type": list(module.DETAIL_TYPES)}
        await events.put_rule(Name=name, EventPattern=json.dumps(pattern))
        await events.put_targets(Rule=name, Targets=[{"Id": "queue", "Arn": queue_arn}])
        names.append(name)
    return names
