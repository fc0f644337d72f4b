"""`VLLMEngine`: Strata's Engine protocol over vLLM's `AsyncLLM`, run in a worker process of the vLLM venv.

One asyncio loop on its own thread owns the AsyncLLM (vLLM's engine core runs in a child process of it); `submit`
and `abort` hand work to that loop and return at once, and each request's outputs reach its sink from the loop, as
deltas (`RequestOutputKind.DELTA`): the tokens and text one step added, with vLLM's finish reason and
`num_cached_tokens`. vLLM detokenizes and applies stop strings itself.

Strata sets two things on every engine: KV cache events on a ZMQ socket of its own (`kv_events.py` turns them into
tier events with Strata's block hashes, for the router's index) and a stat logger whose scheduler stats become
`stats()`; with KVBM tiers, also `kv_transfer_config` for `connector.py`'s StrataKVConnector, whose tier events the
same relay forwards. The relay publishes to `events` (the link to the server's index) or, given none and a Redis URL
in the KVBM config, to the standalone KVBM service's stream under this worker's lease, as Strata's engine does.
Everything else is the model.json's engine arguments, checked here against the installed vLLM.

Disaggregated serving hands KV over through the KVBM tiers (the request's `kv_transfer_params`, see
kvbm/transfer_params.py): a request with `RemoteDecode` params runs for one token and finishes with a `KVHandoff`
(transport "kvbm") naming its prompt's full blocks, which StrataKVConnector wrote through to the tiers in the
steps that computed them; a request with `KVHandoff` params runs its prompt plus the prefill's
token, and the decode worker's connector loads those blocks (from the node's G2, or G4) where vLLM would prefill
them. Unlike Strata's engine, a seeded sampler restarts on the decode worker (vLLM takes no generator state).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from cluster.redis_link import RedisLink
from kvbm.block_hash import block_hashes, model_salt, request_salt
from kvbm.channel import RedisWorkerChannel
from kvbm.config import KVBMConfig
from kvbm.events import EventSink
from kvbm.transfer_params import (
    KVHandoff,
    KVReceived,
    RemoteDecode,
    decode_transfer_params,
    encode_transfer_params,
    request_params,
)
from server.engine import chat
from server.engine.api import (
    EngineOverloaded,
    EngineResources,
    GenerationOutput,
    GenerationRequest,
    KVBlockLayout,
    OutputSink,
    PoolStats,
    RequestError,
    RequestId,
    SamplingParams,
    TokenLogprobs,
    continuation,
    shard_layout,
    validate_request,
)
from server.engine.request_trace import RequestTrace
from server.vllm_engine.config import VLLMParallel
from server.vllm_engine.connector import BLOCK_KEY_ENV, ConnectorSettings, engine_fingerprint
from server.vllm_engine.kv_events import KVEventRelay

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
_START_TIMEOUT_S = 600.0


class VLLMEngine:
    """Implements `server.engine.api.LocalEngine` with vLLM's engine."""

    def __init__(
        self,
        engine_args: Mapping[str, Any],
        source: str = "model.json",
        model_name: str | None = None,
        worker_id: str = "vllm-0",
        events: EventSink | None = None,
        max_queued_requests: int = 256,
        kvbm: KVBMConfig | None = None,
    ) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(
                f"{source}: {unknown[0]!r} is not a vLLM engine argument (vLLM {_vllm_version()})"
            )
        self._redis_events: RedisWorkerChannel | None = None
        if events is None and kvbm is not None and kvbm.redis_url:  # the standalone KVBM service's stream
            self._redis_events = RedisWorkerChannel(RedisLink(kvbm.redis_url), worker_id)
            events = self._redis_events
        endpoint = f"ipc://{tempfile.gettempdir()}/strata-kv-{uuid.uuid4().hex[:12]}"
        self._endpoint = endpoint  # vLLM's KV events
        self._tier_endpoint = f"{endpoint}-tiers" if kvbm is not None and events is not None else None
        self._connector = _connector_config(kvbm, worker_id, endpoint, self._tier_endpoint, engine_args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._tasks: dict[RequestId, asyncio.Task[None]] = {}  # touched on the loop only
        self._num_active = 0  # submitted and not finished (any thread reads it; the lock guards it)
        self._lock = threading.Lock()
        self._closed = False
        self._scheduler = _SchedulerStats()
        future = asyncio.run_coroutine_threadsafe(self._build(dict(engine_args), source), self._loop)
        try:
            self._llm, self._args = future.result(_START_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            if self._redis_events is not None:
                self._redis_events.close()
            raise
        vllm_config = self._llm.vllm_config
        cache = vllm_config.cache_config
        self.model_name = model_name or vllm_config.model_config.served_model_name or str(self._args.model)
        self.chat_template: str | None = None  # model.json's or --chat-template; None: the model's own
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_tokens_limit = self.max_model_len
        self._vocab = int(vllm_config.model_config.get_vocab_size())
        parallel = VLLMParallel.of(engine_args)
        self.shard_layout = shard_layout(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self._num_blocks = int(cache.num_gpu_blocks or 0)
        self._max_running = int(vllm_config.scheduler_config.max_num_seqs)
        self._by_priority = (
            str(vllm_config.scheduler_config.policy) == "priority"
        )  # engine_args scheduling_policy
        self._max_requests = self._max_running + max_queued_requests
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        salt = model_salt(engine_fingerprint(vllm_config))
        self.block_layout = KVBlockLayout(int(cache.block_size), salt)
        lookup = f"{endpoint}-lookup" if self._tier_endpoint is not None else None
        self._relay = KVEventRelay(
            self._endpoint, worker_id, int(cache.block_size), salt, events, self._tier_endpoint, lookup
        )
        if self._redis_events is not None:
            self._redis_events.on_resync = self.announce  # the service restarted or Redis came back
        self._tokenizer = self._llm.get_tokenizer()
        self._kv_bytes = int(getattr(cache, "kv_cache_memory_bytes", None) or 0)
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self._block_bytes = (  # K and V of every layer, one block (what a handoff names; vLLM's own layout)
            2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
            * int(cache.block_size) * model.dtype.itemsize
        )  # fmt: skip
        logger.info(
            "vLLM %s engine up: %s, %s, %d KV blocks of %d tokens, max_model_len %d",
            _vllm_version(), self._args.model, dtype, self._num_blocks, cache.block_size, self.max_model_len,
        )  # fmt: skip

    async def _build(self, raw: dict[str, Any], source: str) -> tuple[Any, Any]:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        raw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=self._endpoint, topic="kv"
        )
        raw["disable_log_stats"] = False
        if self._connector is not None:
            raw["kv_transfer_config"] = self._connector
            _keep_cpu_layout(raw)
        try:
            args = AsyncEngineArgs(**raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc
        scheduler = self._scheduler
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[lambda config, index=0: _StatLogger(scheduler)])
        return llm, args

    # ---- the Engine protocol ----

    @property
    def healthy(self) -> bool:
        return not self._closed and not self._llm.errored

    @property
    def resources(self) -> EngineResources:
        import torch

        return EngineResources(
            device="cpu" if not torch.cuda.is_available() else "cuda",
            num_threads=torch.get_num_threads(),
            max_concurrent_requests=self._max_running,
            kv_capacity_blocks=self._num_blocks,
            kv_capacity_bytes=self._kv_bytes,
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        rendered = chat.render(self._tokenizer, messages, tools, self.chat_template)
        return list(self._tokenizer.encode(rendered, add_special_tokens=False))

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        self._validate(request)
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is shut down")
            if self._num_active >= self._max_requests:
                raise EngineOverloaded(
                    f"{self.model_name}: {self._num_active} requests are in the vLLM engine; retry later"
                )
            self._num_active += 1
        self._loop.call_soon_threadsafe(self._start, request, sink)

    def abort(self, request_id: RequestId) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def stats(self) -> PoolStats:
        scheduler = self._scheduler
        used = round(scheduler.kv_cache_usage * self._num_blocks)
        return PoolStats(
            self._num_blocks,
            self._num_blocks - used,
            self._relay.num_cached_blocks,
            scheduler.num_running,
            scheduler.num_waiting,
            scheduler.num_preemptions,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        asyncio.run_coroutine_threadsafe(self._abort_all(), self._loop).result(30)
        self._llm.shutdown()
        self._relay.close()
        if self._redis_events is not None:
            self._redis_events.close()
        self._stop_loop()

    def announce(self) -> None:
        """Thread-safe: publish every block this engine holds (G1 and its KV tiers) again, for an index that
        missed them (a server that just attached this worker, a KVBM service that restarted)."""
        self._relay.announce()

    # ---- on the loop ----

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(self, request, self._vocab)
        try:
            params = request_params(request.kv_transfer_params, request.sampling.max_tokens, self._vocab)
        except ValueError as err:
            raise RequestError("kv_transfer_params", str(err)) from None
        if request.priority != 0 and not self._by_priority:
            raise RequestError(
                "priority",
                "must be 0: this vLLM engine's scheduling_policy is fcfs (engine_args scheduling_policy)",
            )
        grammar = request.sampling.structured_outputs
        if grammar is not None and (grammar.num_generated or isinstance(params, KVHandoff)):
            # vLLM's grammar would start again on tokens generated under it: refused, never a broken output
            raise RequestError(
                grammar.field,
                "backend vllm cannot resume a grammar part way (a migrated or handed-off request)",
            )

    def _start(self, request: GenerationRequest, sink: OutputSink) -> None:
        task = self._loop.create_task(self._generate(request, sink))
        self._tasks[request.request_id] = task

    def _cancel(self, request_id: RequestId) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _abort_all(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=10)

    async def _generate(self, request: GenerationRequest, sink: OutputSink) -> None:
        rid = request.request_id
        num_prompt = len(request.prompt_token_ids)
        params = decode_transfer_params(request.kv_transfer_params)  # checked at submit
        handoff = params if isinstance(params, KVHandoff) else None
        resumed = handoff.token_ids if handoff is not None else []  # decode side: the prefill's first token
        rest = continuation(request, resumed)  # the request itself unless it resumes a handoff
        sampling = rest.sampling
        emitted = len(resumed)
        cached = 0
        prefill_only = isinstance(params, RemoteDecode) and sampling.max_tokens > 1
        if prefill_only:
            sampling = msgspec.structs.replace(sampling, max_tokens=1)
        first = True
        trace = RequestTrace.start(request.trace_context, rid, num_prompt, "vllm", queue=False)
        prompt: dict[str, Any] = {"prompt_token_ids": rest.prompt_token_ids}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        try:
            async for out in self._llm.generate(prompt, _sampling(sampling), rid, priority=request.priority):
                completion = out.outputs[0]
                emitted += len(completion.token_ids)
                cached = handoff.num_cached_tokens if handoff is not None else out.num_cached_tokens or 0
                reason = completion.finish_reason if out.finished else None
                output = GenerationOutput(
                    rid, list(completion.token_ids), completion.text, finished=out.finished,
                    finish_reason=_FINISH_REASONS.get(reason, "stop") if out.finished else None,  # type: ignore[arg-type]
                    num_prompt_tokens=num_prompt, num_cached_tokens=cached, num_output_tokens=emitted,
                )  # fmt: skip
                if sampling.logprobs is not None and completion.logprobs is not None:
                    output.logprobs = [
                        _token_logprobs(token_id, entries, sampling.logprobs)
                        for token_id, entries in zip(completion.token_ids, completion.logprobs, strict=False)
                    ]
                if first and sampling.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    output.prompt_logprobs = [
                        None
                        if entries is None
                        else _token_logprobs(token_id, entries, sampling.prompt_logprobs)
                        for token_id, entries in zip(rest.prompt_token_ids, out.prompt_logprobs, strict=False)
                    ]
                if prefill_only and out.finished and reason == "length":  # not a stop: decode continues it
                    output.finish_reason = None
                    handoff_out = self._handoff(request, list(completion.token_ids), cached)
                    output.kv_transfer_params = encode_transfer_params(handoff_out)
                elif resumed and first:  # the prompt blocks this worker did not compute (its G1, the tiers)
                    reused = (out.num_cached_tokens or 0) // self.block_layout.block_size
                    output.kv_transfer_params = encode_transfer_params(
                        KVReceived(0, reused * self._block_bytes)
                    )
                if trace is not None:
                    trace.observe(output)
                first = False
                sink(output)
                if out.finished:
                    break
        except asyncio.CancelledError:
            sink(_final(rid, "abort", num_prompt, cached, emitted))
        except Exception as exc:
            dead = self._llm.errored  # the engine core died: the request did not fail, a router may resume it
            logger.error("request %s failed in vLLM: %s: %s", rid, type(exc).__name__, exc, exc_info=not dead)
            failed = _final(
                rid, "error", num_prompt, cached, emitted, f"{type(exc).__name__} in the vLLM engine"
            )
            failed.retryable = dead
            if trace is not None:
                trace.end("error", emitted, failed.error)
            sink(failed)
        finally:
            if trace is not None:  # ended by its finished output, else here (aborted, failed)
                trace.end("abort", emitted)
            self._tasks.pop(rid, None)
            with self._lock:
                self._num_active -= 1

    def _handoff(self, request: GenerationRequest, token_ids: list[int], cached: int) -> KVHandoff:
        """The prompt's full blocks are in this worker's KV tiers already (StrataKVConnector writes each block
        through in the step that computes it, before that step's output exists): the decode worker's connector
        finds them there (G2 on this node, G4 across nodes). Without tiers it recomputes the prompt."""
        layout = self.block_layout
        hashes = block_hashes(
            request.prompt_token_ids, layout.block_size, request_salt(layout.salt, request.cache_salt)
        )
        transport = "kvbm" if self._connector is not None and hashes else "none"
        sent = len(hashes) * self._block_bytes if transport == "kvbm" else 0  # written through: no send time
        return KVHandoff(transport, "", list(hashes), self._block_bytes, token_ids, cached, sent_bytes=sent)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _keep_cpu_layout(raw: Mapping[str, Any]) -> None:
    """Attaching StrataKVConnector leaves vLLM's CPU thread layout as it is without a connector.

    vLLM 0.32's CPU auto-binding (vllm/utils/ompmultiprocessing.py, lines 43-54) reserves one core per rank for
    the scheduler process, and one more per rank whenever any kv_transfer_config is set (meant for NIXL's transfer
    threads in prefill/decode). StrataKVConnector copies on vLLM's own threads, so here the reservation stays the
    connector-less one. Where reserving two cores leaves none (2 cores), vLLM silently reserves nothing, so
    without this a connector would change how many cores the engine computes on. An operator's
    VLLM_CPU_NUM_OF_RESERVED_CPU or VLLM_CPU_OMP_THREADS_BIND wins."""
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return
    ranks = VLLMParallel.of(raw).world_size
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(ranks)  # read by vLLM's worker processes, started next


def _connector_config(
    kvbm: KVBMConfig | None, worker_id: str, endpoint: str, tier_endpoint: str | None, args: Mapping[str, Any]
) -> Any:
    """vLLM's kv_transfer_config for StrataKVConnector (None: no KVBM, or the model.json names its own connector,
    which then wins)."""
    from vllm.config import KVTransferConfig

    if kvbm is None:
        return None
    ranks = VLLMParallel.of(args).world_size
    if ranks > 1:  # each rank's worker half would store its part of a block under the whole block's key
        logger.warning(
            "%s: Strata's KV tiers are not attached to a vLLM engine of %d ranks (StrataKVConnector holds whole "
            "blocks); vLLM's own prefix cache serves it", worker_id, ranks,
        )  # fmt: skip
        return None
    if "kv_transfer_config" in args:
        logger.info("%s: model.json sets kv_transfer_config; Strata's KV tiers are not attached", worker_id)
        return None
    values = kvbm.to_json()
    key = values.pop("block_key")
    if key:
        os.environ[BLOCK_KEY_ENV] = str(key)  # inherited by vLLM's engine core and worker processes
    settings = ConnectorSettings(values, worker_id, f"{endpoint}-lookup", tier_endpoint)
    return KVTransferConfig(
        kv_connector="StrataKVConnector", kv_connector_module_path="server.vllm_engine.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"strata": msgspec.to_builtins(settings)},
    )  # fmt: skip


def _final(
    rid: RequestId, reason: str, num_prompt: int, cached: int, emitted: int, error: str | None = None
) -> GenerationOutput:
    return GenerationOutput(
        rid, [], "", finished=True, finish_reason=reason, num_prompt_tokens=num_prompt,  # type: ignore[arg-type]
        num_cached_tokens=cached, num_output_tokens=emitted, error=error,
    )  # fmt: skip


def _sampling(params: SamplingParams) -> Any:
    """Strata's sampling fields (vLLM's names already) as vLLM's SamplingParams, streaming deltas."""
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    structured = None
    if params.structured_outputs is not None:
        grammar = params.structured_outputs
        value: Any = {"json": json.loads(grammar.spec) if grammar.kind == "json" else None}
        if grammar.kind == "json_object":
            value = {"json_object": True}
        elif grammar.kind == "choice":
            value = {"choice": json.loads(grammar.spec)}
        elif grammar.kind in ("regex", "grammar"):
            value = {grammar.kind: grammar.spec}
        structured = StructuredOutputsParams(**value)

    return VLLMSamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=_vllm_seed(params.seed), stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias) or None,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs, skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output, structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip


def _token_logprobs(token_id: int, entries: Mapping[int, Any], count: int) -> TokenLogprobs:
    """vLLM's logprobs of one position ({token id: Logprob(logprob, rank, decoded_token)}: the top `count` by
    rank, and the chosen token wherever it ranks) as Strata's."""
    top = sorted(
        (entry.rank, tid) for tid, entry in entries.items() if entry.rank is not None and entry.rank <= count
    )
    chosen = entries[token_id]
    return TokenLogprobs(
        token_id, float(chosen.logprob), [tid for _, tid in top], [float(entries[tid].logprob) for _, tid in top],
        chosen.decoded_token or "", [entries[tid].decoded_token or "" for _, tid in top],
    )  # fmt: skip


def _vllm_seed(seed: int | None) -> int | None:
    """Strata takes seeds in [-2^63, 2^64); vLLM's generator takes a signed 64-bit one."""
    if seed is None:
        return None
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


class _SchedulerStats:
    """The last scheduler stats vLLM reported (written on vLLM's output thread, read by the heartbeat)."""

    num_running = 0
    num_waiting = 0
    kv_cache_usage = 0.0
    num_preemptions = 0


class _StatLogger:
    """A vLLM stat logger (duck-typed to StatLoggerBase) that keeps what `stats()` reports."""

    def __init__(self, stats: _SchedulerStats) -> None:
        self._stats = stats

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ):
        if scheduler_stats is not None:
            self._stats.num_running = scheduler_stats.num_running_reqs
            self._stats.num_waiting = scheduler_stats.num_waiting_reqs
            self._stats.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self._stats.num_preemptions += getattr(iteration_stats, "num_preempted_reqs", 0)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def build_vllm_engine(
    engine_args: Mapping[str, Any],
    source: str,
    model_name: str | None,
    max_queued_requests: int = 256,
    kvbm: dict[str, Any] | None = None,
    chat_template: str | None = None,
    *,
    worker_id: str,
    events: EventSink | None,
) -> VLLMEngine:
    """The worker's factory for `engine: "vllm"` (server/workers/external.py); `kvbm` is KVBMConfig.to_json()."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from a local folder; nothing is downloaded
    config = KVBMConfig.from_json(kvbm) if kvbm is not None else None
    engine = VLLMEngine(engine_args, source, model_name, worker_id, events, max_queued_requests, config)
    engine.chat_template = chat_template
    return engine
