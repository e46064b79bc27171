"""``make test``: the e2e layer and the other two side by side, as two pytest processes.

``python tests/run_layers.py [PYTEST ARGS...]`` runs ``pytest -m e2e`` in the foreground (its
output as it comes) and ``pytest -m "unit or integration"`` beside it, its output kept in a file
and printed once the e2e layer is done. The e2e tests still run one after the other (two Ray
clusters and two trainers at once on two cores would make their bounds a question of luck); the
fast layers, which start no Ray, fill the other core meanwhile. Exit status: 0 when both passed,
else the first non-zero of (e2e, fast layers). Ctrl-C stops both. docs/development.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

LAYERS = {"e2e": "e2e", "unit and integration": "unit or integration"}


def main(argv: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", *argv]
    with tempfile.TemporaryFile(mode="w+b") as kept:
        started = time.monotonic()
        fast = subprocess.Popen([*base, "-p", "no:cacheprovider", "-m", LAYERS["unit and integration"]], stdout=kept,
                                stderr=subprocess.STDOUT)
        e2e = subprocess.Popen([*base, "-m", LAYERS["e2e"]])
        try:
            codes = {"e2e": e2e.wait()}
            e2e_s = time.monotonic() - started
            codes["unit and integration"] = fast.wait()
        except KeyboardInterrupt:
            for proc in (e2e, fast):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in (e2e, fast):
                proc.wait()
            return 130
        total_s = time.monotonic() - started
        kept.seek(0)
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), b"\n===== the unit and integration layers (run beside the e2e layer) =====\n")
        while chunk := kept.read(1 << 16):
            os.write(sys.stdout.fileno(), chunk)
    print(f"\nmake test: e2e exit {codes['e2e']} ({e2e_s:.0f} s), unit and integration exit "
          f"{codes['unit and integration']}; {total_s:.0f} s in all", flush=True)
    return next((code for code in codes.values() if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
