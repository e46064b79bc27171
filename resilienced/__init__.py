"""resilienced: turns an EC2 interruption notice into a durable checkpoint and a requeued gang.

Folders: the root holds the shared vocabulary (``model``, ``ports``, ``errors``, ``settings``,
``options``, ``clock``, ``retry``, ``log``, ``supervisor``), the claim lifecycle (``claims``) and the ports'
stand-ins (``doubles``: in memory, or read-only);
``followup/`` the follow-up after a requeue (``rules``, pure; ``follower``: until the run trains
again); ``app/`` the entry points and their assembly (``cli``,
``daemon``, ``runtime``, the ``replay``, ``status`` and ``inject`` commands); ``intake/`` from a
message to a verdict (``pipeline``: decode -> validate -> parse -> plan; ``validate``;
``ack_policy``); ``consumer/`` one message's pass receive -> handle -> claim -> settle;
``recovery/`` acts on a plan (``responder``: locate -> signal -> ``durable`` -> requeue;
``move``: every move of a run; ``plan_only``: log it); ``ops/`` what operators see
(``metrics``, ``http``, ``notify``, ``run_record``, ``permissions``); ``aws/``, ``kube/`` and
``ray/`` are the adapters of each backend (``ray/`` mirrors ``kube/``: ``gcs``, ``cluster``,
``claims``, ``requeue``); ``capacity/`` decides Spot / Capacity Block / On-Demand; ``requeue/``
applies the decision in Kubernetes; ``local/`` holds the stand-ins of the drill and the demo
(moto, a local Ray cluster, the FSx exporter, the local node provider), which nothing else imports.

Layers, top to bottom.  A module may import from its own layer and the layers below it, never
from a layer above; a name covers the module or package of that name under ``resilienced``
(the longest name wins; ``handlers`` is the top-level package).  tests/test_layers.py reads the
numbered lines below, so this list is the one place the layers are written:

1. app, app.cli, __main__, app.replay, app.status, app.inject, local: entry points and the local stand-ins
2. app.daemon, app.runtime: settings -> adapters -> consumer loop, HTTP server
3. consumer, recovery, followup.follower: one pass receive -> handle -> ack; acting on a plan; following it
4. aws, kube, ray, requeue, capacity, claims, doubles, ops, ops.notify, ops.http, ops.metrics: adapters and their state
5. intake, handlers, ops.run_record, recovery.steps, log, supervisor, retry, followup, ops.ledger, capacity.decision, capacity.history, capacity.request: pure logic
6. model, ports, errors, settings, options, ops.permissions, clock, capacity.policy, resilienced: vocabulary

Also checked there: nothing outside ``local/`` imports ``resilienced.local`` (its ``demo`` and
``drill`` commands reach the CLI as entry points); ``trainer/`` (a separate package that runs in
the training image) imports nothing of ``resilienced`` or ``handlers``; there are no import cycles.
"""

__version__ = "0.1.0"
