"""The error tree and its one mapping to HTTP / socket statuses.

::

    EscapementError
     ├── ClientError ................ the caller's mistake: 4xx, never logged as a failure
     │    ├── BadRequest ............ 400 malformed body, wrong shape, datatype or byte count
     │    ├── Forbidden ............. 403 a management endpoint without its token
     │    ├── NotFound .............. 404 unknown model, version or path
     │    ├── MethodNotAllowed ...... 405
     │    ├── RequestTimeout ........ 408 a request or frame not received whole in time
     │    ├── PayloadTooLarge ....... 413 body, frame or JSON over the configured limit
     │    ├── UnsupportedMediaType .. 415 an unknown Content-Encoding, a non-JSON management body
     │    ├── HeadersTooLarge ....... 431
     │    └── NotImplementedByServer 501 a protocol feature this daemon does not offer
     ├── Unavailable ................ 503 model not ready, daemon draining
     │    └── Overloaded ............ 503 + Retry-After: a bound is reached (queue, memory, connections)
     ├── DeadlineExceeded ........... 504 the request's deadline cannot be (or was not) met
     ├── Cancelled .................. 499 the client went away before an answer
     └── InternalError .............. 500 a model raised, an executor failed
    ConfigError ..................... start-up only: a bad setting stops the daemon

The socket frontend uses the same numeric statuses as HTTP so the two frontends agree.
"""

from __future__ import annotations


class EscapementError(Exception):
    """Base of every error the daemon reports to a caller."""

    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(EscapementError):
    status = 400


class BadRequest(ClientError):
    status = 400


class Forbidden(ClientError):
    status = 403


class NotFound(ClientError):
    status = 404


class MethodNotAllowed(ClientError):
    status = 405


class RequestTimeout(ClientError):
    """A request (or socket frame) that did not arrive whole in time."""

    status = 408


class PayloadTooLarge(ClientError):
    status = 413


class UnsupportedMediaType(ClientError):
    status = 415


class HeadersTooLarge(ClientError):
    status = 431


class NotImplementedByServer(ClientError):
    status = 501


class Unavailable(EscapementError):
    status = 503

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(Unavailable):
    """A bounded queue is full; the caller may retry after `retry_after_s`."""

    status = 503

    def __init__(self, message: str, retry_after_s: float | None = 1.0) -> None:
        super().__init__(message, retry_after_s)


class DeadlineExceeded(EscapementError):
    status = 504


class Cancelled(EscapementError):
    status = 499


class InternalError(EscapementError):
    status = 500


class ConfigError(Exception):
    """A setting is unknown, of the wrong type, or out of range. Raised at start-up only."""


def status_of(exc: BaseException) -> int:
    """The HTTP / socket status for an exception; anything unexpected is a 500."""
    if isinstance(exc, EscapementError):
        return exc.status
    return 500


def message_of(exc: BaseException) -> str:
    if isinstance(exc, EscapementError):
        return exc.message
    return f"internal error: {type(exc).__name__}: {exc}"


def retry_after_of(exc: BaseException) -> float | None:
    return exc.retry_after_s if isinstance(exc, Unavailable) else None
