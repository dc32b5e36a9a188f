"""The error tree and its one mapping to HTTP / socket statuses and gRPC status codes.

::

                                     HTTP  gRPC
    EscapementError
     ├── ClientError ................ 4xx: the caller's mistake, never logged as a failure
     │    ├── BadRequest ............ 400  INVALID_ARGUMENT    malformed body, wrong shape, datatype, bytes
     │    ├── Forbidden ............. 403  PERMISSION_DENIED   a management call without its token
     │    ├── NotFound .............. 404  NOT_FOUND           unknown model, version or path
     │    ├── MethodNotAllowed ...... 405  UNIMPLEMENTED
     │    ├── RequestTimeout ........ 408  DEADLINE_EXCEEDED   a request or frame not received whole in time
     │    ├── Conflict .............. 409  ALREADY_EXISTS      a shared-memory region name already registered
     │    ├── PayloadTooLarge ....... 413  RESOURCE_EXHAUSTED  body, frame, message or JSON over its limit
     │    ├── UnsupportedMediaType .. 415  INVALID_ARGUMENT    an unknown Content-Encoding, a non-JSON body
     │    ├── HeadersTooLarge ....... 431  RESOURCE_EXHAUSTED
     │    ├── NotImplementedByServer 501  UNIMPLEMENTED       a protocol feature this daemon does not offer
     │    └── ModelError ............ 400  INVALID_ARGUMENT    a model version cannot be served (a load says why)
     │         ├── ModelConfigError .....                     its config.toml (or the one its program implies)
     │         ├── SignatureError .......                     its program's signature gives no config
     │         ├── AgentFileError .......                     a file KServe's model agent left beside it
     │         └── ProgramError .........                     its model file cannot run as its config says
     ├── Unavailable ................ 503  UNAVAILABLE         model not ready, daemon draining
     │    └── Overloaded ............ 503  UNAVAILABLE         + Retry-After: a bound is reached
     ├── DeadlineExceeded ........... 504  DEADLINE_EXCEEDED   the request's deadline cannot be (was not) met
     ├── Cancelled .................. 499  CANCELLED           the client went away before an answer
     └── InternalError .............. 500  INTERNAL            a model raised, an executor failed
    ConfigError ..................... start-up only: a bad setting stops the daemon
    RefusedFile(OSError) ............ a file the daemon will not read (a FIFO, a runaway size)

The socket frontend uses the same numeric statuses as HTTP so the frontends agree; gRPC
codes are the names of `grpc.StatusCode` members (this module does not import grpc).

A `ModelError` is mostly met as a model's reason (an UNAVAILABLE version, a broken entry of
the repository index); it reaches a caller as such only through a load (the repository
extension's), which Triton answers with a 400 too. The `ValueError` mixed into its subclasses
keeps them what they were to the parsing code that catches them. Exceptions that never reach a
caller (the runtime's `DeviceFault`, `NoMemory`, a stored profile's `ProfileError`) stay
beside their code; what a caller sees is always one of the classes here.
"""

from __future__ import annotations


class EscapementError(Exception):
    """Base of every error the daemon reports to a caller."""

    status: int = 500
    grpc: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(EscapementError):
    status = 400
    grpc = "INVALID_ARGUMENT"


class BadRequest(ClientError):
    status = 400
    grpc = "INVALID_ARGUMENT"


class Forbidden(ClientError):
    status = 403
    grpc = "PERMISSION_DENIED"


class NotFound(ClientError):
    status = 404
    grpc = "NOT_FOUND"


class MethodNotAllowed(ClientError):
    status = 405
    grpc = "UNIMPLEMENTED"


class RequestTimeout(ClientError):
    """A request (or socket frame) that did not arrive whole in time."""

    status = 408
    grpc = "DEADLINE_EXCEEDED"


class Conflict(ClientError):
    """What the request would create exists already (a shared-memory region's name)."""

    status = 409
    grpc = "ALREADY_EXISTS"


class PayloadTooLarge(ClientError):
    status = 413
    grpc = "RESOURCE_EXHAUSTED"


class UnsupportedMediaType(ClientError):
    status = 415
    grpc = "INVALID_ARGUMENT"


class HeadersTooLarge(ClientError):
    status = 431
    grpc = "RESOURCE_EXHAUSTED"


class NotImplementedByServer(ClientError):
    status = 501
    grpc = "UNIMPLEMENTED"


class ModelError(BadRequest):
    """A model version cannot be served; the message says why."""


class ModelConfigError(ModelError, ValueError):
    """A model's config (config.toml, or the config its program implies) is wrong; the message says how."""


class SignatureError(ModelError, ValueError):
    """A program's signature cannot be turned into a config; the message says why."""


class AgentFileError(ModelError, ValueError):
    """A file KServe's model agent wrote cannot be read; the message says which and why."""


class ProgramError(ModelError, ValueError):
    """The model file cannot be served as its config describes; the message says why."""


class Unavailable(EscapementError):
    status = 503
    grpc = "UNAVAILABLE"

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
    grpc = "DEADLINE_EXCEEDED"


class Cancelled(EscapementError):
    status = 499
    grpc = "CANCELLED"


class InternalError(EscapementError):
    status = 500
    grpc = "INTERNAL"


class ConfigError(Exception):
    """A setting is unknown, of the wrong type, or out of range. Raised at start-up only."""


class RefusedFile(OSError):
    """A file the daemon will not read: not a regular file, or larger than allowed."""


def status_of(exc: BaseException) -> int:
    """The HTTP / socket status for an exception; anything unexpected is a 500."""
    if isinstance(exc, EscapementError):
        return exc.status
    return 500


def grpc_code_of(exc: BaseException) -> str:
    """The gRPC status code's name (a `grpc.StatusCode` member) for an exception; unexpected: INTERNAL."""
    if isinstance(exc, EscapementError):
        return exc.grpc
    return "INTERNAL"


def message_of(exc: BaseException) -> str:
    if isinstance(exc, EscapementError):
        return exc.message
    return f"internal error: {type(exc).__name__}: {exc}"


def retry_after_of(exc: BaseException) -> float | None:
    return exc.retry_after_s if isinstance(exc, Unavailable) else None
