"""A worker the server gave cores of its own runs there whole: its threads and the processes it starts later."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server.workers.external import SOURCE_ROOT

# on one core, pinned and unpinned look the same: nothing here could fail
pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")

CHILD = """
import json, os, subprocess, sys, threading
from server.workers.external import pin_to_cpus

pin_to_cpus(sys.argv[1])
seen = {}
thread = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
thread.start()
thread.join()
probe = "import os; print(sorted(os.sched_getaffinity(0)))"
seen["child"] = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout)
seen["main"] = sorted(os.sched_getaffinity(0))
print(json.dumps(seen))
"""


def affinity_after(value: str) -> dict[str, list[int]]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, value],
        capture_output=True, text=True, timeout=120, cwd=SOURCE_ROOT,
        env={**os.environ, "PYTHONPATH": str(SOURCE_ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_worker_process_tree_runs_on_its_cores() -> None:
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[-1:]  # the last core this test may use
    seen = affinity_after(",".join(map(str, mine)))
    assert seen == {"main": mine, "thread": mine, "child": mine}


def test_ranks_of_a_bind_are_one_set_and_empty_leaves_it_alone() -> None:
    cores = sorted(os.sched_getaffinity(0))
    bind = f"{cores[0]}|{cores[1]}"  # VLLM_CPU_OMP_THREADS_BIND's form: ranks split by "|"
    assert affinity_after(bind)["child"] == cores[:2]
    assert affinity_after("")["child"] == cores
