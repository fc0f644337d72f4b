"""What a benchmark ran on, for its table and its JSON line: the date, the CPU, the cores it may use, the commit."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cores() -> int:
    """The cores this process may run on (its affinity), which is what a benchmark's threads share."""
    return len(os.sched_getaffinity(0))


def git_commit() -> str:
    """HEAD's short hash, "-dirty" if tracked files differ from it; "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode == 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head if clean else f"{head}-dirty"


def machine() -> dict[str, str | int]:
    """The date (UTC), CPU model, core count and commit of this run, for a JSON report."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_name(),
        "cores": cores(),
        "commit": git_commit(),
    }


def describe(run: dict) -> str:
    """One line for a table: "2026-12-07 10:00 UTC, AMD EPYC 9R14, 2 cores, commit 2f0b135..." (what is known)."""
    parts = [run.get("date"), run.get("cpu"), f"{run['cores']} cores" if "cores" in run else None]
    parts.append(f"commit {run['commit']}" if "commit" in run else None)
    return ", ".join(str(part) for part in parts if part) or "date, machine and commit not recorded"
