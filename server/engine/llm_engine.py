"""The in-process engine: a background thread runs scheduler steps while there is work and sleeps otherwise.

Threads: callers use `submit` / `abort` (any thread); they only touch the inbox under `_cond`. Everything else
(scheduler, block manager, pool, sinks) belongs to the engine thread, which loads the model, then drains the inbox
between steps.

Disaggregated serving (the router decides, server/router/disagg.py): a request with `remote_decode` stops after
its first token and hands its prompt's full KV blocks off (`KVTransfer.send`, on the engine thread: one gather
write); a request with `remote_prefill` resumes from such a handoff: its prompt plus the prefill's tokens, the
detokenizer and a seeded generator brought to where the prefill engine left them, its blocks fetched on the
`kv-fetch` thread before it joins the inbox and read into its pool rows when the scheduler admits it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from tokenizers import Tokenizer

from kvbm.api import KVConnector, KVLayout
from kvbm.block_hash import model_salt, request_salt
from kvbm.connector import block_rows
from kvbm.transfer import KVTransfer
from server.engine import kernels
from server.engine.api import (
    EngineOverloaded,
    EngineResources,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    KVHandoff,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    validate_request,
)
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.detokenizer import Detokenizer
from server.engine.loader import ModelFiles, load_config, load_weights, prepare_model
from server.engine.model import LlamaModel, ModelShape
from server.engine.model_runner import ModelRunner
from server.engine.sampler import Sampler
from server.engine.scheduler import ScheduledChunk, Scheduler
from server.engine.sequence import Sequence as Seq
from server.engine.sequence import SequenceStatus

log = logging.getLogger(__name__)


class LLMEngine:
    """Implements `server.engine.api.LocalEngine`. Build with `LLMEngine(EngineConfig(...))` or
    `LLMEngine.from_json`."""

    def __init__(
        self, config: EngineConfig, connector: KVConnector | None = None, transfer: KVTransfer | None = None
    ) -> None:
        """`transfer`: how prefill handoffs move (default: shared memory on this host).

        The model is loaded on the engine thread, which then runs every step: see `_run`."""
        self.config = config
        self._num_threads = config.num_threads or torch.get_num_threads()
        self._cond = threading.Condition()
        self._inbox: list[Seq] = []
        self._abort_ids: list[RequestId] = []
        self._active: dict[RequestId, Seq] = {}  # guarded by _cond: ids submitted and not yet finished
        self._stopping = False
        self.num_rejected = 0  # submits refused because the wait queue was full
        # fetches handoffs off the caller's and the engine's threads (started with the first one)
        self._fetcher: ThreadPoolExecutor | None = None
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
        """The engine thread: load, then step until closed.

        Every multi-threaded torch op of the engine runs on this one thread. libgomp keeps a team of OpenMP workers
        per host thread that ever ran a parallel region, and once its workers outnumber the cores it stops
        spinning at barriers (`gomp_throttled_spin_count_var`) and sleeps on a futex at each of the thousands of
        barriers a step has. Measured here (2 cores, SmolLM2 bf16): loading on the caller's thread and stepping
        on this one made a batch-1 decode step 47 ms, against 26 ms with both on this thread."""
        torch.set_num_threads(self._num_threads)  # OpenMP thread counts are per calling thread
        try:
            self._load(self.config, connector, transfer)
        except BaseException as err:
            self._load_error = err
            self._loaded.set()
            return
        self._loaded.set()
        self._loop()

    def _load(self, config: EngineConfig, connector: KVConnector | None, transfer: KVTransfer | None) -> None:
        started = time.monotonic()
        self.files: ModelFiles = prepare_model(config.model, config.cache_dir and _path(config.cache_dir))
        hf_config = load_config(self.files)
        shape = ModelShape.from_config(hf_config)
        dtype = config.torch_dtype  # `auto` resolved once, for this machine
        dtype_name = str(dtype).removeprefix("torch.")
        compiled = None
        if config.torch_device == "cpu" and (
            config.paged_kernel or config.fused_ops or config.prefill_kernel or config.linear_kernel
        ):
            compiled = kernels.cpu_kernels()
        self.model = LlamaModel(
            shape,
            load_weights(self.files),
            dtype,
            config.torch_device,
            config.pack_weights,
            decode_kernel=compiled if config.paged_kernel else None,
            fused_ops=compiled if config.fused_ops else None,
            prefill_kernel=compiled if config.prefill_kernel else None,
            linear_kernel=compiled if config.linear_kernel else None,
        )
        self.tokenizer = Tokenizer.from_file(str(self.files.folder / "tokenizer.json"))
        self._chat_tokenizer = None
        self.model_name = config.model_name or self.files.name
        self.max_model_len = min(config.max_model_len, shape.max_position_embeddings)
        self.max_tokens_limit = min(
            config.max_tokens_limit, self.max_model_len
        )  # largest max_tokens accepted
        self.layout = KVLayout(
            fingerprint=f"{self.files.name}|{dtype_name}|bs{config.block_size}"
            f"|l{shape.num_layers}h{shape.num_kv_heads}d{shape.head_dim}",
            num_layers=shape.num_layers, block_size=config.block_size, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, dtype=dtype,
        )  # fmt: skip
        num_blocks = config.num_kv_blocks or max(2, config.kv_cache_bytes // self.layout.block_bytes)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, connector)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_concurrent_requests
        )
        self.eos_token_ids = _eos_ids(hf_config)
        self.sampler = Sampler(self.eos_token_ids, self.model.device)
        self.salt = model_salt(self.layout.fingerprint)
        self.block_layout = KVBlockLayout(config.block_size, self.salt)
        self.resources = EngineResources(
            device=config.torch_device, num_threads=self._num_threads,
            max_concurrent_requests=config.max_concurrent_requests, kv_capacity_blocks=num_blocks,
            kv_capacity_bytes=num_blocks * self.layout.block_bytes,
        )  # fmt: skip
        self._connector = connector
        if connector is not None:
            connector.bind(self.runner.kv_cache, self.layout)
        self.transfer = transfer or KVTransfer()
        # handoffs read and write pool rows as host memory (a device pool would need a staging buffer)
        if self.runner.kv_cache.device.type == "cpu":
            self.block_manager.rows = block_rows(self.runner.kv_cache, num_blocks)
        log.info(
            "engine %s ready in %.2f s: %d KV blocks of %d tokens on %s (%s)",
            self.model_name,
            time.monotonic() - started,
            num_blocks,
            config.block_size,
            self.model.device,
            dtype_name + (" (auto)" if config.dtype == "auto" else ""),
        )

    @classmethod
    def from_json(cls, path: str, connector: KVConnector | None = None) -> LLMEngine:
        """Build from a `model_repository/<model>/1/model.json`."""
        return cls(EngineConfig.from_json(path), connector)

    # ---- caller side (any thread) ----

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt must not stall the worker's heartbeats
        return self.tokenizer.encode_batch([text])[0].ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ending with the assistant prompt."""
        if self._chat_tokenizer is None:
            from transformers import AutoTokenizer

            self._chat_tokenizer = AutoTokenizer.from_pretrained(self.files.folder, local_files_only=True)
        rendered = self._chat_tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
        return self._chat_tokenizer.encode(rendered, add_special_tokens=False)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self._validate(request)
        params = request.sampling
        handoff = request.remote_prefill
        resumed = handoff.token_ids if handoff is not None else []
        seq = Seq(
            request_id=request.request_id, token_ids=[*request.prompt_token_ids, *resumed],
            num_prompt_tokens=len(request.prompt_token_ids), sampling=params, sink=sink,
            detokenizer=Detokenizer(self.tokenizer, params.stop), block_size=self.config.block_size,
            salt=request_salt(self.salt, request.cache_salt), generator=_generator(params.seed, self.model.device),
        )  # fmt: skip
        if request.remote_decode is not None:
            seq.remote_decode_host = request.remote_decode.decode_host
        if handoff is not None:
            self._resume(seq, handoff)
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            if request.request_id in self._active:
                raise RequestError("request_id", f"{request.request_id!r} is already running")
            queued = len(self._inbox) + len(self.scheduler.waiting)  # the deque's len is safe from any thread
            if queued >= self.config.max_queued_requests:
                self.num_rejected += 1
                raise EngineOverloaded(
                    f"{self.model_name}: {queued} requests are waiting (max_queued_requests); retry later"
                )
            self._active[request.request_id] = seq
            # "kvbm": the blocks are in the KVBM tiers, found by the connector at admission
            if handoff is not None and handoff.transport not in ("none", "kvbm"):
                self._fetch_later(seq, handoff)
            else:
                self._inbox.append(seq)
                self._cond.notify()

    def _resume(self, seq: Seq, handoff: KVHandoff) -> None:
        """Bring a decode-side sequence to where its prefill engine left it: the prefill's tokens already reported,
        its detokenizer holding back what the prefill's held back, a seeded generator past the prefill's draws."""
        seq.num_reported_tokens = len(handoff.token_ids)
        seq.num_cached_tokens = handoff.num_cached_tokens
        for token_id in handoff.token_ids:
            seq.detokenizer.add_token(token_id)
        seq.detokenizer.take_text(finished=False)
        if seq.generator is not None and seq.sampling.temperature > 0:
            draw = torch.empty(self.model.shape.vocab_size, device=self.model.device)
            for _ in handoff.token_ids:  # the sampler draws one vocab-sized row of noise per token
                draw.exponential_(generator=seq.generator)

    def _fetch_later(self, seq: Seq, handoff: KVHandoff) -> None:
        """Open `seq`'s handoff on the fetch thread, then queue `seq` (a failed fetch queues it to recompute).
        Called under `_cond`."""
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-fetch")

        def fetch() -> None:
            source = None
            if handoff.block_hashes == seq.block_hashes[: len(handoff.block_hashes)]:
                try:
                    source = self.transfer.fetch(
                        handoff.transport, handoff.location, handoff.block_hashes, handoff.block_bytes
                    )
                except Exception as err:
                    log.warning("request %s: KV handoff not read (%s); recomputing", seq.request_id, err)
            else:
                log.warning("request %s: KV handoff of another block layout; recomputing", seq.request_id)
            with self._cond:
                if seq.status is SequenceStatus.FINISHED or self._stopping:  # aborted meanwhile
                    if source is not None:
                        source.release()
                    return
                seq.kv_source = source
                self._inbox.append(seq)
                self._cond.notify()

        self._fetcher.submit(fetch)

    def _validate(self, request: GenerationRequest) -> None:
        prompt = request.prompt_token_ids
        vocab = self.model.shape.vocab_size
        validate_request(self, request, vocab)
        handoff = request.remote_prefill
        if handoff is not None and (
            len(handoff.token_ids) >= request.sampling.max_tokens
            or not all(0 <= t < vocab for t in handoff.token_ids)
        ):
            raise RequestError("remote_prefill", "token_ids must be fewer than max_tokens, in the vocabulary")
        pool_tokens = self.block_manager.num_blocks * self.config.block_size
        if len(prompt) + 1 > pool_tokens:
            raise RequestError(
                "prompt", f"{len(prompt)} tokens do not fit the KV pool ({pool_tokens} tokens)"
            )
        if min(len(prompt) + request.sampling.max_tokens, self.max_model_len) > pool_tokens:
            raise RequestError(
                "max_tokens", f"prompt + max_tokens must fit the KV pool ({pool_tokens} tokens)"
            )

    def abort(self, request_id: RequestId) -> None:
        with self._cond:
            if request_id in self._active:
                self._abort_ids.append(request_id)
                self._cond.notify()

    def stats(self) -> PoolStats:
        """A snapshot (read without locking: counts may be one step stale)."""
        manager = self.block_manager
        return PoolStats(
            manager.num_blocks,
            manager.num_free_blocks,
            manager.num_cached_blocks,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.scheduler.num_preemptions,
        )

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
        self._thread.join()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        self.transfer.close()
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
                while not (self._inbox or self._abort_ids or self._stopping or self.scheduler.has_work()):
                    self._cond.wait()
                new, self._inbox = self._inbox, []
                aborts, self._abort_ids = self._abort_ids, []
                stopping = self._stopping
            for seq in new:
                self.scheduler.add(seq)
            for request_id in aborts:
                self._abort(request_id)
            if stopping:
                with self._cond:
                    unfinished = list(self._active.values())  # queued, running, or fetching their KV
                for seq in unfinished:
                    self._finish(seq, "abort")
                return
            try:
                self._step()
            except Exception as err:  # a fault outside any one sequence's work: fail them all, keep serving
                log.exception("engine step failed outside per-request work; failing every queued request")
                self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), err)

    def _abort(self, request_id: RequestId) -> None:
        seq = self._active.get(request_id)
        if seq is not None and seq.status is not SequenceStatus.FINISHED:
            self._finish(seq, "abort")

    @torch.inference_mode()
    def _step(self) -> None:
        """One scheduler step. A fault is contained to the requests it belongs to: a batched forward or sampler
        that raises is retried one sequence at a time (rewriting a KV slot with the same values is harmless), and
        per-sequence work (block registration, stop checks, detokenizing, the sink) fails only its own request."""
        try:
            chunks = self.scheduler.schedule()
        except Exception as err:
            # a failure while scheduling names no sequence: fail every queued request rather than spin on it
            log.exception("engine scheduling failed; failing every queued request")
            self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), err)
            return
        if not chunks:
            return
        try:
            logits = self.runner.run(chunks)
        except Exception as err:
            if len(chunks) == 1:
                log.exception("engine step failed for request %s", chunks[0].seq.request_id)
                self._fail([chunks[0].seq], err)
                return
            log.warning(
                "batched step of %d sequences failed (%r); retrying them one by one", len(chunks), err
            )
            for chunk in chunks:
                self._step_alone(chunk)
            return
        self._postprocess(chunks, logits)

    def _step_alone(self, chunk: ScheduledChunk) -> None:
        try:
            logits = self.runner.run([chunk])
        except Exception as err:
            log.exception("engine step failed for request %s", chunk.seq.request_id)
            self._fail([chunk.seq], err)
            return
        self._postprocess([chunk], logits)

    def _postprocess(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        sampling: list[Seq] = []
        rows: list[
            int
        ] = []  # each sampling sequence's row of `logits` (one row per chunk that ends its prompt)
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            ends = seq.num_computed_tokens + chunk.num_tokens == seq.num_tokens
            try:
                seq.num_computed_tokens += chunk.num_tokens
                self.block_manager.register_full_blocks(seq)
            except Exception as err:
                log.exception("registering the blocks of request %s failed", seq.request_id)
                self._fail([seq], err)
            else:
                if ends:
                    sampling.append(seq)
                    rows.append(row)
            row += ends
        if not sampling:
            return
        if len(rows) < row:
            logits = logits[rows]
        try:
            token_ids = self.sampler(logits, sampling)
        except Exception as err:
            if len(sampling) == 1:
                log.exception("sampling failed for request %s", sampling[0].request_id)
                self._fail(sampling, err)
                return
            log.warning(
                "batched sampling of %d sequences failed (%r); sampling them one by one", len(sampling), err
            )
            token_ids = [self._sample_alone(seq, logits[i : i + 1]) for i, seq in enumerate(sampling)]
        for seq, token_id in zip(sampling, token_ids, strict=True):
            if token_id is None:
                continue
            try:
                seq.append_token(token_id)
                reason = self._check_stop(seq, token_id)
            except Exception as err:
                log.exception("stop check failed for request %s", seq.request_id)
                self._fail([seq], err)
                continue
            if reason:
                self._finish(seq, reason)
            elif seq.remote_decode_host is not None:
                self._hand_off(seq)
            else:
                self._emit(seq, finished=False)

    def _hand_off(self, seq: Seq) -> None:
        """A prefill-only request has its first token: send its prompt's full blocks toward the decode worker and
        finish it here with the handoff (a failed send hands off nothing: the decode worker recomputes)."""
        num_blocks = seq.num_prompt_tokens // self.config.block_size  # computed and registered
        hashes = seq.block_hashes[:num_blocks]
        rows = self.block_manager.rows
        started, transport, location = time.perf_counter(), "none", ""
        if num_blocks and rows is not None:
            try:
                transport, location = self.transfer.send(
                    seq.remote_decode_host, hashes, [rows[b] for b in seq.block_table[:num_blocks]]
                )
            except Exception:
                log.exception(
                    "request %s: sending its KV failed; the decode worker recomputes", seq.request_id
                )
        if transport == "none" and num_blocks and self._connector is not None:
            # no transport reaches the decode worker: through this worker's KVBM tiers (G2 on this node, G4 for
            # every node with write-through), where the decode worker's connector finds them at admission
            try:
                self._connector.offload(hashes, seq.block_table[:num_blocks])
                transport = "kvbm"
            except Exception:
                log.exception(
                    "request %s: offloading its KV failed; the decode worker recomputes", seq.request_id
                )
        sent = (
            time.perf_counter() - started,
            num_blocks * self.layout.block_bytes if transport != "none" else 0,
        )
        handoff = KVHandoff(
            transport, location, list(hashes), self.layout.block_bytes, seq.output_token_ids,
            seq.num_cached_tokens,
        )  # fmt: skip
        self.scheduler.remove(seq)
        with self._cond:
            self._active.pop(seq.request_id, None)
        self._emit(seq, finished=True, handoff=handoff, transfer=sent)

    def _sample_alone(self, seq: Seq, logits: torch.Tensor) -> int | None:
        try:
            return self.sampler(logits, [seq])[0]
        except Exception as err:
            log.exception("sampling failed for request %s", seq.request_id)
            self._fail([seq], err)
            return None

    def _fail(self, seqs: list[Seq], err: Exception) -> None:
        """Finish `seqs` with finish_reason "error"; their clients see the exception's type and message."""
        reason = f"internal engine error: {type(err).__name__}: {err}"[:500]
        for seq in seqs:
            self._finish(seq, "error", error=reason)

    def _check_stop(self, seq: Seq, token_id: int) -> str | None:
        params = seq.sampling
        if seq.num_output_tokens > params.min_tokens - 1 and (
            token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            return "stop"
        if seq.detokenizer.add_token(token_id):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _emit(
        self,
        seq: Seq,
        finished: bool,
        reason: str | None = None,
        error: str | None = None,
        handoff: KVHandoff | None = None,
        transfer: tuple[float, int] | None = None,
    ) -> None:
        """Send what `seq` added since its last output. A handoff output is finished without a reason, its text
        what an unfinished output would carry (the decode engine holds back the rest)."""
        new_ids = seq.output_token_ids[seq.num_reported_tokens :]
        if transfer is None and seq.kv_received is not None:
            transfer, seq.kv_received = seq.kv_received, None
        try:
            text = seq.detokenizer.take_text(finished and handoff is None)
        except Exception as err:
            log.exception("detokenizing request %s failed", seq.request_id)
            if not finished:
                self._fail([seq], err)  # emits the finish, whose text is then ""
                return
            text = ""
        if not (new_ids or text or finished):
            return
        seq.num_reported_tokens = seq.num_output_tokens
        output = GenerationOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=text, finished=finished,
            finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, error=error, kv_handoff=handoff,
            kv_transfer_us=round(transfer[0] * 1e6) if transfer else 0, kv_transfer_bytes=transfer[1] if transfer else 0,
        )  # fmt: skip
        try:
            seq.sink(output)
        except Exception:
            log.exception("sink of request %s failed; aborting it", seq.request_id)
            if not finished:
                self._finish(seq, "abort")

    def _finish(self, seq: Seq, reason: str, error: str | None = None) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.remove(seq)
        with self._cond:
            self._active.pop(seq.request_id, None)
        self._emit(seq, finished=True, reason=reason, error=error)


def _eos_ids(hf_config: dict) -> list[int]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator


def _path(value: str):
    from pathlib import Path

    return Path(value).expanduser()
