"""trainer.integrations: the preemption path for training loops that live inside a framework.

The :class:`~trainer.resilience.Checkpointer` protects a train function that calls ``restore`` /
``after_step`` / ``finish`` itself.  A loop inside ``transformers.Trainer.train()`` or
``lightning.Trainer.fit()`` cannot, so each framework gets a callback that does the same from
the framework's own hooks, with the framework's own save and resume (docs/your-trainer.md):

===============  ================================================================================
``transformers``  ``PreemptionCallback`` (a ``transformers.TrainerCallback``), ``newest_checkpoint``
                  (the ``resume_from_checkpoint`` to pass to ``Trainer.train``); extra ``[hf]``
``lightning``     ``PreemptionCallback`` (a ``lightning.pytorch.Callback``), ``newest_checkpoint``
                  (the ``ckpt_path`` of ``Trainer.fit``), ``ResumableDataLoader``; extra ``[lightning]``
``guard``         what both share: the notice (the Checkpointer's path: Ray Train's preemption
                  notice and the SIGTERM flag, agreed by every rank), the deadline plan, the
                  commit of a framework's checkpoint directory, the hold
===============  ================================================================================

Nothing else in ``trainer/`` imports this package, and this package's ``__init__`` imports
nothing: ``transformers`` and ``lightning`` are imported only by the module of that name, only
when it is imported, with an error that names the extra to install when it is missing.
"""
