"""Disaggregated prefill/decode for Strata's engine, as a KV connector with two halves (vLLM v1's shape).

The router decides (server/router/disagg.py). Scheduler half, on the caller's thread at submit: a request with
`remote_decode` is marked to hand off; a request with `remote_prefill` (a `KVHandoff`) is brought to where its
prefill engine left it (the prefill's tokens reported, its detokenizer holding back what the prefill's held back,
a seeded generator past the prefill's draws) and its blocks are fetched on the `kv-fetch` thread before it joins
the engine's inbox; the block manager reads them into pool rows when the scheduler admits it. Worker half, on
the engine thread: once a handed-off request has its first token, `hand_off` sends the prompt's full blocks
toward the decode worker (one gather write) and describes them. The core sees only `wants_hand_off` and
`hand_off`; a sequence's transfer fields live in its `KVTransferState`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvbm.api import KVConnector
from kvbm.transfer import KVTransfer
from server.engine.api import GenerationRequest, KVHandoff, RequestError
from server.engine.block_manager import BlockManager
from server.engine.sequence import KVTransferState, Sequence

log = logging.getLogger(__name__)


class KVTransferConnector:
    def __init__(
        self,
        transfer: KVTransfer,
        block_manager: BlockManager,
        connector: KVConnector | None,
        block_bytes: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        """`connector`: the engine's KVBM tiers, the handoff's route when no transport reaches the decode
        worker. `block_bytes`: one block of every layer."""
        self.transfer = transfer
        self.block_manager = block_manager
        self.connector = connector
        self.block_bytes = block_bytes
        self.vocab_size = vocab_size
        self.device = device
        self._fetcher: ThreadPoolExecutor | None = None  # started with the first fetch

    # ---- scheduler half (the caller's thread) ----

    def validate(self, request: GenerationRequest) -> None:
        handoff = request.remote_prefill
        if handoff is not None and (
            len(handoff.token_ids) >= request.sampling.max_tokens
            or not all(0 <= t < self.vocab_size for t in handoff.token_ids)
        ):
            raise RequestError("remote_prefill", "token_ids must be fewer than max_tokens, in the vocabulary")

    def prepare(self, seq: Sequence, request: GenerationRequest) -> None:
        """Give `seq` its transfer state: to hand off after its first token, or resumed from a handoff."""
        if request.remote_decode is not None:
            seq.kv_transfer = KVTransferState(decode_host=request.remote_decode.decode_host)
        handoff = request.remote_prefill
        if handoff is None:
            return
        seq.kv_transfer = KVTransferState()
        seq.num_reported_tokens = len(handoff.token_ids)
        seq.num_cached_tokens = handoff.num_cached_tokens
        for token_id in handoff.token_ids:
            seq.detokenizer.add_token(token_id)
        seq.detokenizer.take_text(finished=False)
        if seq.generator is not None and seq.sampling.temperature > 0:
            draw = torch.empty(self.vocab_size, device=self.device)
            for _ in handoff.token_ids:  # the sampler draws one vocab-sized row of noise per token
                draw.exponential_(generator=seq.generator)

    @staticmethod
    def needs_fetch(handoff: KVHandoff | None) -> bool:
        """ "kvbm": the blocks are in the KVBM tiers, found by the connector at admission; "none": recompute."""
        return handoff is not None and handoff.transport not in ("none", "kvbm")

    def fetch_then(self, seq: Sequence, handoff: KVHandoff, enqueue: Callable[[Sequence], bool]) -> None:
        """Open `seq`'s handoff on the fetch thread, then `enqueue(seq)` (a failed fetch enqueues it to
        recompute); `enqueue` returns False when the request is gone (aborted, engine stopping)."""
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
            seq.kv_transfer.source = source
            if not enqueue(seq) and source is not None:
                seq.kv_transfer.source = None
                source.release()

        self._fetcher.submit(fetch)

    # ---- worker half (the engine thread) ----

    @staticmethod
    def wants_hand_off(seq: Sequence) -> bool:
        return seq.kv_transfer is not None and seq.kv_transfer.decode_host is not None

    def hand_off(self, seq: Sequence) -> tuple[KVHandoff, tuple[float, int]]:
        """Send the prompt's full blocks (computed and registered) toward the decode worker. Returns the handoff
        and (seconds, bytes) sent; a failed send hands off nothing and the decode worker recomputes."""
        num_blocks = seq.num_prompt_tokens // seq.block_size
        hashes, rows = seq.block_hashes[:num_blocks], self.block_manager.rows
        started, transport, location = time.perf_counter(), "none", ""
        if num_blocks and rows is not None:
            try:
                transport, location = self.transfer.send(
                    seq.kv_transfer.decode_host, hashes, [rows[b] for b in seq.block_table[:num_blocks]]
                )
            except Exception:
                log.exception(
                    "request %s: sending its KV failed; the decode worker recomputes", seq.request_id
                )
        if transport == "none" and num_blocks and self.connector is not None:
            # no transport reaches the decode worker: through this worker's KVBM tiers (G2 on this node, G4 for
            # every node with write-through), where the decode worker's connector finds them at admission
            try:
                self.connector.offload(hashes, seq.block_table[:num_blocks])
                transport = "kvbm"
            except Exception:
                log.exception(
                    "request %s: offloading its KV failed; the decode worker recomputes", seq.request_id
                )
        sent = (time.perf_counter() - started, num_blocks * self.block_bytes if transport != "none" else 0)
        handoff = KVHandoff(
            transport, location, list(hashes), self.block_bytes, seq.output_token_ids, seq.num_cached_tokens
        )
        return handoff, sent

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        self.transfer.close()
