"""resilienced: turns an EC2 interruption notice into a durable checkpoint and a requeued gang.

Folders: the root holds the entry points, the message stages (``consumer``, ``intake``, ``ack``,
``claims``) and the shared vocabulary; ``recovery/`` acts on a plan (``responder``: locate ->
signal -> ``durable`` -> requeue; ``plan_only``: log it); ``aws/``, ``kube/`` and ``ray/`` are
the adapters of each backend (``ray/`` mirrors ``kube/``: ``gcs``, ``cluster``, ``claims``,
``requeue``); ``capacity/`` decides Spot / Capacity Block / On-Demand; ``requeue/`` applies the
decision in Kubernetes; ``followup`` (pure) and ``recovery/followup`` follow a requeued run until
it trains again; ``local/`` holds the stand-ins of the drill and the demo (moto, a local
Ray cluster, the FSx exporter, the local node provider), which nothing else imports.

Layers, top to bottom.  A module may import from its own layer and the layers below it, never
from a layer above; a name covers the module or package of that name under ``resilienced``
(the longest name wins; ``handlers`` is the top-level package).  tests/test_layers.py reads the
numbered lines below, so this list is the one place the layers are written:

1. cli, __main__, replay, status, inject, local: entry points and the local stand-ins
2. daemon, wiring: settings -> adapters -> consumer loop, HTTP server
3. consumer, recovery: one pass receive -> handle -> ack; acting on a plan
4. aws, kube, ray, requeue, capacity, claims, followups, notify, http, metrics: adapters and their state
5. intake, handlers, ack, runs, validate, log, tasks, followup, capacity.decision, capacity.history, capacity.request: pure logic
6. model, ports, errors, settings, options, permissions, capacity.policy, resilienced: vocabulary

Also checked there: nothing outside ``local/`` imports ``resilienced.local`` (its ``demo`` and
``drill`` commands reach the CLI as entry points); ``trainer/`` (a separate package that runs in
the training image) imports nothing of ``resilienced`` or ``handlers``; there are no import cycles.
"""

__version__ = "0.1.0"
