"""The subcommands of the local stand-ins, registered as plugins of ``resilienced``.

pyproject.toml names each pair below in ``[project.entry-points."resilienced.commands"]``;
``resilienced.app.cli`` reads them through ``importlib.metadata``, so the daemon's command line never
imports ``resilienced.local`` itself.  Each pair is ``(module, one-line help)``; the module (with
``configure(parser)`` and ``main(args) -> int``) is imported only when its command is chosen.
"""

DEMO = ("resilienced.local.demo", "EventBridge -> SQS -> daemon on an embedded moto, over the samples")
DRILL = ("resilienced.local.drill", "the local drill: a Spot interruption played end to end on this machine")
