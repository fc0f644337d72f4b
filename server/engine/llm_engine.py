"""The in-process engine: a background thread runs the engine core's steps while there is work and sleeps
otherwise.

Threads: callers use `submit` / `abort` (any thread); a request is checked and made a sequence on the caller's
thread (server/engine/input_processor.py) and handed over through the inbox (server/engine/inbox.py). Everything
else (the core: scheduler, block manager, pool, sinks) belongs to the engine thread, which builds the engine
(server/engine/builder.py), then drains the inbox between steps (`EngineCore.step`, server/engine/core.py).
Disaggregated prefill/decode is the core's KV transfer connector (server/engine/kv_transfer.py): at submit its
scheduler half prepares a handed-off request, and fetches a resumed one's blocks before it joins the inbox. The
engine treats every executor alike (server/engine/executor.py): one that loses a part of itself reports it, and
`recover`s on the engine thread while the engine's requests are ended or requeued (server/engine/recovery.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvbm.api import KVConnector
from kvbm.transfer import KVTransfer
from server.engine import chat
from server.engine.api import (
    EngineOverloaded,
    GenerationRequest,
    OutputSink,
    PoolStats,
    RequestId,
)
from server.engine.builder import EngineParts, Sharding, build, threads_per_rank
from server.engine.config import EngineConfig
from server.engine.executor import ExecutorFailure
from server.engine.inbox import Inbox
from server.engine.input_processor import InputProcessor
from server.engine.recovery import RankFailurePolicy, Recovery
from server.engine.request_trace import RequestTrace

log = logging.getLogger(__name__)


class LLMEngine:
    """Implements `server.engine.api.LocalEngine`. Build with `LLMEngine(EngineConfig(...))` or
    `LLMEngine.from_json`. The loaded parts (model, tokenizer, layouts, core) are attributes after `__init__`."""

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        transfer: KVTransfer | None = None,
        *,
        worker_id: str = "0",
        on_rank_failure: RankFailurePolicy = "resume",
        resume_limit: int = 3,
    ) -> None:
        """`transfer`: how prefill handoffs move (default: shared memory on this host). `on_rank_failure` and
        `resume_limit`: what a sharded engine does with its requests when its group loses a rank
        (server/engine/recovery.py); `worker_id` names its ranks' processes.

        The model is loaded on the engine thread, which then runs every step: see `_run`."""
        self.config = config
        self.worker_id = worker_id
        self._num_threads = threads_per_rank(config)
        self._inbox = Inbox()
        self._recovery = Recovery(self._inbox, on_rank_failure, resume_limit, worker_id)
        self.num_rejected = 0  # submits refused because the wait queue was full
        self._connector = connector
        self._chat_tokenizer = None
        self._chat_lock = threading.Lock()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(connector, transfer), name="strata-engine", daemon=True
        )
        self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def _run(self, connector: KVConnector | None, transfer: KVTransfer | None) -> None:
        """The engine thread: build, then step until closed.

        Every multi-threaded torch op of the engine runs on this one thread: libgomp keeps a team of OpenMP workers
        per host thread that ever ran a parallel region, and once its workers outnumber the cores it stops
        spinning at barriers (`gomp_throttled_spin_count_var`) and sleeps on a futex at each of the thousands of
        barriers a step has. So the model loads here too, not on the caller's thread."""
        torch.set_num_threads(self._num_threads)  # OpenMP thread counts are per calling thread
        try:
            sharding = Sharding(self.worker_id, self._recovery.on_event)
            self._take(build(self.config, self._num_threads, connector, transfer, self._forget, sharding))
        except BaseException as err:
            self._load_error = err
            self._loaded.set()
            return
        self._loaded.set()
        self._loop()

    def _take(self, parts: EngineParts) -> None:
        self.parts = parts
        self.core = parts.core
        self.files, self.model, self.tokenizer = parts.files, parts.model, parts.tokenizer
        self.model_name, self.max_model_len = parts.model_name, parts.max_model_len
        self.max_tokens_limit = parts.max_tokens_limit
        self.layout, self.block_layout, self.salt = parts.layout, parts.block_layout, parts.salt
        self.eos_token_ids, self.resources = parts.eos_token_ids, parts.resources
        self.scheduler, self.block_manager = parts.core.scheduler, parts.core.scheduler.block_manager
        self.runner, self.kv_transfer = parts.core.runner, parts.core.kv_transfer
        self.inputs = InputProcessor(self, parts, self.config.block_size)
        self._recovery.bind(parts.core, parts.model_name)

    @classmethod
    def from_json(cls, path: str, connector: KVConnector | None = None) -> LLMEngine:
        """Build from a `model_repository/<model>/1/model.json`."""
        return cls(EngineConfig.from_json(path), connector)

    # ---- caller side (any thread) ----

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt must not stall the worker's heartbeats
        return self.tokenizer.encode_batch([text])[0].ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of `messages` (and `tools`) rendered with the model's chat template, or model.json's or
        --chat-template's (server/engine/chat.py), ending with the assistant prompt."""
        with self._chat_lock:  # loaded once: two threads importing transformers at once can fail
            if self._chat_tokenizer is None:
                from transformers import AutoTokenizer

                self._chat_tokenizer = AutoTokenizer.from_pretrained(self.files.folder, local_files_only=True)
        rendered = chat.render(self._chat_tokenizer, messages, tools, self.config.chat_template)
        return self._chat_tokenizer.encode(rendered, add_special_tokens=False)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        seq, params = self.inputs.process(request, sink)
        with self._inbox.lock:
            self._inbox.check_open()
            self._recovery.check_admission()
            self._inbox.check_new(request.request_id)
            # the deque's len is safe from any thread
            queued = self._inbox.num_queued + len(self.scheduler.waiting)
            if queued >= self.config.max_queued_requests:
                self.num_rejected += 1
                raise EngineOverloaded(
                    f"{self.model_name}: {queued} requests are waiting (max_queued_requests); retry later"
                )
            seq.trace = RequestTrace.start(
                request.trace_context, request.request_id, seq.num_prompt_tokens, self.model_name
            )
            self._inbox.admit(seq)
            if self.kv_transfer.needs_fetch(params):
                self.kv_transfer.fetch_then(seq, params, self._inbox.put)
            else:
                self._inbox.put(seq)

    def abort(self, request_id: RequestId) -> None:
        self._inbox.abort(request_id)

    def stats(self) -> PoolStats:
        """A snapshot (read without locking: counts may be one step stale). A sharded engine adds each rank's
        state and memory, and its group's restarts by reason."""
        manager = self.block_manager
        stats = PoolStats(
            manager.num_blocks,
            manager.num_free_blocks,
            manager.num_cached_blocks,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.scheduler.num_preemptions,
        )
        stats.ranks, stats.restarts = self.runner.ranks(), self.runner.restarts()
        return stats

    @property
    def shard_layout(self) -> str:
        """ "tp<T>pp<P>" when sharded (each rank's tiers hold its part of a block), "" otherwise."""
        return self.runner.shard_layout

    @property
    def healthy(self) -> bool:
        return not self._inbox.stopping and self._thread.is_alive()

    def is_idle(self) -> bool:
        """True when no request is queued, running or unfinished."""
        return self._inbox.is_empty()

    def close(self) -> None:
        """Stop the engine thread (unfinished requests get finish_reason "abort"), then close the KVBM connector it
        was given (its G2 blocks go to G3; no offload can race it once the thread is gone). Idempotent."""
        self._inbox.stop()
        self.runner.begin_close()  # a restart in progress gives up
        self._thread.join()
        self.runner.close()  # after the thread: no step is running
        self.kv_transfer.close()
        if self._connector is not None:
            self._connector.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----

    def _loop(self) -> None:
        inbox, core = self._inbox, self.core
        while True:
            with inbox.lock:
                inbox.wait(lambda: core.has_work() or self._recovery.failed)
                failed = self._recovery.failed and not inbox.stopping
            if failed:  # the executor failed between steps (its monitor saw it)
                self.runner.recover()
            new, aborted, stopping = inbox.take()
            for seq in new:
                core.add(seq)
            for seq in aborted:
                core.finish(seq, "abort")
            if stopping:
                for seq in inbox.unfinished():  # queued, running, or fetching their KV
                    core.finish(seq, "abort")
                return
            try:
                core.step()
            except ExecutorFailure:  # a part of the executor died or hung during the step
                self.runner.recover()
            except Exception as err:  # a bug outside one request's work: fail the running ones, keep serving
                log.exception("engine step failed outside per-request work; failing the running requests")
                core.fail(list(self.scheduler.running), err)

    def _forget(self, request_id: RequestId) -> None:
        """The core finished `request_id` (called on the engine thread before its final output)."""
        self._inbox.forget(request_id)
        self._recovery.forget(request_id)
