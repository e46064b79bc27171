"""The SQS consumer: receive -> handle -> ack (``loop``: :class:`~resilienced.consumer.loop.Consumer`)."""
