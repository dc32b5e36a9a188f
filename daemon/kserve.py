"""What KServe's model agent leaves in a model directory, and Kubernetes quantities.

In TrainedModel (multi-model) serving, KServe's agent downloads each model into
`<model dir>/<name>/` and then writes `SUCCESS.<sha256 of the model spec>` there: the JSON of the
TrainedModel's `spec.model` (`storageUri`, `framework`, `memory`). It is the only way the
TrainedModel's declared memory reaches the server (the load call itself is a bare `{}`), so the
repository scan reads it and the model manager checks the declared memory against what the model
needs (docs/deploy.md, "Sizing memory"). Source: kserve/kserve pkg/agent/downloader.go.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import orjson

from daemon.errors import AgentFileError

SUCCESS_PREFIX = "SUCCESS."
MAX_SUCCESS_BYTES = 64 * 1024  # a few hundred bytes of JSON; this only stops a runaway file

# resource.Quantity's grammar (the TrainedModel CRD's pattern for spec.model.memory).
_QUANTITY_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_SUFFIX: dict[str, Decimal | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def parse_quantity(value: int | str) -> int:
    """Bytes from a Kubernetes quantity ("1Gi", "512Mi", "1G", "1.5e9", 1073741824), rounded up
    as Kubernetes rounds memory. ValueError for anything else, or a negative amount."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        amount = Decimal(value)
    else:
        m = _QUANTITY_RE.fullmatch(value.strip())
        if m is None:
            raise ValueError(f"{value!r} is not a Kubernetes quantity such as '1Gi' or '512Mi'")
        number, suffix = m.groups()
        try:
            amount = Decimal(number)
            if suffix and suffix[0] in "eE":
                amount *= Decimal(10) ** int(suffix[1:])
            elif suffix:
                amount *= _SUFFIX[suffix]
        except InvalidOperation:
            raise ValueError(f"{value!r} is not a Kubernetes quantity such as '1Gi' or '512Mi'") from None
    if amount < 0:
        raise ValueError(f"{value!r} is negative")
    whole = int(amount)
    return whole + (1 if amount > whole else 0)


def success_files(model_dir: Path) -> list[Path]:
    """The agent's SUCCESS.<sha256> files in a model directory, newest first."""
    found: list[tuple[int, Path]] = []
    for entry in os.scandir(model_dir):
        if entry.name.startswith(SUCCESS_PREFIX) and entry.is_file():
            found.append((entry.stat().st_mtime_ns, Path(entry.path)))
    return [p for _, p in sorted(found, reverse=True)]


def declared_memory(model_dir: Path) -> int | None:
    """The memory (bytes) the TrainedModel of a directory the agent placed declares, from its newest
    SUCCESS file (a storageUri changed in place leaves the older one behind; the memory of a
    TrainedModel cannot change); None when no agent placed it. AgentFileError if unreadable."""
    files = success_files(model_dir)
    if not files:
        return None
    path = files[0]
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SUCCESS_BYTES + 1)
    except OSError as e:
        raise AgentFileError(f"{path.name}: {e.strerror or e}") from None
    if len(raw) > MAX_SUCCESS_BYTES:
        raise AgentFileError(f"{path.name} is more than {MAX_SUCCESS_BYTES} bytes: not what KServe's agent writes")
    if not raw.strip():  # the agent creates the file, then writes the spec into it
        return None
    try:
        spec = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise AgentFileError(f"{path.name} is not JSON: {e}") from None
    memory = spec.get("memory") if isinstance(spec, dict) else None
    if memory is None:
        return None
    try:
        return parse_quantity(memory)
    except ValueError as e:
        raise AgentFileError(f"{path.name}: memory {e}") from None
