"""Assembles an engine from its config: files, weights, kernels, tokenizer, KV pool, scheduler, sampler, core.

`build` runs on the engine thread (see LLMEngine), so the model's OpenMP team is that thread's. Everything the
engine serves with comes back in one `EngineParts`; nothing here runs a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kvbm.api import KVConnector, KVLayout
from kvbm.block_hash import model_salt
from kvbm.connector import KVBMConnector, block_rows
from kvbm.transfer import KVTransfer
from server import tracing
from server.engine import kernels
from server.engine.api import EngineResources, KVBlockLayout, RequestId
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.executor import ExecutorEvent, ModelExecutor
from server.engine.kv_transfer import KVTransferConnector
from server.engine.loader import ModelFiles, load_config, load_weights, open_weights, prepare_model
from server.engine.model import LlamaModel, ModelShape
from server.engine.model_runner import ModelRunner
from server.engine.output_processor import OutputProcessor
from server.engine.parallel.executor import ShardedConnector, ShardedExecutor
from server.engine.parallel.group import GroupSettings, RankGroup, RankSpec, ShmPlan, rank_title
from server.engine.parallel.plan import ShardPlan, check_shardable, local_shape, usable_cores
from server.engine.sampler import LogitBias, MinTokens, Penalties, RepetitionPenalty, Sampler
from server.engine.scheduler import Scheduler
from server.engine.structured import GrammarCompiler, GrammarMask

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """A loaded engine. Lengths in tokens; `layout` keys the KVBM tiers, `block_layout` the router's index."""

    files: ModelFiles
    model: LlamaModel
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    max_tokens_limit: int  # the largest max_tokens accepted (at most max_model_len)
    layout: KVLayout
    block_layout: KVBlockLayout
    salt: int  # the model's block-hash salt (kvbm.block_hash.BlockHash)
    eos_token_ids: list[int]
    resources: EngineResources
    core: EngineCore
    grammars: GrammarCompiler  # structured outputs: a request's grammar, compiled at submit


@dataclass(slots=True)
class Sharding:
    """How a sharded engine's group is run: its worker's id (in rank titles and rank stats), who gets its
    executor's events. An unsharded engine's executor has none to report."""

    worker_id: str
    on_event: Callable[[ExecutorEvent], None]
    settings: GroupSettings = field(default_factory=GroupSettings)


