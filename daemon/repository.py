"""The model repository on disk: `<repo>/<model>/config.toml` and `<repo>/<model>/<version>/model.pt2|ts`.

What a config.toml may hold, and its checks, are in daemon/model_config.py; this module finds the
models and their servable versions and builds one ModelSpec per version.

A model may be a plan of stages (Pretzel): `stages = ["../../.stages/backbone.pt2",
"head.pt2"]` lists torch.export programs, relative to each version directory, that run in turn
(each takes the previous one's outputs); its version directories then hold no model file.
Stages identical across models (same graph, same weights) are found by content at load.

A model directory may instead hold its file bare, as a storage URI (KServe's storage initializer
or model agent) delivers it: `<repo>/<model>/model.pt2` (or model.ts) is served as version 1, with
a config.toml beside it or, for model.pt2 without one, the config its exported program implies
(daemon/signature.py). A `SUCCESS.<sha256>` file that KServe's model agent left in a model
directory declares the TrainedModel's memory (daemon/kserve.py), which the model must fit in.

Scanning never raises for one bad entry: each broken model is reported with its reason and
the rest are served. The scan never opens what is not a regular file (a FIFO would block it
forever), reads at most `model_config.MAX_CONFIG_BYTES` of a config, and takes as versions only directories
named by 1 to `MAX_VERSION_DIGITS` ASCII digits; every entry it skips costs one WARNING line.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon import kserve
from daemon.errors import AgentFileError, ModelConfigError, SignatureError
from daemon.files import file_problem, file_type
from daemon.model import Layout, ModelFormat, ModelSpec
from daemon.model_config import NAME_RE, check_model_config, load_head, parse_model_config
from daemon.signature import inferred_config

log = logging.getLogger("escapement.repository")

MODEL_FILES: dict[str, ModelFormat] = {"model.pt2": "pt2", "model.ts": "ts"}
STAGED_FILE = "model.stages"  # a staged version's `path`: a name in its directory, never a file
# Versions travel as int64 (KServe's version strings, msgpack, metrics labels): 18 digits stay
# below 2**63, and int() of a bounded ASCII string can neither refuse it (Python's 4300-digit
# limit) nor read other scripts' digits ("²" passes str.isdigit() and int() refuses it; "٣" is 3).
MAX_VERSION_DIGITS = 18
_VERSION_RE = re.compile(rf"[0-9]{{1,{MAX_VERSION_DIGITS}}}")
Stamp = tuple[tuple[int, int], ...]  # (mtime_ns, size) of a version's files: a change is a new version


@dataclass(slots=True)
class ScanResult:
    models: list[ModelSpec]
    broken: dict[str, str]  # model name -> reason


def _staged_version(version_dir: Path, stages: tuple[str, ...], root: Path) -> tuple[Path, ...]:
    """The stage files of one version, resolved; _SkippedVersion when one is missing, unreadable or
    outside the repository (a config may share stages between models, but not reach past `root`)."""
    out = []
    for rel in stages:
        path = (version_dir / rel).resolve()
        if not path.is_relative_to(root.resolve()):
            raise _SkippedVersion(f"version {version_dir.name} is skipped: stage {rel!r} is outside the "
                                  "model repository")
        problem = file_problem(path)
        if problem is not None:
            raise _SkippedVersion(f"version {version_dir.name} is skipped: stage {rel!r}: {problem}")
        out.append(path)
    return tuple(out)


def _staged_versions(model_dir: Path, stages: tuple[str, ...]) -> list[tuple[int, Path, tuple[Path, ...]]]:
    """The servable versions of a model of stages: version directories whose stage files all exist."""
    skipped: list[str] = []
    found = []
    for version, d in sorted(_version_dirs(model_dir, skipped).items()):
        try:
            found.append((version, d / STAGED_FILE, _staged_version(d, stages, model_dir.parent)))
        except _SkippedVersion as e:
            skipped.append(str(e))
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ModelConfigError(f"{model_dir.name}: no version directory holds every stage{why}")
    for why in skipped:
        log.warning("model %s: %s", model_dir.name, why)
    return found


class _SkippedVersion(ModelConfigError):
    """One version directory cannot be served; the model's other versions still can."""


def _version_number(name: str) -> int | None:
    """The version a directory name stands for; None if it is no version's name (a "notes"
    directory, say); _SkippedVersion if it looks like a number but is not one we take."""
    if _VERSION_RE.fullmatch(name):
        return int(name)
    if name.isdigit():  # what scans before this one took for a version: say why it is not
        raise _SkippedVersion(f"version directory {name!r} is skipped: versions are 1 to {MAX_VERSION_DIGITS} "
                              "ASCII digits")
    return None


