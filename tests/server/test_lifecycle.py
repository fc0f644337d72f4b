"""Start-up and shutdown: taken ports, signals, and a restart after kill -9 leave nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from harness.ports import free_port
from harness.servers import copy_models
from harness.waiting import wait_for


def descendants(pid: int) -> set[int]:
    """Every live process whose ancestry includes `pid`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        children = {child for child, parent in parents.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def shm_regions(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"pytrtion{pid}-*")]


def test_taken_port_fails_fast_naming_it(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "string_upper")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        started = time.monotonic()
        server = strata(repo, wait_ready=False, ports=(free_port(), taken, free_port()))
        server.process.wait(30)
        assert time.monotonic() - started < 15
    assert server.process.returncode != 0
    assert f"port {taken} (--grpc-port) is already in use" in server.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(strata, tmp_path, sig):
    repo = copy_models(tmp_path / "repo", "add_sub")
    server = strata(repo)
    pid = server.process.pid
    assert descendants(pid), "Triton should run as a child of strata"
    assert shm_regions(pid)
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_model_ready("add_sub")
    client.close()
    started = time.monotonic()
    assert server.stop(sig, timeout=30) == 0
    assert time.monotonic() - started < 5 + 10  # --exit-timeout-secs 5, plus Triton's own stop
    wait_for(lambda: not descendants(pid), 10, what="children gone")
    assert not shm_regions(pid)
    assert not any(server.runtime_dir.iterdir())


def test_restart_after_kill_9(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "add_sub")
    first = strata(repo)
    children = descendants(first.process.pid)
    ports = (first.http_port, first.grpc_port, first.metrics_port)
    os.kill(first.process.pid, signal.SIGKILL)
    first.process.wait(10)
    # Triton gets SIGTERM from the kernel when its parent dies (PR_SET_PDEATHSIG) and exits by itself
    wait_for(lambda: not any(Path(f"/proc/{c}").exists() for c in children), 30, what="orphans gone")
    second = strata(repo, ports=ports)
    client = httpclient.InferenceServerClient(second.http_url)
    assert client.is_model_ready("add_sub")
    client.close()
    assert not shm_regions(first.process.pid)
    assert [p.name for p in second.runtime_dir.iterdir()] == [
        p.name for p in second.runtime_dir.glob(f"serve-{second.process.pid}-*")
    ]
