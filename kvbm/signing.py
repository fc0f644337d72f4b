"""Signed block values: how a block is stored where anyone else can write (G4 Redis, G5 object storage).

    value  40-byte header (magic u64, layout tag u64, payload length u64, MAC 16 bytes) + payload
           MAC = keyed BLAKE3 over (layout tag, block hash, payload) with a key derived from the cluster secret

The MAC is what makes shared storage untrusted storage: whoever can write to it but lacks the secret cannot make
a block that verifies, nor move a real block to another hash or layout. (It does not hide the KV data, and a
writer can still delete or replace blocks with stale signed ones of the same hash: a denial of service, not a
forgery.) Each tier has its own magic, so a value copied from one tier's store to the other's does not verify.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

# cluster.secret.derive_key purpose of the block key (KVBMConfig.block_key, G4 and G5 alike): another string is
# another key, under which no block already stored verifies
BLOCK_KEY_PURPOSE = "g4-mac"
HEADER = np.dtype([("magic", "<u8"), ("layout", "<u8"), ("length", "<u8"), ("mac", "V16")])


def block_mac(key: bytes, layout_tag: int, block_hash: int, payload) -> bytes:
    """16-byte keyed BLAKE3 over (layout, block hash, payload: any buffer, read in place): a value nobody
    without the 32-byte key (`derive_key(secret, BLOCK_KEY_PURPOSE)`) can forge, and that cannot be moved to another
    block hash or layout.

    BLAKE3 because the MAC sits on the onboarding path, and it hashes faster on one core than BLAKE2b or SHA-256
    (docs/kvbm.md; bench/kvbm.py measures the onboarding cost). It releases the GIL on large inputs."""
    mac = blake3(layout_tag.to_bytes(8, "little") + block_hash.to_bytes(8, "little"), key=key)
    mac.update(payload)
    return mac.digest(16)


@dataclass(frozen=True, slots=True)
class BlockSeal:
    """Signs and verifies one layout's blocks for one tier (`magic` names the tier)."""

    key: bytes
    magic: int
    layout: int  # the layout tag as an integer
    block_bytes: int

    @property
    def value_bytes(self) -> int:
        return HEADER.itemsize + self.block_bytes

    def seal(self, block_hash: int, block: np.ndarray) -> bytes:
        """The stored value of one block: header and payload in one bytes object."""
        mac = block_mac(self.key, self.layout, block_hash, block)
        header = np.array([(self.magic, self.layout, block.nbytes, mac)], dtype=HEADER)
        return header.tobytes() + block.tobytes()

    def verify(self, block_hash: int, value) -> memoryview | None:
        """The payload of `value` (bytes or any buffer) as block `block_hash`, read in place; None when its size,
        header or MAC does not match."""
        view = memoryview(value).cast("B")
        if view.nbytes != self.value_bytes:
            return None
        header = np.frombuffer(view[: HEADER.itemsize], dtype=HEADER, count=1)[0]
        payload = view[HEADER.itemsize :]
        if (
            int(header["magic"]) != self.magic
            or int(header["layout"]) != self.layout
            or int(header["length"]) != self.block_bytes
            or not hmac.compare_digest(
                header["mac"].tobytes(), block_mac(self.key, self.layout, block_hash, payload)
            )
        ):
            return None
        return payload

    def open_into(self, block_hash: int, value, dest: np.ndarray) -> bool:
        """Verify `value` and copy its payload into `dest`; False (nothing written) when it does not verify."""
        payload = self.verify(block_hash, value)
        if payload is None:
            return False
        dest[:] = np.frombuffer(payload, dtype=np.uint8)
        return True
