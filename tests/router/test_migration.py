"""Request migration: a request whose worker dies mid-stream is resumed on another worker (RoutedEngine)."""

from __future__ import annotations

import queue
import threading

from test_routed_engine import LocalWorker

from kvbm.index import KVIndex
from server.engine.api import GenerationOutput, GenerationRequest, OutputSink, RequestId, SamplingParams
from server.router.config import RouterConfig
from server.router.routed import RoutedEngine
from server.router.router import Router
from server.workers.remote import WorkerDied
from tests.workers.worker_fakes import SALT


class MortalWorker(LocalWorker):
    """A LocalWorker that can die like a RemoteEngine does: leave the router, then end its requests with a
    retryable error; its engine's later outputs are dropped."""

    def __init__(self, worker_id: str, index: KVIndex) -> None:
        super().__init__(worker_id, index)
        self.requests: list[GenerationRequest] = []
        self._sinks: dict[RequestId, OutputSink] = {}
        self._lock = threading.Lock()

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.requests.append(request)
        self._sinks[request.request_id] = sink

        def forward(output: GenerationOutput) -> None:
            with self._lock:
                live = self.alive and (
                    self._sinks.pop(output.request_id)
                    if output.finished
                    else self._sinks.get(output.request_id)
                )
            if live:
                live(output)

        super().submit(request, forward)

    def die(self, retryable: bool = True) -> None:
        with self._lock:
            self.alive = False
            sinks, self._sinks = self._sinks, {}
        for listener in self.listeners:
            listener.on_death(self)
        for request_id, sink in sinks.items():
            sink(
                GenerationOutput(
                    request_id,
                    [],
                    "",
                    True,
                    "error",
                    error=f"worker {self.worker_id} died",
                    retryable=retryable,
                )
            )


def _setup(workers: int = 2, **config) -> tuple[RoutedEngine, Router, list[MortalWorker]]:
    index = KVIndex()
    router = Router(RouterConfig(**config), index)
    local = [MortalWorker(f"w{i}", index) for i in range(workers)]
    return RoutedEngine(local, router, block_size=4, salt=SALT), router, local


def _start(
    routed: RoutedEngine, prompt: list[int], max_tokens: int, first_tokens: int, cache_salt: str | None = None
) -> tuple[queue.SimpleQueue[GenerationOutput], list[GenerationOutput]]:
    """Submit, and return once `first_tokens` outputs arrived."""
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    request = GenerationRequest(RequestId("r"), prompt, SamplingParams(max_tokens=max_tokens), cache_salt)
    routed.submit(request, outputs.put)
    seen = [outputs.get(timeout=10) for _ in range(first_tokens)]
    return outputs, seen


def _rest(
    outputs: queue.SimpleQueue[GenerationOutput], seen: list[GenerationOutput]
) -> list[GenerationOutput]:
    while not seen[-1].finished:
        seen.append(outputs.get(timeout=10))
    return seen


def _migrations(router: Router, worker: str) -> float:
    return router.metrics.registry.get_sample_value("strata_router_migrations_total", {"worker": worker}) or 0


def test_a_request_continues_on_another_worker_when_its_worker_dies() -> None:
    routed, router, workers = _setup()
    prompt = list(range(10))
    outputs, seen = _start(routed, prompt, max_tokens=60, first_tokens=5, cache_salt="tenant-a")
    holder = next(w for w in workers if w.requests)
    other = next(w for w in workers if w is not holder)
    holder.die()
    seen = _rest(outputs, seen)
    generated = [t for o in seen for t in o.new_token_ids]
    final = seen[-1]
    assert final.finish_reason == "length" and final.error is None
    assert len(generated) == 60 and final.num_output_tokens == 60 and final.num_prompt_tokens == len(prompt)
    continuation = other.requests[0]
    done = len(continuation.prompt_token_ids) - len(prompt)
    assert done >= 5 and continuation.prompt_token_ids == prompt + generated[:done]
    assert continuation.sampling.max_tokens == 60 - done
    assert continuation.cache_salt == "tenant-a"  # its prefix stays its tenant's on the new worker
    assert _migrations(router, holder.worker_id) == 1
    assert all(load.routed_requests == 0 for load in router._workers.values())


