"""The one translation of AWS library errors (botocore, aiohttp) into :mod:`resilienced.errors`.

The rule, the same for every AWS call the daemon makes (SQS, S3, FSx, EC2, Auto Scaling,
EventBridge):

* **retry later** (:class:`~resilienced.errors.BackendUnavailable`): an answer whose error code
  is in :data:`RETRY_LATER_CODES` (throttling, and the service-side failures and timeouts that
  some services send with a 4xx status), any HTTP 5xx, HTTP 429; no answer at all (connection
  refused or closed, connect or read timeout, any other botocore or aiohttp transport error);
* **permanent** (:class:`~resilienced.errors.PermanentError`): every other answer the service
  gives (4xx: AccessDenied, UnauthorizedOperation, validation, not found, a quota, ...) and a
  request botocore refuses to send (``ParamValidationError``): retrying the same call cannot
  make it succeed.

Where one call site reads a particular answer as something else (an S3 ``NoSuchKey`` that means
"not exported yet", FSx ``DataRepositoryTaskExecuting`` that means "wait for the running task",
Auto Scaling's "No active Lifecycle Action" that means "already completed"), that call site
checks :func:`error_code` first and names the exception there; this table is not extended
for it.  The daemon's own queue (:mod:`resilienced.aws.sqs`) applies this rule and then keeps
retrying a refused call too: it has no one else to give up on (see there).
"""

from __future__ import annotations

import asyncio

import aiohttp
import botocore.exceptions

from resilienced.errors import BackendUnavailable, PermanentError, ResilienceError

#: Error codes that mean "try again later" whatever the HTTP status: botocore's standard retry
#: mode's throttling and transient codes (botocore/retries/standard.py, _THROTTLED_ERROR_CODES and
#: _TRANSIENT_ERROR_CODES), the service-side failures some services answer with 4xx, and S3's
#: clock-skew answer (botocore re-signs on the next try).
RETRY_LATER_CODES = frozenset({
    # throttling (botocore standard mode)
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException",
    "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "LimitExceededException", "RequestThrottled", "SlowDown", "PriorRequestNotComplete",
    "EC2ThrottledException",
    # transient (botocore standard mode), service-side failures, clock skew
    "RequestTimeout", "RequestTimeoutException", "InternalError", "InternalFailure",
    "InternalServerError", "ServiceUnavailable", "Unavailable", "RequestTimeTooSkewed",
})
#: The throttling codes among them: a retry waits :data:`THROTTLED_DELAY_S` unless told otherwise.
THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "SlowDown",
    "EC2ThrottledException",
})
THROTTLED_DELAY_S = 1.0

#: Transport failures: no answer came (connection, timeouts, aiohttp), so try again later.
NO_ANSWER = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError)


def error_code(error: BaseException) -> str | None:
    """The AWS error code of a botocore ClientError (``"AccessDenied"``...), else None."""
    if isinstance(error, botocore.exceptions.ClientError):
        return ((getattr(error, "response", None) or {}).get("Error") or {}).get("Code") or None
    return None


def _answer(error: botocore.exceptions.ClientError) -> tuple[str, int | None, str]:
    response = getattr(error, "response", None) or {}
    code = (response.get("Error") or {}).get("Code") or "Unknown"
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    text = (response.get("Error") or {}).get("Message") or _text(error)
    return code, status if isinstance(status, int) else None, text


def retry_later(code: str | None, status: int | None) -> bool:
    """The rule for an answer: True (retry later) for a listed code, a 5xx or a 429."""
    return code in RETRY_LATER_CODES or (status is not None and (status >= 500 or status == 429))


def translate(error: BaseException, *, backend: str, operation: str,
              delay: float | None = None) -> ResilienceError:
    """The resilienced error for ``error``, raised by the AWS call ``operation`` of ``backend``.

    ``delay``: the retry delay of a retry-later verdict (default: :data:`THROTTLED_DELAY_S` when
    throttled, else the queue's own timeout).  A resilienced error is returned as it is.
    """
    if isinstance(error, ResilienceError):
        return error
    if isinstance(error, botocore.exceptions.ClientError):
        code, status, text = _answer(error)
        message = f"{operation}: {code} (HTTP {status}): {text}"
        if retry_later(code, status):
            wait = delay if delay is not None else (THROTTLED_DELAY_S if code in THROTTLING_CODES else None)
            return BackendUnavailable(backend, message, delay=wait)
        return PermanentError(f"{backend}: {message}")
    if isinstance(error, botocore.exceptions.ParamValidationError):
        return PermanentError(f"{backend}: {operation}: invalid request: {_text(error)}")
    if isinstance(error, botocore.exceptions.BotoCoreError):
        kind = "timed out" if isinstance(error, (botocore.exceptions.ConnectTimeoutError,
                                                 botocore.exceptions.ReadTimeoutError)) else "failed"
        return BackendUnavailable(backend, f"{operation} {kind}: {type(error).__name__}: {_text(error)}",
                                  delay=delay)
    if isinstance(error, NO_ANSWER):
        return BackendUnavailable(backend, f"{operation} failed: {type(error).__name__}: {_text(error)}",
                                  delay=delay)
    return BackendUnavailable(backend, f"{operation} failed: unexpected {type(error).__name__}: "
                                       f"{_text(error)}", delay=delay)


def _text(error: BaseException) -> str:
    try:
        return str(error) or "(no message)"
    except Exception:  # a half-built library exception whose __str__ fails
        return "(no message)"
