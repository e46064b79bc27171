"""The SQS consumer, in the parts one message goes through (each module reads top to bottom):

- ``loop``: :class:`~resilienced.consumer.loop.Consumer`, the receive loop (or one pass),
  the handling slots, stop and drain;
- ``flight``: one message being handled, and this replica's name in claims;
- ``visibility``: the keeper that extends a message's visibility while it is handled, and the
  release of an unfinished one;
- ``handle``: read and judge the body, then act on an actionable plan...
- ``event_claim``: ...under the event claim (duplicates, a lost claim, retry delays);
- ``settle``: the ack policy's verdict carried out on the queue, the decision line, the metrics.
"""
