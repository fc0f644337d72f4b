"""The one block-hashing function of Strata.

A block's hash covers its token ids and its parent's hash, so equal hashes mean equal prefixes (up to a 64-bit
collision, which the engine guards against by comparing stored token ids on a hit). The chain starts from a salt
derived from the model fingerprint, so two models (or two KV layouts of one model) never share a hash. xxh3_64 is
deterministic across processes and hosts, unlike Python's salted `hash()`.
"""

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)


def model_salt(fingerprint: str) -> BlockHash:
    """Root of every hash chain for one model/layout fingerprint (e.g. "smollm2-135m|fp32|bs16|l30h3d64")."""
    return BlockHash(xxhash.xxh3_64_intdigest(fingerprint.encode()))


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (or the model salt for the first block)."""
    return _chain_hash(parent, np.asarray(token_ids, dtype=np.int64).tobytes())


def block_hashes(token_ids: Sequence[int], block_size: int, salt: BlockHash) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids` (a trailing partial block has no hash)."""
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