def threads_per_rank(config: EngineConfig) -> int:
    """torch intra-op threads of each rank: the config's num_threads, else this host's usable cores split between
    a sharded worker's ranks (torch's default for one process)."""
    world = config.world_size
    return config.num_threads or (max(1, usable_cores() // world) if world > 1 else torch.get_num_threads())


def build(
    config: EngineConfig,
    num_threads: int,
    connector: KVConnector | None,
    transfer: KVTransfer | None,
    on_finished: Callable[[RequestId], None],
    sharding: Sharding | None = None,
) -> EngineParts:
    """Load the model and assemble the core; `connector` (the KVBM tiers) is bound to the new KV pool. A config
    with tensor_parallel_size or pipeline_parallel_size above 1 starts its other ranks (`sharding` says how; a
    default one if None), loads the driver's part here and steps them together (server/engine/parallel)."""
    started = time.monotonic()
    files = prepare_model(config.model, Path(config.cache_dir).expanduser() if config.cache_dir else None)
    hf_config = load_config(files)
    shape = ModelShape.from_config(hf_config)
    plan = shard_plan(config, shape)
    layout = kv_layout(files, config, shape, plan)
    num_blocks = config.num_kv_blocks or max(2, config.kv_cache_bytes // layout.block_bytes)
    group = None
    if plan is not None:  # the other ranks load while this one does
        sharding = sharding or Sharding(config.model_name or files.name, lambda event: None)
        group = _spawn_ranks(
            config, plan, num_blocks, num_threads, connector, sharding, files.name, shape.hidden_size
        )
    try:
        model = load_model(config, files, shape, plan)
        local = ModelRunner(model, num_blocks, config.block_size)  # this rank's part (all of it unsharded)
        runner: ModelExecutor = local
        if group is not None:
            timeout_s = sharding.settings.collective_timeout_s
            executor = ShardedExecutor(local, group, plan, timeout_s, sharding.worker_id, sharding.on_event)
            executor.start()
            runner = executor
            connector = ShardedConnector(connector, group) if connector is not None else None
    except BaseException:
        if group is not None:
            group.stop()
        raise
    block_manager = BlockManager(num_blocks, config.block_size, connector)
    if (
        group is None and local.kv_cache.device.type == "cpu"
    ):  # handoffs read and write pool rows as host memory
        block_manager.rows = block_rows(local.kv_cache, num_blocks)
    if connector is not None:
        connector.bind(local.kv_cache, layout)
    max_model_len = min(config.max_model_len, shape.max_position_embeddings)
    eos_token_ids = _eos_ids(hf_config)
    kv_transfer = KVTransferConnector(
        transfer or KVTransfer(), block_manager, connector, layout.block_bytes, shape.vocab_size, model.device
    )
    tokenizer = Tokenizer.from_file(str(files.folder / "tokenizer.json"))
    grammars = GrammarCompiler(files.folder / "tokenizer.json", shape.vocab_size, eos_token_ids)
    processors = [
        MinTokens(eos_token_ids),
        LogitBias(),
        RepetitionPenalty(),
        Penalties(),
        GrammarMask(shape.vocab_size),
    ]
    outputs = OutputProcessor(eos_token_ids, max_model_len, partial(token_texts, tokenizer, shape.vocab_size))
    core = EngineCore(
        Scheduler(
            block_manager,
            config.max_num_batched_tokens,
            config.max_concurrent_requests,
            by_priority=config.scheduling_policy == "priority",
        ),
        runner, Sampler(eos_token_ids, model.device, processors), outputs, kv_transfer, on_finished,
    )  # fmt: skip
    salt = model_salt(
        kv_layout(files, config, shape).fingerprint
    )  # the whole model's: the same for any sharding
    parts = EngineParts(
        files=files, model=model, tokenizer=tokenizer,
        model_name=config.model_name or files.name, max_model_len=max_model_len,
        max_tokens_limit=min(config.max_tokens_limit, max_model_len), layout=layout,
        block_layout=KVBlockLayout(config.block_size, salt), salt=salt, eos_token_ids=eos_token_ids,
        resources=EngineResources(
            device=config.torch_device, num_threads=num_threads,
            max_concurrent_requests=config.max_concurrent_requests, kv_capacity_blocks=num_blocks,
            kv_capacity_bytes=num_blocks * layout.block_bytes,
        ),
        core=core, grammars=grammars,
    )  # fmt: skip
    dtype_name = str(model.dtype).removeprefix("torch.") + (" (auto)" if config.dtype == "auto" else "")
    log.info(
        "engine %s ready in %.2f s: %d KV blocks of %d tokens on %s (%s)", parts.model_name,
        time.monotonic() - started, num_blocks, config.block_size, model.device, dtype_name,
    )  # fmt: skip
    return parts


def shard_plan(config: EngineConfig, shape: ModelShape) -> ShardPlan | None:
    """The driver's plan when the config shards the model (None otherwise); ValueError naming the dimension a
    size does not divide; a warning when the ranks outnumber this host's cores or devices."""
    tp, pp, world = config.tensor_parallel_size, config.pipeline_parallel_size, config.world_size
    if world == 1:
        return None
    check_shardable(shape, tp, pp)
    device = config.torch_device
    usable = torch.cuda.device_count() if device.startswith("cuda") else usable_cores()
    if world > usable:
        log.warning(
            "%s: %d ranks (tensor_parallel_size %d x pipeline_parallel_size %d) on %d usable %s: they will "
            "share them and each step waits on the slowest", config.model_name or config.model, world, tp, pp,
            usable, "devices" if device.startswith("cuda") else "cores",
        )  # fmt: skip
    return ShardPlan(tp, pp, 0, shape.num_layers)


def _spawn_ranks(
    config: EngineConfig, plan: ShardPlan, num_blocks: int, num_threads: int, connector: KVConnector | None,
    sharding: Sharding, name: str, hidden_size: int,
) -> RankGroup:  # fmt: skip
    """Ranks 1..world-1 of a new group, loading (the driver's `ShardedExecutor.start` waits for them)."""
    kvbm = connector.config if isinstance(connector, KVBMConnector) else None
    model_name = config.model_name or name
    settings = sharding.settings

    def spec(rank: int, store_port: int, control: str, replies: str, reduce_segment: str) -> RankSpec:
        return RankSpec(
            engine=config, kvbm=kvbm, tp_size=plan.tp_size, pp_size=plan.pp_size, rank=rank,
            num_layers=plan.num_layers, num_blocks=num_blocks, worker_id=sharding.worker_id,
            title=rank_title(model_name, sharding.worker_id, rank, plan.world_size), store_port=store_port,
            control=control, replies=replies, num_threads=num_threads, heartbeat_s=settings.heartbeat_s,
            collective_timeout_s=settings.collective_timeout_s, reduce_segment=reduce_segment,
            tracing=tracing.settings(),
        )  # fmt: skip

    shm = _shm_plan(config, plan, hidden_size, num_threads)
    group = RankGroup(spec, plan.world_size, settings, sharding.on_event, shm)
    group.spawn()
    return group


def _shm_plan(config: EngineConfig, plan: ShardPlan, hidden_size: int, num_threads: int) -> ShmPlan | None:
    """Shared-memory all-reduces for a CPU group with tensor parallelism and the compiled kernels (else gloo's);
    their waiters spin only where the ranks' threads have cores of their own."""
    compiled = kernels.cpu_kernels() if config.torch_device == "cpu" and plan.tp_size > 1 else None
    if compiled is None:
        return None
    spin = plan.world_size * num_threads <= usable_cores()
    return ShmPlan(compiled, plan.tp_size, plan.pp_size, config.max_num_batched_tokens * hidden_size, spin)


def load_model(
    config: EngineConfig, files: ModelFiles, shape: ModelShape, shard: ShardPlan | None
) -> LlamaModel:
    """The model, or with `shard` one rank's part of it (reading only that part of each weight)."""
    compiled = None
    if config.torch_device == "cpu" and (
        config.paged_kernel or config.fused_ops or config.prefill_kernel or config.linear_kernel
    ):
        compiled = kernels.cpu_kernels()
    weights = load_weights(files) if shard is None else open_weights(files)
    return LlamaModel(
        shape, weights, config.torch_dtype, config.torch_device, config.pack_weights,
        decode_kernel=compiled if config.paged_kernel else None,
        fused_ops=compiled if config.fused_ops else None,
        prefill_kernel=compiled if config.prefill_kernel else None,
        batch_invariant=config.batch_invariant,
        linear_kernel=compiled
        if config.linear_kernel and (config.batch_invariant or _linear_kernel_preferred(compiled))
        else None,
        shard=shard,
    )  # fmt: skip


def _linear_kernel_preferred(compiled) -> bool:
    """The compiled bf16 linear kernel where AMX is not usable: with AMX, oneDNN's GEMM runs on its tiles (a
    batch-invariant engine takes the compiled kernel there too: its sum over K has one order at every row count)."""
    return compiled is not None and "amx" not in compiled.prefill_attention_isas()


def kv_layout(
    files: ModelFiles, config: EngineConfig, shape: ModelShape, shard: ShardPlan | None = None
) -> KVLayout:
    """The pool's layout and fingerprint (model, dtype, block size, shape): tiers share blocks only when equal.
    With `shard`, the layout of that rank's part of each block (its layers and KV heads), named by its plan."""
    dtype = config.torch_dtype  # `auto` resolved once, for this machine
    fingerprint = (
        f"{files.name}|{str(dtype).removeprefix('torch.')}|bs{config.block_size}"
        f"|l{shape.num_layers}h{shape.num_kv_heads}d{shape.head_dim}"
    )
    part = shape if shard is None else local_shape(shape, shard)
    return KVLayout(
        fingerprint=fingerprint if shard is None else fingerprint + shard.tag,
        num_layers=part.num_layers, block_size=config.block_size, num_kv_heads=part.num_kv_heads,
        head_dim=shape.head_dim, dtype=dtype,
    )  # fmt: skip


def _eos_ids(hf_config: dict) -> list[int]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def token_texts(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each of the model's `vocab_size` ids decoded on its own ("" past the tokenizer's vocabulary: padding rows
    of the embedding); one batched decode in the tokenizer's Rust code."""
    known = min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    texts = tokenizer.decode_batch([[i] for i in range(known)], skip_special_tokens=False)
    return texts + [""] * (vocab_size - known)
