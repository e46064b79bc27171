"""``python -m tests.support.controlplane --kubeconfig FILE [--components a,b,...]``

Starts the real control plane in the foreground (default: every component), installs the CRDs,
writes an admin kubeconfig to FILE, prints ``ready`` once every component answers, and stops
everything it started on SIGTERM or Ctrl-C.  Exit status: 0 after a stop asked for, 1 when a
component did not start or ended by itself, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .build import MissingBuild
from .plane import COMPONENTS, ControlPlane, StartError


def _components(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMPONENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown component(s) {', '.join(unknown) or '(none given)'}: choose from {','.join(COMPONENTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.controlplane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="where to write the admin kubeconfig")
    parser.add_argument("--components", type=_components, default=list(COMPONENTS),
                        help=f"comma-separated, of {','.join(COMPONENTS)} (default: all; the API server always)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    plane = ControlPlane(components=args.components)
    try:
        plane.start()
    except (StartError, MissingBuild) as err:
        print(f"controlplane: {err}", file=sys.stderr)
        return 1
    try:
        plane.write_kubeconfig(args.kubeconfig)
        print(f"ready: {', '.join(plane.running())} at {plane.url} (kubeconfig {args.kubeconfig})", flush=True)
        while not stop.wait(1.0):
            down = [p.name for p in plane.processes if not p.alive()]
            if down:
                print(f"controlplane: {', '.join(down)} ended by itself:\n{plane.logs(down)}", file=sys.stderr)
                return 1
        return 0
    finally:
        plane.stop()
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
