"""Building the compiled controller: `python -m daemon.native build | status | clean`."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

from daemon import native
from daemon.native import GROUP, MODULES, PACKAGE, digest, extension_of, manifest, source_of, suffix


def _missing_tools() -> str | None:
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (it comes with mypy, in the dev extra)"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    return None


def build(package: Path = PACKAGE, jobs: int = 0, force: bool = False) -> int:
    """Compile `MODULES` and install the extensions beside their sources (nothing to do where
    they are current). Files are replaced by rename (a running daemon keeps the ones it mapped)
    and the record is written last, so a half-done build is stale, never half-loaded."""
    if not force and native.inspect(package, env={}).compiled:
        print("daemon.native: the compiled controller is up to date")
        return 0
    missing = _missing_tools()
    if missing:
        print(f"daemon.native: not compiled: {missing}; the controller runs from source")
        return 0
    root = package.parent
    compiled = native.record(package)
    with tempfile.TemporaryDirectory(prefix="escapement-native-") as tmp:
        from mypyc.build import mypycify
        from setuptools import setup  # build-time only
        cwd = os.getcwd()
        try:
            os.chdir(root)  # mypy reads pyproject.toml's [tool.mypy] from here
            extensions = mypycify([str(source_of(m, package).relative_to(root)) for m in MODULES],
                                  group_name=GROUP, opt_level="3", target_dir=str(Path(tmp) / "c"))
            os.chdir(tmp)  # and setuptools must not read it: this is not the project's own build
            setup(name="escapement-native", ext_modules=extensions,
                  script_args=["-q", "build_ext", "--build-lib", str(Path(tmp) / "lib"),
                               "--build-temp", str(Path(tmp) / "obj"), "-j", str(jobs or os.cpu_count() or 1)])
        finally:
            os.chdir(cwd)
        if digest(package) != compiled["digest"]:
            print("daemon.native: the sources changed during the build; nothing installed", file=sys.stderr)
            return 1
        manifest(package).unlink(missing_ok=True)
        for so in stale_extensions(package):  # (a module no longer compiled: its old build would shadow it)
            so.unlink()
        built = Path(tmp) / "lib"
        for so in built.rglob("*" + suffix()):
            dest = root / so.relative_to(built)
            part = dest.with_name(dest.name + ".part")
            shutil.copyfile(so, part)
            os.replace(part, dest)
    part = manifest(package).with_suffix(".part")
    part.write_text(json.dumps(compiled | {"mypy": _mypy_version()}, indent=1) + "\n")
    os.replace(part, manifest(package))
    print(f"daemon.native: compiled {len(MODULES)} modules for Python {compiled['python']}")
    return 0


def _mypy_version() -> str:
    from mypy.version import __version__
    return __version__


def stale_extensions(package: Path = PACKAGE) -> list[Path]:
    """Extensions beside a source under `package` for a module not in `MODULES` (left by a build
    whose MODULES held it): Python would import that old build before the source, against a group
    library that no longer has it."""
    wanted = {extension_of(m, package) for m in MODULES}
    out = []
    for so in package.rglob("*.cpython-*.so"):
        if so.parent == package and so.name.startswith(GROUP.rsplit(".", 1)[1] + "__mypyc."):
            continue  # the group's shared library
        if so not in wanted and so.with_name(so.name.split(".", 1)[0] + ".py").exists():
            out.append(so)
    return sorted(out)


def clean(package: Path = PACKAGE) -> int:
    manifest(package).unlink(missing_ok=True)
    for m in MODULES:
        for so in extension_of(m, package).parent.glob(m.rsplit(".", 1)[1] + ".cpython-*.so"):
            so.unlink()
    for so in package.glob(GROUP.rsplit(".", 1)[1] + "__mypyc.cpython-*.so"):
        so.unlink()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = args[0] if args else "status"
    if cmd == "build":
        return build(force="--force" in args)
    if cmd == "clean":
        return clean()
    if cmd == "status":
        import daemon.controller.scheduler  # noqa: F401 (to report what really loads)
        print(f"{native.STATE}; imported compiled: {native.imported_compiled()}")
        return 0
    print("usage: python -m daemon.native [build [--force] | status | clean]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
