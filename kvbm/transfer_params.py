"""What a disaggregated request carries between the router and the two engines, as opaque bytes on the engine API.

`GenerationRequest.kv_transfer_params` and `GenerationOutput.kv_transfer_params` (server/engine/api.py) are bytes
to the engine core, the frontends and the worker link; only the halves of the KV transfer connector read them
(the router's disaggregated flow, Strata's engine's `kv_transfer.py`, vLLM's adapter), with this one decoder:

    router -> prefill engine     RemoteDecode: compute the prompt and its first token, then hand the KV off
    prefill engine -> router     KVHandoff, on its last output (finished without a reason)
    router -> decode engine      the same KVHandoff: fetch the blocks, continue after the prefill's tokens
    decode engine -> router      KVReceived, on the first output after the blocks were read (time and bytes)
"""

from __future__ import annotations

import msgspec


class RemoteDecode(msgspec.Struct, tag="remote_decode", array_like=True):
    """Prefill side: hand the prompt's KV to the decode worker instead of decoding. A first token that ends the
    request (a stop, max_tokens 1) finishes it on the prefill engine as usual."""

    decode_host: str  # where the decode worker runs: shared memory on this host, the network otherwise


class KVHandoff(msgspec.Struct, tag="handoff", array_like=True):
    """What a prefill engine computed, for the decode engine that continues the request. `block_hashes` are the
    prompt's full blocks in order (the request's salt chain); the decode engine fetches them through `transport`
    at `location` (kvbm/transfer.py) and recomputes whatever it cannot read."""

    transport: str  # shm | tcp | kvbm (in the KVBM tiers: G2 on one node, G4 across) | none (recompute)
    location: str
    block_hashes: list[int]
    block_bytes: int
    token_ids: list[int]  # output tokens the prefill engine generated and reported (the first token)
    num_cached_tokens: int  # prompt tokens the prefill engine found cached (what the client is told)
    sent_us: int = 0  # the send's time, microseconds
    sent_bytes: int = 0  # what the send moved (0: nothing was sent, the decode engine recomputes)


class KVReceived(msgspec.Struct, tag="received", array_like=True):
    """Decode side: the handoff's blocks that were read into the pool, reported once."""

    received_us: int
    received_bytes: int


KVTransferParams = RemoteDecode | KVHandoff | KVReceived

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVTransferParams)


def encode_transfer_params(params: KVTransferParams) -> bytes:
    return _encoder.encode(params)


def decode_transfer_params(raw: bytes | None) -> KVTransferParams | None:
    """The params of a request or output (None when it has none); ValueError names what is malformed."""
    if raw is None:
        return None
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as err:  # ValidationError is one
        raise ValueError(f"kv_transfer_params: {err}") from None


def request_params(raw: bytes | None, max_tokens: int, vocab_size: int) -> RemoteDecode | KVHandoff | None:
    """A request's params as an engine takes them: ValueError if they are malformed, not a request's (a
    `KVReceived`), or a handoff whose tokens leave nothing to generate or lie outside the vocabulary."""
    params = decode_transfer_params(raw)
    if isinstance(params, KVReceived):
        raise ValueError("a decode engine's report, not a request's")
    if isinstance(params, KVHandoff) and (
        len(params.token_ids) >= max_tokens or not all(0 <= t < vocab_size for t in params.token_ids)
    ):
        raise ValueError("a handoff's token_ids must be fewer than max_tokens, in the vocabulary")
    return params
