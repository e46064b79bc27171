"""``python -m trainer``: parse the flags, run on Ray Train (or local processes), exit code.

Exit codes: 0 finished; 75 preempted after saving (``--ray-address local``: run again to
resume); 1 the run failed; 2 bad flags (the message names the flag).
"""

from __future__ import annotations

import logging
import sys

from trainer.config import parse_args
from trainer.errors import ConfigError, TrainerError


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="time=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"python -m trainer: error: {e}", file=sys.stderr)
        return 2
    from trainer.launch import run_local, run_with_ray

    try:
        return run_local(cfg) if cfg.is_local else run_with_ray(cfg)
    except TrainerError as e:
        print(f"python -m trainer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
