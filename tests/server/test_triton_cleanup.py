"""Removing a dead run's workspace: its staged symlinks point into operators' repositories, which must survive."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from server import triton


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """An operator's repository: a file and a folder that staged models link to."""
    repository = tmp_path / "operator"
    (repository / "folder").mkdir(parents=True)
    (repository / "model.py").write_text("# the operator's model\n")
    (repository / "folder" / "weights.bin").write_bytes(b"\0" * 16)
    return repository


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(triton, "_SHM_DIR", tmp_path / "shm")  # leave other runs' shared memory alone
    (tmp_path / "shm").mkdir()
    return tmp_path / "runtime"


def test_a_dead_runs_workspace_goes_and_its_link_targets_stay(runtime: Path, outside: Path) -> None:
    assert shutil.rmtree.avoids_symlink_attacks  # the fd-based walk that never follows a link (Linux)
    version = runtime / f"serve-{dead_pid()}-0a1b2c3d" / "model-store" / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.py").symlink_to(outside / "model.py")
    (version / "folder").symlink_to(outside / "folder")
    (version.parent / "config.pbtxt").write_text('name: "m"\n')
    triton.clean_stale_runs(runtime)
    assert list(runtime.iterdir()) == []
    assert (outside / "model.py").read_text() == "# the operator's model\n"
    assert (outside / "folder" / "weights.bin").stat().st_size == 16


def test_a_workspace_that_is_itself_a_link_is_unlinked_not_emptied(runtime: Path, outside: Path) -> None:
    runtime.mkdir()
    (runtime / f"serve-{dead_pid()}-0a1b2c3d").symlink_to(outside)
    triton.clean_stale_runs(runtime)
    assert list(runtime.iterdir()) == []
    assert sorted(p.name for p in outside.iterdir()) == ["folder", "model.py"]
    assert (outside / "folder" / "weights.bin").exists()
