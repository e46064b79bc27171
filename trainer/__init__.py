"""trainer: FSDP2 training on Ray Train that saves the step it is on when preempted.

``trainer.resilience.Checkpointer`` is the part any Ray Train script uses; ``python -m trainer``
is one such script.

This package runs inside the training image (Ray Train workers), never inside the daemon: it
imports only torch, ray, numpy and the standard library, and nothing from ``resilienced`` or
``handlers``.  The daemon and the trainer share no code and no channel; they meet in these places
only: Ray's drain (the daemon drains a node with reason PREEMPTION and a deadline, Ray Train
hands that to every rank as ``ray.train.get_preemption_info()``), and the checkpoint layout
under the checkpoint root (``step-<N>/`` with ``manifest.json`` written last, and the resume
records under ``resume/``), which the daemon reads back from S3 to decide that a checkpoint is
durable and that a requeued run trains again; and, for an elastic run, the record of when its
replacement is expected, which the daemon writes into the Ray cluster's GCS internal KV
(``trainer.replacement``).

Modules, top to bottom:

=============  ==================================================================================
``__main__``   ``python -m trainer``: parse flags, pick the launcher, exit code
``launch``     the drivers: Ray Train ``TorchTrainer`` (``--ray-address``) or local processes
``resilience`` **the public API**: ``Checkpointer`` (restore / after_step / finish),
               ``write_manifest``, ``verify`` (docs/your-trainer.md)
``state``      a user's ``state`` dict (modules, optimizers, state_dict objects) as DCP entries
``runtime``    what differs between Ray Train workers and local processes (signal, report)
``elastic``    elastic runs on Ray Train 2.60: ``ElasticCallback`` (controller side), ``scaling_kwargs``
``resize``     the save-before-a-resize request and answer under the checkpoint root
``replacement`` an elastic run's choice after a loss: shrink now, or wait for the daemon's replacement
``restarts``   what each (re)start of an elastic run's worker group cost, measured by the run
``warmup``     new Ray Train workers import FSDP2 / DCP while the group is still being set up
``resume``     the resume record an attempt leaves when it trains its first step (stdlib only: the
               daemon imports it to read the record back from S3, the one definition of it)
``loop``       ``python -m trainer``'s train function: a user of ``resilience.Checkpointer``
``preemption`` the SIGTERM flag, the per-step agreed decision, the deadline plan
``checkpoint`` save / commit / verify / resume / clean up; the manifest
``journal``    rank 0's JSON-lines files: per-step metrics and lifecycle events
``model``      the decoder-only transformer and its FSDP2 sharding
``data``       synthetic tokens, a pure function of (seed, step); a rank's share of the global batch
``config``     the flags, validated once; ``errors``: what can go wrong, said plainly
=============  ==================================================================================

``integrations/``: the framework callbacks (``transformers``: Hugging Face ``Trainer``;
``lightning``: ``fit()``), whose libraries are optional extras; nothing above imports them.
"""
