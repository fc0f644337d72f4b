"""Assembles an engine from its config: files, weights, kernels, tokenizer, KV pool, scheduler, sampler, core.

`build` runs on the engine thread (see LLMEngine), so the model's OpenMP team is that thread's. Everything the
engine serves with comes back in one `EngineParts`; nothing here runs a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tokenizers import Tokenizer

from kvbm.api import KVConnector, KVLayout
from kvbm.block_hash import model_salt
from kvbm.connector import block_rows
from kvbm.transfer import KVTransfer
from server.engine import kernels
from server.engine.api import EngineResources, KVBlockLayout, RequestId
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.core import EngineCore
from server.engine.kv_transfer import KVTransferConnector
from server.engine.loader import ModelFiles, load_config, load_weights, prepare_model
from server.engine.model import LlamaModel, ModelShape
from server.engine.model_runner import ModelRunner
from server.engine.output_processor import OutputProcessor
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


def build(
    config: EngineConfig,
    num_threads: int,
    connector: KVConnector | None,
    transfer: KVTransfer | None,
    on_finished: Callable[[RequestId], None],
) -> EngineParts:
    """Load the model and assemble the core; `connector` (the KVBM tiers) is bound to the new KV pool."""
    started = time.monotonic()
    files = prepare_model(config.model, Path(config.cache_dir).expanduser() if config.cache_dir else None)
    hf_config = load_config(files)
    shape = ModelShape.from_config(hf_config)
    model = _model(config, shape, files)
    layout = _kv_layout(files, config, shape)
    num_blocks = config.num_kv_blocks or max(2, config.kv_cache_bytes // layout.block_bytes)
    runner = ModelRunner(model, num_blocks, config.block_size)
    block_manager = BlockManager(num_blocks, config.block_size, connector)
    if runner.kv_cache.device.type == "cpu":  # handoffs read and write pool rows as host memory
        block_manager.rows = block_rows(runner.kv_cache, num_blocks)
    if connector is not None:
        connector.bind(runner.kv_cache, layout)
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
        Scheduler(block_manager, config.max_num_batched_tokens, config.max_concurrent_requests),
        runner, Sampler(eos_token_ids, model.device, processors), outputs, kv_transfer, on_finished,
    )  # fmt: skip
    salt = model_salt(layout.fingerprint)
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


def _model(config: EngineConfig, shape: ModelShape, files: ModelFiles) -> LlamaModel:
    compiled = None
    if config.torch_device == "cpu" and (
        config.paged_kernel or config.fused_ops or config.prefill_kernel or config.linear_kernel
    ):
        compiled = kernels.cpu_kernels()
    return LlamaModel(
        shape, load_weights(files), config.torch_dtype, config.torch_device, config.pack_weights,
        decode_kernel=compiled if config.paged_kernel else None,
        fused_ops=compiled if config.fused_ops else None,
        prefill_kernel=compiled if config.prefill_kernel else None,
        batch_invariant=config.batch_invariant,
        linear_kernel=compiled
        if config.linear_kernel and (config.batch_invariant or _linear_kernel_preferred(compiled))
        else None,
    )  # fmt: skip


def _linear_kernel_preferred(compiled) -> bool:
    """The compiled bf16 linear kernel where AMX is not usable: with AMX, oneDNN's GEMM runs on its tiles (a
    batch-invariant engine takes the compiled kernel there too: its sum over K has one order at every row count)."""
    return compiled is not None and "amx" not in compiled.prefill_attention_isas()


def _kv_layout(files: ModelFiles, config: EngineConfig, shape: ModelShape) -> KVLayout:
    """The pool's layout and fingerprint (model, dtype, block size, shape): tiers share blocks only when equal."""
    dtype = config.torch_dtype  # `auto` resolved once, for this machine
    return KVLayout(
        fingerprint=f"{files.name}|{str(dtype).removeprefix('torch.')}|bs{config.block_size}"
        f"|l{shape.num_layers}h{shape.num_kv_heads}d{shape.head_dim}",
        num_layers=shape.num_layers, block_size=config.block_size, num_kv_heads=shape.num_kv_heads,
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
