"""The lesser and the greater of two floats, for the decision loop's per-request paths.

Compiled (daemon/native), each is one compare on unboxed floats; the builtins `min` and `max`
parse their arguments generically on every call (~400 instructions: 5% of the controller's
instructions at 1,000 models, bench/results/scale-callgrind-issue12.md). Ties return the first
argument, as the builtins do.
"""

from __future__ import annotations


def fmin(a: float, b: float) -> float:
    return b if b < a else a


def fmax(a: float, b: float) -> float:
    return b if b > a else a
