"""Disaggregated prefill/decode for Strata's engine, as a KV connector with two halves (vLLM v1's shape).

The router decides (server/router/disagg.py) and says so in the request's opaque `kv_transfer_params`
(`kvbm.transfer_params`). Scheduler half, on the caller's thread at submit: a request with `RemoteDecode` params
is marked to hand off; a request with `KVHandoff` params is brought to where its
prefill engine left it (the prefill's tokens reported, its detokenizer holding back what the prefill's held back,
a seeded generator past the prefill's draws) and its blocks are fetched on the `kv-fetch` thread before it joins
the engine's inbox; the block manager reads them into pool rows when the scheduler admits it. Worker half, on
the engine thread: once a handed-off request has its first token, `hand_off` sends the prompt's full blocks
toward the decode worker (one gather write) and describes them in the last output's params; a decode engine's
first output after the read carries `KVReceived`. The core sees only `wants_hand_off` and `hand_off` (and
bytes); a sequence's transfer fields live in its `KVTransferState`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kvbm.api import KVConnector
from kvbm.transfer import KVTransfer
from kvbm.transfer_params import (
    KVHandoff,
    KVReceived,
    KVTransferParams,
    RemoteDecode,
    encode_transfer_params,
    request_params,
)
from server.engine.api import GenerationRequest, RequestError
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

    def validate(self, request: GenerationRequest) -> RemoteDecode | KVHandoff | None:
        """The request's transfer params, checked; RequestError("kv_transfer_params") naming what is wrong."""
        try:
            return request_params(request.kv_transfer_params, request.sampling.max_tokens, self.vocab_size)
        except ValueError as err:
            raise RequestError("kv_transfer_params", str(err)) from None

    def prepare(self, seq: Sequence, params: RemoteDecode | KVHandoff | None) -> None:
        """Give `seq` its transfer state: to hand off after its first token, or resumed from a handoff."""
        if isinstance(params, RemoteDecode):
            seq.kv_transfer = KVTransferState(decode_host=params.decode_host)
        if not isinstance(params, KVHandoff):
            return
        seq.kv_transfer = KVTransferState()
        seq.num_reported_tokens = len(params.token_ids)
        seq.num_cached_tokens = params.num_cached_tokens
        for token_id in params.token_ids:
            seq.detokenizer.add_token(token_id)
        seq.detokenizer.take_text(finished=False)
        if seq.generator is not None and seq.sampling.temperature > 0:
            draw = torch.empty(self.vocab_size, device=self.device)
            for _ in params.token_ids:  # the sampler draws one vocab-sized row of noise per token
                draw.exponential_(generator=seq.generator)

    @staticmethod
    def needs_fetch(params: KVTransferParams | None) -> bool:
        """A handoff to fetch before admission (transport "kvbm": the blocks are in the KVBM tiers, found by the
        connector at admission; "none": recompute)."""
        return isinstance(params, KVHandoff) and params.transport not in ("none", "kvbm")

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

    def hand_off(self, seq: Sequence) -> bytes:
        """Send the prompt's full blocks (computed and registered) toward the decode worker; returns the
        encoded `KVHandoff` for the last output. A failed send hands off nothing: the decode worker recomputes."""
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
        handoff = KVHandoff(
            transport, location, list(hashes), self.block_bytes, seq.output_token_ids, seq.num_cached_tokens,
            sent_us=round((time.perf_counter() - started) * 1e6),
            sent_bytes=num_blocks * self.block_bytes if transport != "none" else 0,
        )  # fmt: skip
        return encode_transfer_params(handoff)

    @staticmethod
    def take_received(seq: Sequence) -> bytes | None:
        """The encoded `KVReceived` of a read handoff, once (the output that reports it takes it)."""
        transfer = seq.kv_transfer
        if transfer is None or transfer.received is None:
            return None
        (seconds, nbytes), transfer.received = transfer.received, None
        return encode_transfer_params(KVReceived(round(seconds * 1e6), nbytes))

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        self.transfer.close()
