"""``resilienced run`` with a responder that never finishes: for the SIGTERM test.

Run as ``python tests/intake/blocking_daemon.py <run flags>``.  Everything is the real daemon
(settings, SQS, consumer, signals, HTTP) except the responder, which is the injected seam:
it logs ``blocked`` and waits until the daemon cancels it at shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from resilienced import log
from resilienced.app import daemon
from resilienced.model import Outcome, Plan
from resilienced.settings import Settings


class Blocking:
    def __init__(self) -> None:
        self.log = log.get("blocking")

    async def act(self, plan: Plan, *, holder: str) -> Outcome:
        self.log.info("blocked", event_id=plan.event.event_id, instance_ids=list(plan.instance_ids))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(argv), os.environ).validate()
    log.configure(level="info")
    return asyncio.run(daemon.serve(settings, responder=Blocking()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
