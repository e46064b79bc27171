"""Requeue: get a whole run (the gang) scheduled again on the capacity the decision chose.

One protocol, ``ports.Requeuer`` (``requeue(target, *, decision, event, dry_run) ->
model.RequeueResult``), one applier per kind of run; appliers only apply: the decision, and
deciding again when a pool has no capacity (``ports.NoCapacity``), are ``recovery.move.Mover``'s:

* ``kueue``     RayJob/RayCluster under Kueue: evict and requeue its Workload through Kueue
                (``spec.active``), steering the flavor by the worker node selector.
* ``kuberay``   RayJob/RayCluster without Kueue: every worker group's node selector and
                tolerations, then the worker pods replaced as a gang.
* ``volcano``   Volcano Job: a ``RestartJob`` Command (and the tasks' node selectors where
                Volcano accepts the change).

Ray mode's requeuer (replacement Ray nodes from a ``NodeProvider``, all or nothing) is
:mod:`resilienced.ray.requeue`, beside the other ray-mode adapters.

Elastic runs (``resilienced.io/elastic: "true"``; ray mode: the node label): ``elastic`` asks capacity
for the lost workers only and never stops the gang (KubeRay: one more replica in a worker group of
the decided capacity, the lost pod in ``workersToDelete``; Kueue: within its Workload slices); the
KubeRay, Kueue and ray-mode requeuers branch to it, and fall back to the gang with the reason.

Shared pieces: ``placement`` (decision -> node selector / affinity / tolerations, pure),
``objects`` (the Kubernetes calls, through ``resilienced.kube.api``), ``router`` (routing, the ``resilienced_requeues_total`` metric, Events), ``rbac``
(``RBAC_RULES``).  docs/requeue.md explains each mechanism with its sources.
"""
