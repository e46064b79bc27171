"""Capacity: where a requeued run goes (Spot, a Capacity Block, On-Demand, or wait) and why.

Modules, pure first:

* ``policy``   :class:`CapacityPolicy`, the knobs (a settings group).
* ``decision`` :func:`decide`, the pure decision, and its values (:class:`Pool`, and
  :class:`Capacity`, :class:`CapacityDecision`, :class:`CapacityOffering`, which live in
  ``resilienced.model`` because ``ports`` names them).
* ``history``  :class:`InterruptionHistory` (sliding window per pool) and
  :class:`UnavailableCache` (the ICE cache); in memory, per replica.
* ``request``  :class:`CapacityRequest`: the question for one run, from a Target and an Event.
* ``ec2``      :class:`Ec2Capacity`, the EC2 adapter (aiobotocore), and :data:`IAM_ACTIONS`.
* ``planner``  :class:`CapacityPlanner`: gathers the inputs, decides, buys when told to.

See docs/requeue.md for the decision table and the reasons behind each default.
"""
