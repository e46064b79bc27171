"""The ``resilienced`` command line: a registry of subcommands.

Each subcommand is a module with ``configure(parser)`` and ``main(args) -> int``.  The daemon's
own commands are registered below by one line each; the local stand-ins' commands (``demo``,
``drill``: ``resilienced.local``) are plugins, found through the ``resilienced.commands`` entry
points of the installed distribution (pyproject.toml), so nothing here imports
``resilienced.local``.  An entry point names a ``(module, one-line help)`` pair.  Only the
chosen subcommand's module is imported, so a heavy one (``drill`` imports Ray) costs nothing to
the others.

Errors: a :class:`~resilienced.errors.ConfigError` (bad flag, environment value or path) prints
``resilienced: error: <setting>: <message>`` and exits 2, as argparse does for usage errors;
a start-up failure (the queue does not answer) exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from resilienced import __version__
from resilienced.errors import ConfigError, ResilienceError

#: The group of the entry points that add subcommands (``name = "package.module:PAIR"``).
ENTRY_POINT_GROUP = "resilienced.commands"

#: name -> (module, one-line help): the daemon's own commands.  Adding one is one line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("resilienced.app.daemon", "the daemon: consume the queue until SIGTERM"),
    "replay": ("resilienced.app.replay", "say what the daemon would decide for message bodies in files"),
    "status": ("resilienced.app.status", "what the daemon did to which run, read back from its claims"),
    "inject": ("resilienced.app.inject", "put events on a queue or an event bus, as AWS would (game days)"),
    "report": ("resilienced.app.report", "what each interruption of a run cost and what its capacity cost (its ledger)"),
}


def commands() -> dict[str, tuple[str, str]]:
    """Every subcommand: :data:`COMMANDS`, then the plugins of :data:`ENTRY_POINT_GROUP` by name
    (a plugin may not replace a command of the daemon)."""
    found = dict(COMMANDS)
    for entry in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if entry.name not in found:
            module_name, help_text = entry.load()
            found[entry.name] = (module_name, help_text)
    return found


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser, with the chosen subcommand's flags configured (others only listed)."""
    parser = argparse.ArgumentParser(
        prog="resilienced",
        description="Turns an EC2 interruption notice into a durable checkpoint and a requeued gang.")
    parser.add_argument("--version", action="version", version=f"resilienced {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in commands().items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.configure(command)
            command.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser_for(argv).parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except ConfigError as e:
        print(f"resilienced: error: {e.setting}: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ResilienceError as e:  # e.g. daemon.StartupError: the queue does not answer
        print(f"resilienced: error: {e}", file=sys.stderr)
        return 1
