"""One module per event kind, and the registry that dispatches to them (``registry``).

Each kind's module (``spot_interruption``, ``capacity_reservation_interruption``,
``capacity_block_expiry``, ``scheduled_change``, ``state_change``, ``rebalance_recommendation``,
``asg_lifecycle``) opens with a real payload and holds its ``parse()`` and ``plan()``;
:mod:`handlers.registry` maps (source, detail-type) to them.
"""