def _version_file(d: Path, what: str = "") -> tuple[Path, ModelFormat] | None:
    """The model file of a version directory (None: it holds none); _SkippedVersion when it
    cannot be served (a FIFO, a socket, a directory, a broken link, unreadable, or both files).
    `what` names the directory in messages ("version 3" by default)."""
    what = what or f"version {d.name}"
    found: list[tuple[Path, ModelFormat]] = []
    for f, fmt in MODEL_FILES.items():
        path = d / f
        try:
            os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:  # a version directory we may not search
            raise _SkippedVersion(f"{what} is skipped: {e.strerror or e}") from None
        problem = file_problem(path)
        if problem is not None:
            raise _SkippedVersion(f"{what} is skipped: {problem}")
        found.append((path, fmt))
    if len(found) > 1:  # which one is meant cannot be told
        raise _SkippedVersion(f"{what} is skipped: it holds both model.pt2 and model.ts")
    return found[0] if found else None


def _version_dirs(model_dir: Path, skipped: list[str]) -> dict[int, Path]:
    """Version -> its directory. Entries named like a version that cannot be one go to `skipped`.
    Two directories for one number ("1" and "01"): the one spelled as the version is ("1") is
    taken and the other skipped; with none spelled so ("01" and "001"), which one is meant cannot
    be told, and both are skipped."""
    by_version: dict[int, list[Path]] = {}
    for d in sorted(model_dir.iterdir()):
        try:
            version = _version_number(d.name)
            if version is None:
                continue
            try:
                st = d.stat()
            except OSError as e:  # a symlink loop, a dangling link
                raise _SkippedVersion(f"version {d.name} is skipped: {e.strerror or e}") from None
        except _SkippedVersion as e:
            skipped.append(str(e))
            continue
        if stat.S_ISDIR(st.st_mode):  # a file named like a number is no version directory
            by_version.setdefault(version, []).append(d)
    dirs: dict[int, Path] = {}
    for version, found in by_version.items():
        canonical = [d for d in found if d.name == str(version)]
        if len(found) == 1 or canonical:
            dirs[version] = (canonical or found)[0]
        names = [d.name for d in found]
        for d in found:
            if d is not dirs.get(version):
                others = [n for n in names if n != d.name]
                skipped.append(f"version directory {d.name!r} is skipped: {', '.join(map(repr, others))} "
                               f"{'is' if len(others) == 1 else 'are'} version {version} too")
    return dirs


def _versions(model_dir: Path) -> tuple[Layout, list[tuple[int, Path, ModelFormat]]]:
    """The layout and servable versions of a model. A version that cannot be served is skipped
    with one WARNING while another one can be; with none left the model is broken, and its reason
    says what was skipped. With no version directory at all, a bare model file is version 1."""
    model = model_dir.name
    skipped: list[str] = []
    found: dict[int, tuple[Path, ModelFormat]] = {}
    dirs = _version_dirs(model_dir, skipped)
    for version, d in sorted(dirs.items()):
        try:
            file = _version_file(d)
        except _SkippedVersion as e:
            skipped.append(str(e))
            continue
        if file is not None:
            found[version] = file
    try:
        bare = _version_file(model_dir, "its model file")
    except _SkippedVersion as e:
        bare = None
        if not found:
            skipped.append(str(e))
    if not found and not dirs and bare is not None:
        return "bare", [(1, *bare)]
    if bare is not None:  # both layouts: which one is meant cannot be told, so the versions win
        log.warning("model %s: %s beside version directories is not served (a bare model file is served only "
                    "in a directory with no version directories)", model, bare[0].name)
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ModelConfigError(f"{model}: no version directory with model.pt2 or model.ts, nor a bare model.pt2 "
                               f"or model.ts{why}")
    for why in skipped:
        log.warning("model %s: %s", model, why)
    return "versions", [(v, *found[v]) for v in sorted(found)]


