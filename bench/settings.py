"""The settings machinery against pydantic-settings: import + parse time, RSS, installed size.

Issue #22 asks whether ``options.py`` / ``settings.py`` / ``capacity/policy.py`` (our flag, env and
validation machinery) should give way to pydantic-settings.  This measures both doing the daemon's
start-up job: a fresh interpreter imports the settings and builds them from ``run``'s flags and
the ``RESILIENCED_*`` environment.

- ``ours``: ``Settings.from_args(argv, environ).validate()`` (what ``daemon.main`` does);
- ``pydantic``: a pydantic-settings ``BaseSettings`` with the same 65 fields (names, types,
  defaults, help, the ``RESILIENCED_`` env prefix, kebab-case flags from the CLI source), generated
  from ours into a temporary module so that its class creation is part of the import, as in a
  port.  It leaves out our range and URL checks and the AWS fallback variables (a port would add
  validators: the figure is a lower bound of pydantic-settings' cost).

Each run is a fresh ``python`` (runs of the two interleaved, ``--runs`` each); printed: the median
time from interpreter start to settings built, the peak RSS (``VmHWM``: ``ru_maxrss`` would count the parent's RSS at the fork) over a bare interpreter
(``python -c pass``, measured in the same run), the modules loaded, the daemon's own imports for scale (``daemon``: ``resilienced.app.daemon`` and
``app.runtime``, which load aiobotocore, kubernetes_asyncio, aiohttp and Ray's GCS client), and the installed size of the
packages pydantic-settings would add to the daemon image (deploy/images/daemon-requirements.txt
has none of them).  Ratios are pydantic / ours.

    .venv/bin/python bench/settings.py [--runs 15]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGV = ["--queue-url", "https://sqs.us-east-1.amazonaws.com/123456789012/resilienced", "--mode", "kubernetes",
        "--concurrency", "20"]
ENVIRON = {"RESILIENCED_CLAIMS_NAMESPACE": "ml", "RESILIENCED_LOG_LEVEL": "info"}
#: What pydantic-settings brings that the daemon image lacks (typing_extensions it has already).
ADDED = ("pydantic", "pydantic_core", "pydantic-settings", "python-dotenv", "annotated-types", "typing-inspection")

CHILD = """
import time, sys, json
t0 = time.perf_counter()
{body}
t1 = time.perf_counter()
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"s": t1 - t0, "rss_kb": peak, "modules": len(sys.modules)}}))
"""

OURS = """
from resilienced.settings import Settings
Settings.from_args({argv!r}, {environ!r}).validate()
"""

PYDANTIC = """
import os
os.environ.update({environ!r})
from bench_settings_model import Settings
Settings(_cli_parse_args={argv!r})
"""

BARE = "pass"
#: For scale: everything ``resilienced run`` imports before it reads a setting.
DAEMON = "import resilienced.app.daemon, resilienced.app.runtime"


def pydantic_model() -> str:
    """The source of a flat pydantic-settings model with the fields of every settings group."""
    from resilienced.options import Option, flag_of
    from resilienced.settings import Settings

    lines = ["from __future__ import annotations", "from datetime import timedelta",
             "import datetime", "from decimal import Decimal", "from pydantic import Field",
             "from pydantic_settings import BaseSettings, SettingsConfigDict", "",
             "class Settings(BaseSettings):",
             "    model_config = SettingsConfigDict(env_prefix='RESILIENCED_', cli_kebab_case=True,",
             "                                      cli_prog_name='resilienced run', frozen=True)"]
    seen = set()
    for group in Settings.GROUPS.values():
        for f in group.options():
            meta: Option = f.metadata["option"]
            name = flag_of(f)[2:].replace("-", "_")
            if name in seen:
                continue
            seen.add(name)
            default = f.default.value if hasattr(f.default, "value") else f.default
            kind = "str" if hasattr(f.default, "value") else f.type  # an enum setting (Mode ...): its text
            lines.append(f"    {name}: {kind} = Field({default!r}, description={meta.help!r})")
    return "\n".join(lines) + "\n"


def child(body: str, *, path: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{ROOT}", "PYTHONDONTWRITEBYTECODE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("RESILIENCED_")}
    out = subprocess.run([sys.executable, "-c", CHILD.format(body=body)], capture_output=True, text=True,
                         env=env, check=True, cwd=path)
    return json.loads(out.stdout.strip().splitlines()[-1])


def installed_mb(names: tuple[str, ...]) -> float:
    total = 0
    for name in names:
        dist = importlib.metadata.distribution(name)
        total += sum(os.path.getsize(p) for f in dist.files or () if (p := dist.locate_file(f)).exists())
    return total / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        (path / "bench_settings_model.py").write_text(pydantic_model())
        bodies = {"bare": BARE, "ours": OURS.format(argv=ARGV, environ=ENVIRON),
                  "pydantic": PYDANTIC.format(argv=ARGV, environ=ENVIRON), "daemon": DAEMON}
        for body in bodies.values():  # warm the file cache once; not counted
            child(body, path=path)
        seen: dict[str, list[dict[str, float]]] = {name: [] for name in bodies}
        for _ in range(runs):
            for name, body in bodies.items():
                seen[name].append(child(body, path=path))
    bare_rss = statistics.median(r["rss_kb"] for r in seen["bare"])
    rows = {}
    for name in ("ours", "pydantic", "daemon"):
        rows[name] = {"ms": 1000 * statistics.median(r["s"] for r in seen[name]),
                      "rss_mb": (statistics.median(r["rss_kb"] for r in seen[name]) - bare_rss) / 1024,
                      "modules": statistics.median(r["modules"] for r in seen[name])}
    print(f"{runs} fresh interpreters each, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'':10} {'import+parse ms':>16} {'RSS over bare MB':>17} {'modules':>8}")
    for name, row in rows.items():
        print(f"{name:10} {row['ms']:16.1f} {row['rss_mb']:17.1f} {row['modules']:8.0f}")
    ours, pyd, daemon = rows["ours"], rows["pydantic"], rows["daemon"]
    print(f"ratio pydantic/ours: time {pyd['ms'] / ours['ms']:.2f}x, RSS {pyd['rss_mb'] / ours['rss_mb']:.2f}x")
    print(f"pydantic-settings adds {pyd['ms'] - ours['ms']:.0f} ms and {pyd['rss_mb'] - ours['rss_mb']:.1f} MB to "
          f"the daemon's imports ({daemon['ms']:.0f} ms, {daemon['rss_mb']:.1f} MB): "
          f"+{(pyd['ms'] - ours['ms']) / daemon['ms']:.0%} time, +{(pyd['rss_mb'] - ours['rss_mb']) / daemon['rss_mb']:.0%} RSS")
    print(f"image: +{installed_mb(ADDED):.1f} MB installed ({', '.join(ADDED)}) for pydantic-settings")


if __name__ == "__main__":
    main()
