"""The command line: `escapement serve` as a real process, `infer`, `models`, `demo`, `config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import DaemonProcess

ESC = [sys.executable, "-m", "daemon"]


def run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ESC, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_demo_is_idempotent(demo_repo: Path) -> None:
    r = run("demo", "--out", str(demo_repo))
    assert r.returncode == 0 and "0 built, 7 already there" in r.stdout


def test_bad_config_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[runtime]\ncpu_threads = 'two'\n")
    r = run("serve", "--config", str(cfg))
    assert r.returncode == 2
    assert "runtime.cpu_threads = 'two': expected an integer" in r.stderr
    r = run("serve", "--http", "nohost")
    assert r.returncode == 2 and "server.http = 'nohost'" in r.stderr


def test_config_prints_the_effective_settings() -> None:
    r = run("config", "--http", "127.0.0.1:9999")
    assert r.returncode == 0
    assert 'server.http = "127.0.0.1:9999"  # HOST:PORT' in r.stdout


@pytest.mark.slow
def test_serve_infer_models_and_sigterm(demo_repo: Path, sock_dir: Path) -> None:
    sock = sock_dir / "e.sock"
    with DaemonProcess(["--models", str(demo_repo), "--socket", str(sock), "--http", "127.0.0.1:0",
                        "--device", "cpu:0"]) as proc:
        proc.start()
        r = run("infer", "digits_mlp", "--digits", "8", "--socket", str(sock))
        assert r.returncode == 0, r.stderr
        assert "(8/8 correct)" in r.stdout or "(7/8 correct)" in r.stdout
        r = run("infer", "mlp_784", "--socket", str(sock), "--json")
        assert r.returncode == 0 and '"OUTPUT__0"' in r.stdout
        r = run("infer", "nope", "--socket", str(sock))
        assert r.returncode == 1 and "error 404: unknown model 'nope'" in r.stderr
        r = run("models", "--socket", str(sock))
        assert r.returncode == 0 and "digits_cnn" in r.stdout and "READY" in r.stdout
        proc.terminate()
        assert proc.wait(60) == 0
        assert "[shutdown] done" in proc.log()
        assert not sock.exists()


def test_cannot_reach_the_daemon(sock_dir: Path) -> None:
    r = run("infer", "digits_mlp", "--socket", str(sock_dir / "none.sock"))
    assert r.returncode == 1 and "cannot reach the daemon" in r.stderr


def test_profile_command_stores_profiles(test_repo: Path, tmp_path: Path) -> None:
    import json
    import shutil

    shutil.copytree(test_repo / "tiny_pt2", tmp_path / "tiny_pt2")
    (tmp_path / "tiny_pt2" / "1" / "profile.json").unlink(missing_ok=True)
    r = run("profile", "--models", str(tmp_path), "--reps", "3")
    assert r.returncode == 0, r.stderr
    assert "tiny_pt2:1" in r.stdout and "infer p99 ms" in r.stdout
    stored = json.loads((tmp_path / "tiny_pt2" / "1" / "profile.json").read_text())
    from daemon.runtime.devices import cpu_model

    assert stored[f"cpu:{cpu_model()}"]["device"] == "cpu:0"  # filed under the CPU it was measured on
