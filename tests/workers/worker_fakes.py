"""A deterministic engine for worker-process tests; importable by spawned workers (tests/router is on sys.path)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from kvbm.block_hash import block_hashes, model_salt
from kvbm.events import G1, EventSink, TierEvent
from server.engine.api import (
    EngineOverloaded,
    EngineResources,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    OutputSink,
    PoolStats,
    RequestId,
    max_output_tokens,
)
from server.workers.hardware import Speeds
from server.workers.transport import link_keys
from tests.conftest import CLUSTER_SECRET

CURVE = link_keys(CLUSTER_SECRET.encode())  # the cluster's keys for TCP links in these tests

SALT = model_salt("step-engine")


class StepEngine:
    """Answer token i is " t{i}" (id 1000 + i), one per `step_s`, each request on its own thread. Implements
    `server.engine.api.LocalEngine`.

    With `events`, the worker is announced at construction and a submitted prompt's full blocks as stored in G1
    (like a KVBM agent would).
    """

    model_name = "step"
    max_model_len = 256
    max_tokens_limit = 200
    block_layout = KVBlockLayout(block_size=4, salt=SALT)
    resources = EngineResources(
        device="cpu",
        num_threads=1,
        max_concurrent_requests=64,
        kv_capacity_blocks=100,
        kv_capacity_bytes=100 * 4096,
    )
    healthy = True
    shard_layout = ""

    def __init__(
        self,
        step_s: float = 0.005,
        *,
        worker_id: str = "w",
        events: EventSink | None = None,
        max_running: int | None = None,
        submit_s: float = 0.0,
    ) -> None:
        self.step_s = step_s
        self.submit_s = submit_s  # how long submit takes before it accepts (a slow engine)
        self.max_running = max_running  # past it submit raises EngineOverloaded, as a full wait queue does
        self.worker_id = worker_id
        self.events = events
        self._aborts: dict[RequestId, threading.Event] = {}
        if events is not None:  # like a KVBM agent at bind: announce the worker before the engine is ready
            events.publish(TierEvent(worker_id, "stored", G1, ()))

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], tools=None) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def stats(self) -> PoolStats:
        running = sum(not event.is_set() for event in self._aborts.values())
        return PoolStats(
            num_blocks=100,
            num_free_blocks=100,
            num_cached_blocks=0,
            num_running=running,
            num_waiting=0,
            num_preemptions=0,
        )

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        request.sampling.validate(max_output_tokens(self, len(request.prompt_token_ids)))
        if self.submit_s:
            threading.Event().wait(self.submit_s)
        running = sum(not abort.is_set() for abort in self._aborts.values())
        if self.max_running is not None and running >= self.max_running:
            raise EngineOverloaded(f"{running} requests running", retry_after_s=1.5)
        if self.events is not None:
            hashes = block_hashes(request.prompt_token_ids, self.block_layout.block_size, SALT)
            self.events.publish(TierEvent(self.worker_id, "stored", G1, tuple(hashes)))
        abort = self._aborts[request.request_id] = threading.Event()
        threading.Thread(target=self._run, args=(request, sink, abort), daemon=True).start()

    def abort(self, request_id: RequestId) -> None:
        if request_id in self._aborts:
            self._aborts[request_id].set()

    def close(self) -> None:
        for abort in list(self._aborts.values()):
            abort.set()

    def _run(self, request: GenerationRequest, sink: OutputSink, abort: threading.Event) -> None:
        prompt = len(request.prompt_token_ids)
        total = request.sampling.max_tokens
        for i in range(total):
            if abort.wait(self.step_s):
                sink(GenerationOutput(request.request_id, [], "", True, "abort", prompt, 0, i))
                return
            last = i + 1 == total
            sink(
                GenerationOutput(
                    request.request_id,
                    [1000 + i],
                    f" t{i}",
                    last,
                    "length" if last else None,
                    prompt,
                    0,
                    i + 1,
                )
            )
        abort.set()  # done: no longer counted as running


def broken_factory(**_: object) -> StepEngine:
    raise RuntimeError("no weights here")


FAKE_SPEEDS = Speeds(prefill_tok_s=5000.0, decode_tok_s=80.0)


def run_remote_step_worker(
    worker_id: str, redis_url: str, lease_s: float = 1.5, step_s: float = 0.005, exit_timeout_s: float = 30.0
) -> None:
    """A `strata worker` whose engine is a StepEngine (spawn target): registers, serves, drains and leaves on
    SIGTERM."""
    import logging
    import signal

    from server.workers.remote_worker import RemoteWorker, RemoteWorkerOptions
    from server.workers.worker import ChannelEvents, describe

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {worker_id} %(levelname)s %(message)s")
    events = ChannelEvents(None)
    engine = StepEngine(step_s, worker_id=worker_id, events=events)
    options = RemoteWorkerOptions(
        worker_id,
        redis_url,
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        lease_s=lease_s,
        heartbeat_s=0.2,
        exit_timeout_s=exit_timeout_s,
        curve=CURVE,
    )
    worker = RemoteWorker(engine, describe(engine, FAKE_SPEEDS), options, events)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop.set())
    worker.run()
