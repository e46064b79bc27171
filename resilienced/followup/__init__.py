"""The follow-up after a requeue, in one wing (issue #41): ``rules`` (stages, bounds, the judgement
and the record, pure) and ``follower`` (``Follower``: the long-lived task that follows each run
until it trains again and falls back through ``recovery.move.Mover``).  Each mode's record store and
progress probe sit beside that mode's adapters: ``kube.followup_store`` and ``kube.progress``,
``ray.followup_store`` and ``ray.progress``."""
