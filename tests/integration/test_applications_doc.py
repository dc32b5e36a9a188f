"""docs/applications.md works as written: its shell blocks (curl, jq, the CLI) and its Python
block run, in order, against a daemon serving the demo repository (the doc's address replaced by
the daemon's, its socket reached where the doc says: run/escapement.sock)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonThread, settings, short_tmpdir

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "applications.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


@pytest.fixture(scope="module")
def daemon(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    db = tmp_path_factory.mktemp("docdb") / "apps.sqlite3"
    dt = DaemonThread(settings(demo_repo, d, apps={"db_path": str(db)})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def workdir(daemon: DaemonThread, tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "escapement.sock").symlink_to(daemon.socket)
    return tmp_path


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None, reason="needs curl and jq")
def test_the_shell_examples_run_as_written(daemon: DaemonThread, workdir: Path) -> None:
    script = "set -euo pipefail\n" + "\n".join(blocks("sh")).replace("localhost:8000", daemon.http)
    out = subprocess.run(["bash", "-c", script], cwd=workdir, env=env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    text = out.stdout
    assert '"query_id"' in text and '"rewards"' in text  # the query and its feedback
    assert '"default":true' in text and "\n504\n" in text  # the default answer; the 504 without one
    assert '"digits_mlp"' in text and '"pair"' in text  # the index, after the API added "pair"
    assert "application digits: answered by" in text  # the CLI
    assert out.stdout.rstrip().endswith("}")  # the CLI's feedback answer


def test_the_python_example_runs_as_written(daemon: DaemonThread, workdir: Path) -> None:
    (code,) = blocks("python")
    out = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8000", daemon.http)], cwd=workdir,
                         env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and "digits_" in lines[0] and "weights" not in lines[0]
