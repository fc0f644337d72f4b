"""The in-process engine: a background thread runs the engine core's steps while there is work and sleeps
otherwise.

Threads: callers use `submit` / `abort` (any thread); they only touch the inbox under `_cond`. Everything else
(the core: scheduler, block manager, pool, sinks) belongs to the engine thread, which builds the engine
(server/engine/builder.py), then drains the inbox between steps (`EngineCore.step`, server/engine/core.py).
Disaggregated prefill/decode is the core's KV transfer connector (server/engine/kv_transfer.py): at submit its
scheduler half prepares a handed-off request, and fetches a resumed one's blocks before it joins the inbox.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from kvbm.api import KVConnector
from kvbm.block_hash import request_salt
from kvbm.transfer import KVTransfer
from kvbm.transfer_params import KVHandoff, RemoteDecode
from server.engine import chat
from server.engine.api import (
    EngineOverloaded,
    EngineUnavailable,
    GenerationRequest,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    validate_request,
)
from server.engine.builder import EngineParts, Sharding, build
from server.engine.config import EngineConfig
from server.engine.core import ExecutorFailure
from server.engine.detokenizer import Detokenizer
from server.engine.parallel.executor import ShardedExecutor
from server.engine.parallel.group import GroupFailure
from server.engine.parallel.plan import usable_cores
from server.engine.sequence import Sequence as Seq

log = logging.getLogger(__name__)

RankFailurePolicy = Literal["resume", "migrate"]
GroupState = Literal["up", "failed", "restarting", "down"]  # a sharded engine's ranks; always "up" unsharded


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
        """`transfer`: how prefill handoffs move (default: shared memory on this host).

        A sharded engine (tensor_parallel_size or pipeline_parallel_size above 1) whose group loses a rank ends
        its requests as retryable errors for its router to resume elsewhere (`on_rank_failure` "migrate": a worker
        process among others), or requeues them for the restarted group ("resume": the only engine of a model,
        each request at most `resume_limit` times). `worker_id` names its ranks' processes.

        The model is loaded on the engine thread, which then runs every step: see `_run`."""
        self.config = config
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self._num_threads = config.num_threads or (
            max(1, usable_cores() // world) if world > 1 else torch.get_num_threads()
        )
        self._sharding = None
        if world > 1:
            self._sharding = Sharding(worker_id, self._on_group_failure)
        self._on_rank_failure = on_rank_failure
        self._resume_limit = resume_limit
        self._resumes: dict[RequestId, int] = {}  # requests requeued after a group failure -> how many times
        self._group: GroupState = "up"  # guarded by _cond
        self._cond = threading.Condition()
        self._inbox: list[Seq] = []
        self._abort_ids: list[RequestId] = []
        self._active: dict[RequestId, Seq] = {}  # guarded by _cond: ids submitted and not yet finished
        self._stopping = False
        self.num_rejected = 0  # submits refused because the wait queue was full
        self._connector = connector
        self._chat_tokenizer = None
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
            self._take(
                build(self.config, self._num_threads, connector, transfer, self._forget, self._sharding)
            )
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
        if self._chat_tokenizer is None:
            from transformers import AutoTokenizer

            self._chat_tokenizer = AutoTokenizer.from_pretrained(self.files.folder, local_files_only=True)
        rendered = chat.render(self._chat_tokenizer, messages, tools, self.config.chat_template)
        return self._chat_tokenizer.encode(rendered, add_special_tokens=False)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        params = self._validate(request)
        resumed = params.token_ids if isinstance(params, KVHandoff) else []  # a prefill engine's first token
        sampling = request.sampling
        seq = Seq(
            request_id=request.request_id, token_ids=[*request.prompt_token_ids, *resumed],
            num_prompt_tokens=len(request.prompt_token_ids), sampling=sampling, sink=sink,
            detokenizer=Detokenizer(
                self.tokenizer, sampling.stop, sampling.skip_special_tokens, sampling.include_stop_str_in_output
            ),
            block_size=self.config.block_size,
            salt=request_salt(self.salt, request.cache_salt), generator=_generator(sampling.seed, self.model.device),
        )  # fmt: skip
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            self.core.outputs.token_texts()  # built here, on the caller's thread, the first time
        structured = sampling.structured_outputs
        if structured is not None:  # compiled here, on the caller's thread: a new grammar never stalls a step
            generated = request.prompt_token_ids[len(request.prompt_token_ids) - structured.num_generated :]
            seq.grammar = self.parts.grammars.matcher(structured, [*generated, *resumed])
        self.kv_transfer.prepare(seq, params)
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            self._check_group()
            if request.request_id in self._active:
                raise RequestError("request_id", f"{request.request_id!r} is already running")
            queued = len(self._inbox) + len(self.scheduler.waiting)  # the deque's len is safe from any thread
            if queued >= self.config.max_queued_requests:
                self.num_rejected += 1
                raise EngineOverloaded(
                    f"{self.model_name}: {queued} requests are waiting (max_queued_requests); retry later"
                )
            self._active[request.request_id] = seq
            if self.kv_transfer.needs_fetch(params):
                self.kv_transfer.fetch_then(seq, params, self._enqueue_fetched)
            else:
                self._inbox.append(seq)
                self._cond.notify()

    def _enqueue_fetched(self, seq: Seq) -> bool:
        """Queue a sequence whose handoff was fetched (the fetch thread); False if it ended meanwhile."""
        with self._cond:
            if self._stopping or seq.request_id not in self._active:
                return False
            self._inbox.append(seq)
            self._cond.notify()
            return True

    def _validate(self, request: GenerationRequest) -> RemoteDecode | KVHandoff | None:
        """Raise RequestError for a request that can never run; return its KV transfer params."""
        prompt = request.prompt_token_ids
        validate_request(self, request, self.model.shape.vocab_size)
        params = self.kv_transfer.validate(request)
        pool_tokens = self.block_manager.num_blocks * self.config.block_size
        if len(prompt) + 1 > pool_tokens:
            raise RequestError(
                "prompt", f"{len(prompt)} tokens do not fit the KV pool ({pool_tokens} tokens)"
            )
        if min(len(prompt) + request.sampling.max_tokens, self.max_model_len) > pool_tokens:
            raise RequestError(
                "max_tokens", f"prompt + max_tokens must fit the KV pool ({pool_tokens} tokens)"
            )
        return params

    def _check_group(self) -> None:
        """Under `_cond`: refuse a request the group cannot take now (a restarting worker among others is busy:
        its router tries another; a group whose restart failed is unavailable). A restarting group of the only
        engine queues it."""
        if self._group == "down":
            raise EngineUnavailable(f"{self.model_name}: its ranks failed and are restarting; retry later")
        if self._group == "restarting" and self._on_rank_failure == "migrate":
            raise EngineOverloaded(
                f"{self.model_name}: this worker is restarting its ranks", retry_after_s=1.0
            )

    def abort(self, request_id: RequestId) -> None:
        with self._cond:
            if request_id in self._active:
                self._abort_ids.append(request_id)
                self._cond.notify()

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
        if isinstance(self.runner, ShardedExecutor):
            stats.ranks = self.runner.statuses(self._sharding.worker_id)
            stats.restarts = dict(self.runner.restarts)
        return stats

    @property
    def shard_layout(self) -> str:
        """ "tp<T>pp<P>" when sharded (each rank's tiers hold its part of a block), "" otherwise."""
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        return f"tp{tp}pp{pp}" if tp * pp > 1 else ""

    @property
    def healthy(self) -> bool:
        return not self._stopping and self._thread.is_alive()

    def is_idle(self) -> bool:
        """True when no request is queued, running or unfinished."""
        with self._cond:
            return not self._active

    def close(self) -> None:
        """Stop the engine thread (unfinished requests get finish_reason "abort"), then close the KVBM connector it
        was given (its G2 blocks go to G3; no offload can race it once the thread is gone). Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        sharded = isinstance(self.runner, ShardedExecutor)
        if sharded:
            self.runner.group.begin_close()  # a restart in progress gives up
        self._thread.join()
        if sharded:
            self.runner.group.stop()  # after the thread: no step is running; each rank closes its tiers
        self.kv_transfer.close()
        if self._connector is not None:
            self._connector.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine thread ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._inbox or self._abort_ids or self._stopping or self.core.has_work()
                    or self._group == "failed"
                ):  # fmt: skip
                    self._cond.wait()
                failed = self._group == "failed" and not self._stopping
            if failed:  # the group failed between steps (its monitor saw it)
                self._recover()
            with self._cond:
                new, self._inbox = self._inbox, []
                aborts, self._abort_ids = self._abort_ids, []
                stopping = self._stopping
            for seq in new:
                self.core.add(seq)
            for request_id in aborts:
                seq = self._active.get(request_id)
                if seq is not None:
                    self.core.finish(seq, "abort")
            if stopping:
                with self._cond:
                    unfinished = list(self._active.values())  # queued, running, or fetching their KV
                for seq in unfinished:
                    self.core.finish(seq, "abort")
                return
            try:
                self.core.step()
            except ExecutorFailure:  # a rank died or hung during the step
                self._recover()
            except (
                Exception
            ) as err:  # a bug outside any one sequence's work: fail the running batch, keep serving
                log.exception("engine step failed outside per-request work; failing the running requests")
                self.core.fail(list(self.scheduler.running), err)

    def _forget(self, request_id: RequestId) -> None:
        """The core finished `request_id` (called on the engine thread before its final output)."""
        with self._cond:
            self._active.pop(request_id, None)
        self._resumes.pop(request_id, None)

    # ---- a sharded engine's group failure ----

    def _on_group_failure(self, failure: GroupFailure) -> None:
        """From the group's monitor (or the engine thread): wake the engine thread to recover."""
        with self._cond:
            if self._group == "up":
                self._group = "failed"
            self._cond.notify()

    def _recover(self) -> None:
        """The group lost a rank and killed the others; what the pool held is gone. Ends or requeues every
        request (see `__init__`), forgets the prefix cache, and restarts the group with backoff (1 s doubling to
        30 s) until it runs or the engine closes. The cause is counted by reason and logged with the rank."""
        executor = self.runner
        assert isinstance(executor, ShardedExecutor)
        failure = executor.group.failure or GroupFailure(0, "unknown")
        with self._cond:
            self._group = "restarting"
            unfinished = list(self._active.values())
            if self._on_rank_failure == "migrate":
                self._inbox = []
        self._count_restart(executor, failure)
        if self._on_rank_failure == "migrate":
            for seq in unfinished:
                self.core.hand_back(seq, f"the worker's rank group failed ({failure})")
        else:
            self._requeue(failure)
        forgotten = self.block_manager.forget_cached()
        log.error(
            "%s worker %s: %s; %d requests %s, %d cached blocks dropped; restarting the group",
            self.model_name, self._sharding.worker_id, failure, len(unfinished),
            "handed back for migration" if self._on_rank_failure == "migrate" else "requeued", forgotten,
        )  # fmt: skip
        self._restart(executor)

    def _count_restart(self, executor: ShardedExecutor, failure: GroupFailure) -> None:
        reason = _restart_reason(failure)
        executor.restarts[reason] = executor.restarts.get(reason, 0) + 1

    def _requeue(self, failure: GroupFailure) -> None:
        """Running requests wait for the restarted group, each at most `resume_limit` times; past that one ends
        with a retryable error (503 at the frontend)."""
        for seq in self.core.requeue_all():
            resumes = self._resumes.get(seq.request_id, 0) + 1
            self._resumes[seq.request_id] = resumes
            if resumes > self._resume_limit:
                self.core.hand_back(
                    seq,
                    f"{self.model_name}: its rank group failed {resumes} times during this request ({failure})",
                )

    def _restart(self, executor: ShardedExecutor) -> None:
        delay = 1.0
        while True:
            try:
                executor.restart()
            except GroupFailure as again:
                if executor.group.closing:
                    return
                self._count_restart(executor, again)
                log.error("%s: restarting the rank group failed (%s); next try in %.0f s", self.model_name,
                          again, delay)  # fmt: skip
                with self._cond:
                    self._group = "down"
                    waiting, self._inbox = list(self._active.values()), []
                for seq in waiting:  # nothing runs until the group does: none of them waits for it
                    self.core.hand_back(seq, f"{self.model_name}: its rank group is down ({again})")
                with self._cond:
                    if self._cond.wait_for(lambda: self._stopping, timeout=delay):
                        return
                delay = min(2 * delay, 30.0)
                continue
            with self._cond:
                self._group = "up"
            log.info("%s worker %s: rank group running again", self.model_name, self._sharding.worker_id)
            return


def _restart_reason(failure: GroupFailure) -> str:
    """A short label for `strata_worker_restarts_total`: how the rank ended (its signal or exit code), a lost
    heartbeat, a step that failed, or a start that failed."""
    reason = failure.reason
    if reason.startswith("exited on "):
        return reason.removeprefix("exited on ")
    if reason.startswith("exited with code"):
        return "exit_code_" + reason.rsplit(" ", 1)[-1]
    if reason.startswith("no heartbeat"):
        return "heartbeat"
    if reason.startswith(("failed to load", "not ready", "joining")):
        return "start_failed"
    return "step_failed"


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
