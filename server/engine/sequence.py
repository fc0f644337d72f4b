"""One request's state inside the engine: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from kvbm.block_hash import BlockHash, block_hashes, hash_block
from kvbm.transfer import KVSource
from server.engine.api import OutputSink, RequestId, SamplingParams, TokenLogprobs
from server.engine.detokenizer import Detokenizer
from server.engine.request_trace import RequestTrace


@dataclass(slots=True)
class KVTransferState:
    """A disaggregated request's transfer state, read and written only by the engine's KV transfer connector
    (server/engine/kv_transfer.py) and the block manager's `receive`: the core knows none of its fields."""

    decode_host: str | None = None  # prefill side: after the first token, hand the prompt's KV to this host
    source: KVSource | None = None  # decode side: the prompt's blocks, read into the pool at admission
    received: tuple[float, int] | None = None  # (seconds, bytes) of that read, reported with the next output


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Invariants: `num_computed_tokens <= len(token_ids)`; `block_table` covers at least the computed tokens;
    `block_hashes[i]` is the chained hash of full block i of `token_ids` (every full block has one);
    the first `num_registered_blocks` blocks of `block_table` were offered to the prefix cache."""

    request_id: RequestId
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    sink: OutputSink
    detokenizer: Detokenizer
    block_size: int
    salt: BlockHash  # root of this request's hash chain: `request_salt(model salt, cache_salt)`
    generator: torch.Generator | None = None
    priority: int = 0  # lower runs first under the priority policy (scheduler.py)
    arrival: int = 0  # the scheduler's count when it was added: ties of priority run in arrival order
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a cache at the last admission
    num_registered_blocks: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_reported_tokens: int = 0  # output tokens already sent to the sink
    kv_transfer: KVTransferState | None = None  # disaggregated serving only (server/engine/kv_transfer.py)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of output tokens not yet sent to the sink
    # with sampling.prompt_logprobs: entry i is prompt token i's (entry 0 None), filled as the prompt's chunks run
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    grammar: Any = (
        None  # with sampling.structured_outputs: its llguidance matcher (server/engine/structured.py)
    )
    trace: RequestTrace | None = None  # a traced request's spans (server/engine/request_trace.py)

    def __post_init__(self) -> None:
        self.block_hashes = block_hashes(self.token_ids, self.block_size, self.salt)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits give a prompt token's logprob still owed (position p gives
        token p + 1's); empty unless the request asked for prompt logprobs."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, self.num_prompt_tokens - 1))

    @property
    def num_reusable_blocks(self) -> int:
        """Leading full blocks whose KV may come from a cache rather than a forward: not the block of the last
        token (its logits are needed), nor, while prompt logprobs are owed, any block whose logits are."""
        limit = (self.num_tokens - 1) // self.block_size
        if self.prompt_logprobs is not None:
            limit = min(limit, (len(self.prompt_logprobs) - 1) // self.block_size)
        return limit

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; hash the block it completes."""
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else self.salt
            self.block_hashes.append(hash_block(parent, self.token_ids[-self.block_size :]))

    def block_tokens(self, index: int) -> tuple[int, ...]:
        """Token ids of full block `index`."""
        return tuple(self.token_ids[index * self.block_size : (index + 1) * self.block_size])
