"""The lesser and the greater of two floats, and a binary search of sorted floats, for the
decision loop's per-request paths.

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


def bisect_left(a: list[float], x: float) -> int:
    """`bisect.bisect_left(a, x)` on ascending floats: compiled, each probe is one compare on an
    unboxed float, where bisect's compares each go through the generic comparison."""
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
