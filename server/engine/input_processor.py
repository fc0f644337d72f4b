"""A request on its way in, on the caller's thread: checked against what this engine can ever run, then made the
core's `Sequence` (its detokenizer, block-hash salt, seeded generator, compiled grammar) and prepared by the KV
transfer connector's scheduler half when it continues a handoff. What would stall a step on the engine thread (a
new grammar, the vocabulary's texts for logprobs) is done here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbm.block_hash import request_salt
from kvbm.transfer_params import KVHandoff, RemoteDecode
from server.engine.api import Engine, GenerationRequest, OutputSink, RequestError, validate_request
from server.engine.detokenizer import Detokenizer
from server.engine.sequence import Sequence

if TYPE_CHECKING:
    from server.engine.builder import EngineParts


class InputProcessor:
    def __init__(self, engine: Engine, parts: EngineParts, block_size: int) -> None:
        """`engine`: the limits requests are checked against (max_model_len, max_tokens_limit); `block_size`:
        tokens per KV block."""
        self._engine = engine
        self._parts = parts
        self._block_size = block_size

    def process(
        self, request: GenerationRequest, sink: OutputSink
    ) -> tuple[Sequence, RemoteDecode | KVHandoff | None]:
        """The request's sequence and its KV transfer params; RequestError for a request that can never run."""
        parts, sampling = self._parts, request.sampling
        params = self._validate(request)
        resumed = params.token_ids if isinstance(params, KVHandoff) else []  # a prefill engine's first token
        seq = Sequence(
            request_id=request.request_id, token_ids=[*request.prompt_token_ids, *resumed],
            num_prompt_tokens=len(request.prompt_token_ids), sampling=sampling, sink=sink,
            detokenizer=Detokenizer(
                parts.tokenizer, sampling.stop, sampling.skip_special_tokens, sampling.include_stop_str_in_output
            ),
            block_size=self._block_size,
            salt=request_salt(parts.salt, request.cache_salt), generator=_generator(sampling.seed, parts.model.device),
            priority=request.priority,
        )  # fmt: skip
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            parts.core.outputs.token_texts()  # built here the first time
        structured = sampling.structured_outputs
        if structured is not None:  # compiled here: a new grammar never stalls a step
            generated = request.prompt_token_ids[len(request.prompt_token_ids) - structured.num_generated :]
            seq.grammar = parts.grammars.matcher(structured, [*generated, *resumed])
        parts.core.kv_transfer.prepare(seq, params)
        return seq, params

    def _validate(self, request: GenerationRequest) -> RemoteDecode | KVHandoff | None:
        """Raise RequestError for a request that can never run; return its KV transfer params."""
        parts, prompt = self._parts, request.prompt_token_ids
        validate_request(self._engine, request, parts.model.shape.vocab_size)
        if request.priority != 0 and not parts.core.scheduler.by_priority:
            raise RequestError(
                "priority", "must be 0: this model's scheduling_policy is fcfs (--scheduling-policy priority)"
            )
        params = parts.core.kv_transfer.validate(request)
        pool_tokens = parts.core.scheduler.block_manager.num_blocks * self._block_size
        if len(prompt) + 1 > pool_tokens:
            raise RequestError(
                "prompt", f"{len(prompt)} tokens do not fit the KV pool ({pool_tokens} tokens)"
            )
        if min(len(prompt) + request.sampling.max_tokens, self._engine.max_model_len) > pool_tokens:
            raise RequestError(
                "max_tokens", f"prompt + max_tokens must fit the KV pool ({pool_tokens} tokens)"
            )
        return params


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
