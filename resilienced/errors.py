"""The one error hierarchy of resilienced.

::

    ResilienceError                     base of everything raised on purpose
    ├── ConfigError                     bad settings or flags; raised once, at start-up
    ├── RecordError                     a record the daemon kept that is not of the form it writes
    ├── EventError                      a message body that is not a usable event
    │   ├── DecodeError                 not UTF-8, not JSON, not an object, too deep, ...
    │   └── InvalidEventError           a well-formed event with a field that breaks a rule
    ├── TemporaryError(delay=...)       try again later: the message stays on the queue
    │   └── BackendUnavailable          an outside system (SQS, Kubernetes, GCS, S3, EC2, FSx)
    │                                   did not answer or answered 5xx / throttled
    └── PermanentError                  retrying cannot help: give up on this target
        ├── RayVersionMismatch          the cluster speaks another Ray version than the pinned one
        └── RayAuthError                missing or wrong Ray auth token

Library errors (botocore, aiohttp, kubernetes_asyncio, Ray) are translated at the boundary of the
adapter that called them (``raise BackendUnavailable(...) from e``); nothing above the adapters sees
a library exception.  ``EventError`` carries the name of the field that was wrong, so the decision
log can say why.
"""

from __future__ import annotations


class ResilienceError(Exception):
    """Base of every error resilienced raises on purpose."""


class ConfigError(ResilienceError):
    """Settings or flags that cannot work; reported once at start-up with the setting's name."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message


class RecordError(ResilienceError):
    """A record the daemon kept (a run's record in its done claim) with a field not of the form the
    daemon writes; ``field`` names it (``durable.step``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EventError(ResilienceError):
    """A message body that is not a usable interruption event."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class DecodeError(EventError):
    """The body cannot be decoded into an event object at all (poison for the queue)."""


class InvalidEventError(EventError):
    """A decodable event that breaks a validation rule (bad id, bad time, custom source...)."""


class TemporaryError(ResilienceError):
    """The work failed but may succeed later: leave the message for redelivery.

    ``delay`` is the number of seconds after which a retry makes sense (used as the message's
    new visibility timeout); ``None`` keeps the queue's own timeout.
    """

    def __init__(self, message: str, *, delay: float | None = None,
                 backends: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.delay = delay
        self.backends = backends  # the backends whose failures this one gathers (metrics)


class BackendUnavailable(TemporaryError):
    """An outside system did not answer, timed out, throttled, or answered 5xx."""

    def __init__(self, backend: str, message: str, *, delay: float | None = None) -> None:
        super().__init__(f"{backend}: {message}", delay=delay, backends=(backend,))
        self.backend = backend


class PermanentError(ResilienceError):
    """Retrying cannot help; the outcome is recorded and the message acknowledged."""


class RayVersionMismatch(PermanentError):
    """The Ray cluster runs another Ray version than the one resilienced is pinned to."""


class RayAuthError(PermanentError):
    """The Ray cluster wants a token that is missing, or rejected the one given."""


def backends_of(error: BaseException) -> tuple[str, ...]:
    """The backends a temporary failure came from (``resilienced_backend_errors_total``)."""
    return tuple(getattr(error, "backends", ()) or ())
