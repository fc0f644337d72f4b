"""The one block-hashing function of Strata.

A block's hash covers its token ids and its parent's hash, so equal hashes mean equal prefixes (up to a 64-bit
collision, which the engine guards against by comparing stored token ids on a hit). The chain starts from a salt
derived from the model fingerprint, so two models (or two KV layouts of one model) never share a hash. A request with
a `cache_salt` (a tenant's secret, vLLM's field) chains from its own root instead (`request_salt`), so its blocks are
shared only with requests of the same salt. xxh3_64 is deterministic across processes and hosts, unlike Python's
salted `hash()`.
"""

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)


def model_salt(fingerprint: str) -> BlockHash:
    """Root of every hash chain for one model/layout fingerprint (e.g. "smollm2-135m|fp32|bs16|l30h3d64")."""
    return BlockHash(xxhash.xxh3_64_intdigest(fingerprint.encode()))


def request_salt(salt: BlockHash, cache_salt: str | None) -> BlockHash:
    """Root of one request's hash chain: the model salt itself without a `cache_salt` (hashes as they always were),
    else xxh3_64 of the cache salt's UTF-8 seeded with the model salt. Every block of a salted request then differs
    from the unsalted ones and from other salts' (up to a 64-bit collision); computed once per request."""
    if cache_salt is None:
        return salt
    return BlockHash(xxhash.xxh3_64_intdigest(cache_salt.encode(), seed=salt))


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (or the chain's root for the first block)."""
    return _chain_hash(parent, np.asarray(token_ids, dtype=np.int64).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int, salt: BlockHash) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids` (a trailing partial block has no hash), from the root
    `salt` (`model_salt`, or `request_salt` for a request with a cache salt)."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()  # converted once; a block is a slice of it
    step = 8 * block_size  # bytes
    hashes: list[BlockHash] = []
    parent = salt
    for end in range(step, len(data) + 1, step):
        parent = _chain_hash(parent, data[end - step : end])
        hashes.append(parent)
    return hashes


def _chain_hash(parent: BlockHash, token_bytes: bytes) -> BlockHash:
    """The hash rule: xxh3_64 of the parent hash (u64 little-endian) followed by the block's token ids (int64)."""
    return BlockHash(xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + token_bytes))
