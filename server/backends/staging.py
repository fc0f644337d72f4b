"""Helpers shared by the file backends: atomic writes and symlink trees under Triton's model store."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` so that a reader sees either the old or the new content, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def link(target: Path, link_path: Path) -> None:
    """Make `link_path` a symlink to `target`, replacing whatever was there."""
    if link_path.is_symlink() and Path(os.readlink(link_path)) == target:
        return
    remove(link_path)
    link_path.symlink_to(target)


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def prune(folder: Path, keep: set[str]) -> None:
    """Remove every entry of `folder` whose name is not in `keep`."""
    for entry in folder.iterdir():
        if entry.name not in keep:
            remove(entry)
