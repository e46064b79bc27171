"""The daemon as deployed, for the ``cluster`` tests: ``resilienced run``'s own flags and
environment, its own process, and two stand-ins for what cannot run here.

``python -m tests.support.controlplane.daemon --stand-ins FILE [resilienced run flags ...]``
parses the flags as ``resilienced run`` does (``Settings.from_args``) and runs
:func:`resilienced.app.daemon.run` with :class:`resilienced.app.runtime.StandIns` read from FILE
(JSON):

* ``gcs``: the Ray side of the pods, the recording stand-in ``bench/burst.py`` uses: ``{"nodes":
  {GCS address: [RayNode fields ...]}, "drains": PATH}``; the node lists are read again at each
  call (the test writes the new pods' IPs after a requeue), and each drain is appended to PATH as
  a JSON line ``{"node_id", "address", "deadline", "pid", "t"}`` (``t``: when, unix seconds);
* ``blocks``: the Capacity Blocks EC2 would list (``ports.CapacityReservation`` fields, times in
  ISO 8601), served by ``resilienced.local.capacity.StaticCapacity``.

Everything else is the daemon's: the kubeconfig (the ServiceAccount's token), SQS and S3 (moto),
the claims and follow-ups on Leases, the requeue and the follow-up through the real controllers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from resilienced import log
from resilienced.app import daemon
from resilienced.app.runtime import StandIns
from resilienced.local.capacity import StaticCapacity
from resilienced.ports import CapacityReservation, DrainResult, RayNode
from resilienced.settings import Settings


class FileGcs:
    """``(address, token) -> RayControl`` over the node lists of a JSON file (see the docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _world(self) -> dict[str, Any]:
        return dict(json.loads(self.path.read_text())["gcs"])

    def __call__(self, address: str, token: str | None) -> FileControl:
        return FileControl(self, address)


class FileControl:
    def __init__(self, gcs: FileGcs, address: str) -> None:
        self._gcs, self.address = gcs, address

    async def nodes(self) -> list[RayNode]:
        found = self._gcs._world()["nodes"].get(self.address, [])
        return [RayNode(node_id=n["node_id"], address=n["address"], labels=n.get("labels", {}),
                        alive=n.get("alive", True), is_head=n.get("is_head", False)) for n in found]

    async def drain(self, node_id: str, *, deadline: datetime, message: str) -> DrainResult:
        with open(self._gcs._world()["drains"], "a") as f:
            f.write(json.dumps({"node_id": node_id, "address": self.address, "deadline": deadline.isoformat(),
                                "pid": os.getpid(), "t": time.time()}) + "\n")
        return DrainResult(node_id, "drained", True, int(deadline.timestamp() * 1000))

    async def close(self) -> None:
        pass


def _block(fields: dict[str, Any]) -> CapacityReservation:
    times = {k: datetime.fromisoformat(fields[k]) if fields.get(k) else None for k in ("start", "end")}
    return CapacityReservation(**{**fields, **times})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.controlplane.daemon")
    parser.add_argument("--stand-ins", required=True, type=Path)
    Settings.add_arguments(parser)
    args = parser.parse_args(argv)
    world = json.loads(args.stand_ins.read_text())
    settings = Settings.from_args(args, os.environ).validate()
    log.configure(level=settings.log.log_level)
    stand_ins = StandIns(capacity=StaticCapacity([_block(b) for b in world.get("blocks", [])]),
                         ray_control=FileGcs(args.stand_ins))
    return asyncio.run(daemon.run(settings, stand_ins=stand_ins))


if __name__ == "__main__":
    sys.exit(main())
