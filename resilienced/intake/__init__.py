"""From an SQS message to a verdict on it: ``pipeline`` (decode -> validate the envelope ->
parse -> plan), ``validate`` (the field checks), ``ack_policy`` (delete / keep / dead-letter).
Pure.  A face: it imports nothing."""
