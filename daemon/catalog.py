"""The catalog of served models: every version the repository scan found, with its state and reason.

Frontends resolve a (name, version) here; the daemon fills it as programs load. States follow
Triton's repository index: READY, LOADING, UNAVAILABLE (with a reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from daemon.errors import NotFound, Unavailable
from daemon.model import ModelSpec


class ModelState(StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(slots=True)
class VersionEntry:
    spec: ModelSpec
    state: ModelState
    reason: str = ""


class ModelCatalog:
    def __init__(self) -> None:
        self._models: dict[str, dict[int, VersionEntry]] = {}
        self._broken: dict[str, str] = {}  # model name -> why its config cannot be read
        self.generation = 0  # bumped on every change: frontend workers' replicas follow it

    def add(self, spec: ModelSpec, state: ModelState = ModelState.LOADING) -> VersionEntry:
        self.generation += 1
        entry = VersionEntry(spec, state)
        self._models.setdefault(spec.name, {})[spec.version] = entry
        self._broken.pop(spec.name, None)
        return entry

    def set_state(self, spec: ModelSpec, state: ModelState, reason: str = "") -> None:
        entry = self._models[spec.name][spec.version]
        entry.state, entry.reason = state, reason
        self.generation += 1

    def set_broken(self, name: str, reason: str) -> None:
        self._broken[name] = reason
        self.generation += 1

    def remove(self, name: str, version: int | None = None) -> None:
        """Forget a version (gone from the repository), or with no version the name's broken entry."""
        self.generation += 1
        if version is None:
            self._broken.pop(name, None)
            return
        versions = self._models.get(name, {})
        versions.pop(version, None)
        if not versions:
            self._models.pop(name, None)

    def broken(self) -> dict[str, str]:
        """Names whose config cannot be read, and why."""
        return dict(self._broken)

    def names(self) -> list[str]:
        return sorted(set(self._models) | set(self._broken))

    def versions(self, name: str) -> dict[int, VersionEntry]:
        return self._models.get(name, {})

    def entry(self, name: str, version: str | int | None = None) -> VersionEntry:
        """The entry for a name and version (None or "" = the newest); raises NotFound."""
        versions = self._models.get(name)
        if not versions:
            if name in self._broken:
                raise Unavailable(f"model {name} is not available: {self._broken[name]}")
            raise NotFound(f"unknown model {name!r}")
        if version is None or version == "":
            # The newest version that serves: a newer one still loading (or failed) must not turn a
            # rollout into 503s for clients that name no version (tritonclient's default).
            ready = [v for v, e in versions.items() if e.state == ModelState.READY]
            return versions[max(ready)] if ready else versions[max(versions)]
        try:
            v = int(version)
        except (TypeError, ValueError):
            raise NotFound(f"model {name} has no version {version!r}") from None
        entry = versions.get(v)
        if entry is None:
            raise NotFound(f"model {name} has no version {v}; it has {sorted(versions)}")
        return entry

    def resolve(self, name: str, version: str | int | None = None) -> ModelSpec:
        """The spec to serve a request with; raises NotFound or Unavailable."""
        entry = self.entry(name, version)
        if entry.state != ModelState.READY:
            why = f": {entry.reason}" if entry.reason else ""
            raise Unavailable(f"model {name} version {entry.spec.version} is {entry.state.value}{why}")
        return entry.spec

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for name in self.names():
            for v, e in sorted(self.versions(name).items()):
                if ready_only and e.state != ModelState.READY:
                    continue
                item = {"name": name, "version": str(v), "state": e.state.value}
                if e.reason:
                    item["reason"] = e.reason
                out.append(item)
            if name in self._broken and not ready_only:
                out.append({"name": name, "state": ModelState.UNAVAILABLE.value, "reason": self._broken[name]})
        return out

    def all_ready(self) -> bool:
        return all(e.state == ModelState.READY for vs in self._models.values() for e in vs.values())
