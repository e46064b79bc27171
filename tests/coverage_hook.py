"""Coverage.py in a Python process from its start: copied by tests/run_coverage.py into the
environment's site-packages and called by its ``.pth`` file when ``COVERAGE_PROCESS_START`` is set.
coverage.py's own ``a1_coverage.pth`` (installed with it since 7.10) has started it by then; a
version without one is started here.

A Ray worker process (Ray's ``default_worker.py``: a Ray Train rank, the controller and its
actors) is ended below Python when its actor is killed or its worker group shut down: neither
``atexit`` nor ``os._exit`` runs, so coverage.py's save at exit never happens there. In those
processes a daemon thread saves what was measured every :data:`SAVE_EVERY_S` seconds instead
(coverage.py's collector copies its data before it writes, so a save beside running threads is
safe); what a worker ran in its last second before such an end is not counted.
"""

from __future__ import annotations

import os
import sys
import threading
import time

SAVE_EVERY_S = 1.0
_saving: list[threading.Thread] = []  # the .pth can run twice (a site directory seen twice)


def start() -> None:
    if not os.environ.get("COVERAGE_PROCESS_START"):
        return
    import coverage

    cov = coverage.process_startup() or coverage.Coverage.current()
    if cov is None or _saving or not sys.argv or not sys.argv[0].endswith("default_worker.py"):
        return

    def save_periodically() -> None:
        while True:
            time.sleep(SAVE_EVERY_S)
            try:
                cov.save()
            except Exception as e:  # noqa: BLE001 - a measurement aid must not end the worker
                print(f"coverage_hook: saving stopped in pid {os.getpid()}: {e!r}", file=sys.stderr)
                return

    _saving.append(threading.Thread(target=save_periodically, name="coverage-save", daemon=True))
    _saving[0].start()