def test_no_migration_with_limit_zero_or_after_abort_or_when_no_worker_is_left() -> None:
    routed, router, workers = _setup(migration_limit=0)
    outputs, seen = _start(routed, [1, 2, 3], max_tokens=60, first_tokens=2)
    next(w for w in workers if w.requests).die()
    assert _rest(outputs, seen)[-1].finish_reason == "error"

    routed, router, workers = _setup()
    outputs, seen = _start(routed, [1, 2, 3], max_tokens=60, first_tokens=2)
    routed.abort(RequestId("r"))
    next(w for w in workers if w.requests).die()
    assert _rest(outputs, seen)[-1].finish_reason in ("abort", "error")
    assert sum(len(w.requests) for w in workers) == 1

    routed, router, workers = _setup(workers=1)
    outputs, seen = _start(routed, [1, 2, 3], max_tokens=60, first_tokens=2)
    workers[0].die()
    final = _rest(outputs, seen)[-1]
    assert final.finish_reason == "error" and "died" in final.error
    assert _migrations(router, "w0") == 0


def test_a_server_stopping_its_worker_is_not_a_migration() -> None:
    routed, router, workers = _setup()
    outputs, seen = _start(routed, [1, 2, 3], max_tokens=60, first_tokens=2)
    next(w for w in workers if w.requests).die(retryable=False)
    assert _rest(outputs, seen)[-1].finish_reason == "error"
    assert sum(len(w.requests) for w in workers) == 1


class SilentlyDead(MortalWorker):
    """Died after its last heartbeat: still listed alive, but every call fails as a RemoteEngine's does."""

    attempts = 0

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self.attempts += 1
        raise WorkerDied(f"worker {self.worker_id} died: no heartbeat")

    def encode(self, text: str) -> list[int]:
        raise WorkerDied(f"worker {self.worker_id} died: no heartbeat")


def test_a_migration_passes_over_a_target_that_fails_at_once(monkeypatch) -> None:
    """The worker the router picks first for the continuation is dead too (not yet detected): the request goes
    to the next live one instead of failing."""
    index = KVIndex()
    router = Router(RouterConfig(), index)
    holder = MortalWorker("w0", index)
    routed = RoutedEngine([holder], router, block_size=4, salt=SALT)
    outputs, seen = _start(routed, list(range(10)), max_tokens=40, first_tokens=3)
    ghost, alive = SilentlyDead("w1", index), MortalWorker("w2", index)
    routed.add_worker(ghost)
    routed.add_worker(alive)
    route = router.route

    def ghost_first(request_id, block_hashes, exclude=()):
        if "w1" not in exclude:  # only the ghost is a candidate until it has been tried
            exclude = [w for w in router._workers if w != "w1"]
        return route(request_id, block_hashes, exclude)

    monkeypatch.setattr(router, "route", ghost_first)
    holder.die()
    final = _rest(outputs, seen)[-1]
    assert final.finish_reason == "length" and final.error is None
    assert ghost.attempts == 1 and len(alive.requests) == 1 and _migrations(router, "w0") == 1


def test_a_submit_to_a_worker_that_turns_out_dead_goes_to_the_next_and_so_does_tokenizing() -> None:
    index = KVIndex()
    router = Router(RouterConfig(strategy="round-robin"), index)
    ghost, alive = SilentlyDead("w0", index), MortalWorker("w1", index)
    routed = RoutedEngine([ghost, alive], router, block_size=4, salt=SALT)
    for i in range(4):  # round-robin picks the ghost for half of them
        outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
        routed.submit(
            GenerationRequest(RequestId(f"r{i}"), [1, 2, 3], SamplingParams(max_tokens=2)), outputs.put
        )
        assert _rest(outputs, [outputs.get(timeout=10)])[-1].finish_reason == "length"
        assert routed.encode("hello") == alive.encode("hello")
    assert len(alive.requests) == 4