def _model_dirs(root: Path, broken: dict[str, str]) -> list[Path]:
    """The repository's model directories, by name. An entry that cannot even be looked at (a
    symlink loop, a dangling link) is broken; one that is neither a directory nor a regular file
    (a FIFO, a socket) is skipped with a WARNING; regular files (a README) are passed over."""
    dirs: list[Path] = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        try:
            mode = p.stat().st_mode
        except OSError as e:
            broken[p.name] = f"{p.name!r}: {e.strerror or e}"
            log.warning("model %r is not served: %s", p.name, broken[p.name])
            continue
        if stat.S_ISDIR(mode):
            dirs.append(p)
        elif not stat.S_ISREG(mode):
            log.warning("model repository: skipping %r: it is %s", p.name, file_type(mode))
    return dirs


def _model_versions(model_dir: Path, default_slo_ms: float) -> list[ModelSpec]:
    """Every servable version of one model; ModelConfigError or OSError if there is none."""
    name = model_dir.name
    if not NAME_RE.fullmatch(name):
        raise ModelConfigError(f"{name!r}: model names must be letters, digits, '_', '.', '-'")
    if os.path.lexists(model_dir / "config.toml"):
        cfg = parse_model_config(model_dir, default_slo_ms)
        if cfg["stages"]:  # a plan of stages: its version directories hold stage files, not a model file
            try:
                memory = kserve.declared_memory(model_dir)
            except AgentFileError as e:
                raise ModelConfigError(f"{name}: KServe's agent file {e}") from None
            return [ModelSpec(version=v, path=path, format="pt2", **{**cfg, "stages": files, "memory_bytes": memory})
                    for v, path, files in _staged_versions(model_dir, cfg["stages"])]
    try:
        layout, versions = _versions(model_dir)
    except ModelConfigError:
        if os.path.lexists(model_dir / "config.toml"):
            parse_model_config(model_dir, default_slo_ms)  # a broken config is the first thing to fix
        raise
    if layout == "bare" and not os.path.lexists(model_dir / "config.toml"):
        path, fmt = versions[0][1:]
        if fmt == "ts":
            raise ModelConfigError(f"{name}: a bare model.ts needs a config.toml beside it (a TorchScript file "
                                   "records no input or output shapes)")
        try:
            cfg = check_model_config(inferred_config(path), name, default_slo_ms)
        except SignatureError as e:
            raise ModelConfigError(f"{name}: no config.toml, and {e}") from None
    else:
        cfg = parse_model_config(model_dir, default_slo_ms)
    try:
        memory = kserve.declared_memory(model_dir)
    except AgentFileError as e:
        raise ModelConfigError(f"{name}: KServe's agent file {e}") from None
    specs: list[ModelSpec] = []
    for version, path, fmt in versions:
        cfg_v = {**cfg, "layout": layout, "memory_bytes": memory, "stages": ()}
        if cfg["parity"] is not None:
            problem = file_problem(path.parent / cfg["parity"].file)
            if problem is not None:
                log.warning("%s:%d: parity file %s: served without parity", name, version, problem)
                cfg_v = {**cfg_v, "parity": None}
        if cfg["personalization"] is not None:
            try:
                cfg_v["personalization"] = load_head(cfg["personalization"], path.parent, cfg["outputs"])
            except ModelConfigError as e:
                raise ModelConfigError(f"{name}: version {version}: {e}") from None
        specs.append(ModelSpec(version=version, path=path, format=fmt, **cfg_v))
    return specs


def scan(root: str | Path, default_slo_ms: float = 100.0) -> ScanResult:
    """Every servable model version under `root`, and the reason each broken entry is not."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} is not a directory")
    models: list[ModelSpec] = []
    broken: dict[str, str] = {}
    for model_dir in _model_dirs(root, broken):
        name = model_dir.name
        try:
            models.extend(_model_versions(model_dir, default_slo_ms))
        except (ModelConfigError, OSError) as e:
            broken[name] = str(e)
            log.warning("model %r is not served: %s", name, e)
        except Exception as e:
            # NOTE: a bug the checks above miss must cost one model, not the scan (and with it
            # the start-up or a reload of every other model); the type names it in the log.
            broken[name] = f"{name}: cannot be read: {type(e).__name__}: {e}"
            log.warning("model %r is not served: %s", name, broken[name], exc_info=True)
    return ScanResult(models, broken)


def stamp(spec: ModelSpec) -> Stamp:
    """The stamps of a version's files (config, model or stages, parity model); a missing one is (0, 0)."""
    files = [spec.config_file, *(spec.stages or (spec.path,))]  # a plan of stages: each stage's file
    if spec.parity is not None:
        files.append(spec.path.parent / spec.parity.file)
    out: list[tuple[int, int]] = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            out.append((0, 0))
        else:
            out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)
