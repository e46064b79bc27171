"""resilienced: turns an EC2 interruption notice into a durable checkpoint and a requeued gang.

Layers, top to bottom (a module may import only from layers below it):

1. ``cli``, ``drill``, ``status``, ``replay``  entry points
2. ``daemon``                             wiring: settings -> adapters -> consumer loop, HTTP server
3. ``consumer``, ``respond``              one pass receive -> handle -> ack; acting on a plan
4. ``intake``, ``ack``, ``capacity``...   pure logic: decode/parse/validate, ack policy, decisions,
                                          ``runs`` (a run's record and its summary)
5. adapters (``sqs``, ``kube``, ``raygcs``, ``raymode``, ``s3``, ``fsx``, ``capacity`` EC2 side,
   ``notify`` the webhook)
6. ``model``, ``ports``, ``errors``, ``settings``   values, interfaces, the error hierarchy

``handlers/`` (one module per event kind) sits at layer 4; ``trainer/`` is a separate package that
never imports this one (it runs in the training image).
"""

__version__ = "0.1.0"
