"""The one configuration object of the KV Block Manager (CLI flags `--kvbm-*` and `--redis-url` map onto it)."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated

import msgspec

GIB = 1 << 30

NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(pattern="^[^/]+$", description="a non-empty name without '/'")]


class KVBMConfigError(ValueError):
    """A config value out of range; `field` names the offending setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kvbm config {field}: {message}")
        self.field = field


class KVBMConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Sizes are GiB of block payload; a tier sized 0 (or a Redis url of None) is off."""

    # G2: POSIX shared-memory pool shared by every worker on the node, GiB (--kvbm-host-cache-gb)
    host_cache_gb: NonNegative = 1.0
    # G3: a preallocated block file per worker under `disk_path`, GiB (--kvbm-disk-cache-gb); survives restarts
    # of the same worker id
    disk_cache_gb: NonNegative = 0.0
    # G3: the folder of every worker's block file, as `disk_path`/<worker id>/<layout tag>/ (--kvbm-disk-path)
    disk_path: Path = Path(".strata-cache/kvbm")
    # G4: Redis holding blocks for every node (--redis-url); None: no G4
    redis_url: str | None = None
    # G4 capacity bound kept by Strata's own LRU sorted set, GiB (--kvbm-redis-cache-gb); 0: unbounded (the
    # server's maxmemory rules)
    redis_cache_gb: NonNegative = 0.0
    # G4 expiry of a block, seconds (--kvbm-redis-ttl-secs); 0: none
    redis_ttl_s: Annotated[int, msgspec.Meta(ge=0)] = 0
    # G5: s3://BUCKET/PREFIX, blocks as objects for every server, kept across restarts (--kvbm-object-url);
    # credentials, region and endpoint from the AWS_* environment
    object_url: str | None = None
    # G5 bound on the objects this process knows of, GiB, the least recently used deleted past it
    # (--kvbm-object-cache-gb); 0: unbounded (the bucket's lifecycle rule bounds it)
    object_cache_gb: NonNegative = 0.0
    # G5 timeout of each request, seconds (--kvbm-object-timeout-secs); a miss's lookup waits less
    # (object_pool.LOOKUP_TIMEOUT_S)
    object_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # blocks offloaded from G1 also go to G4 (shared with other nodes); without it G4 is written only when no
    # local tier (G2/G3) is configured. The engine offloads on G1 eviction, so a chain reaches G4 tail first, as
    # its blocks are evicted. With G5, every block leaving G1 goes to the bucket anyway; write_through sends each
    # block there as soon as it is computed (--kvbm-write-through)
    write_through: bool = False
    # a G2 block is spilled to G3 on eviction only if it was used at least this many times
    disk_min_uses: Annotated[int, msgspec.Meta(ge=1)] = 1
    # fdatasync each G3 write before committing its index record (durability, slower)
    disk_fsync: bool = False
    # node-local name of the G2 segment; workers sharing it share blocks (--kvbm-cache-id)
    cache_id: Name = "default"
    # leave the G2 segment in /dev/shm when its last process closes (a restart finds its blocks); off: the last
    # process to close removes it (--kvbm-keep-host-cache)
    keep_host_cache: bool = False
    # on close, each process copies the G2 blocks it stored (the last one: also those whose owners left without
    # doing so) to its G3, hottest first, for at most this many seconds (--kvbm-flush-secs); 0: no copy
    flush_budget_s: NonNegative = 5.0
    # 32-byte key that signs and verifies G4 and G5 blocks, derived from the cluster secret for the purpose
    # "g4-mac" (kvbm.signing.BLOCK_KEY_PURPOSE); required with redis_url or object_url: shared storage is not
    # trusted storage. Never in repr
    block_key: bytes | None = None

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__ if f != "block_key")
        return f"KVBMConfig({fields}, block_key={'<set>' if self.block_key else None})"

    def validate(self) -> None:
        """Raise KVBMConfigError naming the field of a value of the wrong type or out of range, or of G4 without
        its key. A `disk_path` given as a string becomes a Path."""
        self.disk_path = Path(self.disk_path)
        try:
            msgspec.convert(msgspec.structs.asdict(self), KVBMConfig)
        except msgspec.ValidationError as exc:
            field, message = _field_problem(exc)
            raise KVBMConfigError(field, message) from None
        if self.object_url:
            from kvbm.object_pool import parse_object_url

            try:
                parse_object_url(self.object_url)
            except ValueError as exc:
                raise KVBMConfigError("object_url", str(exc)) from None
        for field, tier in (("redis_url", "G4"), ("object_url", "G5")):
            if getattr(self, field) and (not isinstance(self.block_key, bytes) or len(self.block_key) != 32):
                raise KVBMConfigError(
                    field,
                    f"{tier} blocks are signed with a key derived from the cluster secret; "
                    "give every strata process --cluster-secret-file (or STRATA_CLUSTER_SECRET)",
                )

    def to_json(self) -> dict[str, object]:
        """JSON values (the path as a string, the block key as hex) for a worker under another Python."""
        values = msgspec.structs.asdict(self)
        values["disk_path"] = str(self.disk_path)
        values["block_key"] = self.block_key.hex() if self.block_key is not None else None
        return values

    @classmethod
    def from_json(cls, values: dict[str, object]) -> KVBMConfig:
        """The inverse of `to_json`; validated."""
        key = values.get("block_key")
        config = cls(**{**values, "block_key": bytes.fromhex(key) if isinstance(key, str) else None})  # type: ignore[arg-type]
        config.validate()
        return config

    def capacity_blocks(self, size_gb: float, block_bytes: int) -> int:
        """How many whole blocks of `block_bytes` fit in `size_gb` GiB."""
        return int(size_gb * GIB) // block_bytes


def _field_problem(exc: msgspec.ValidationError) -> tuple[str, str]:
    """The KVBMConfig field of a msgspec validation error and what is wrong ("must be >= 0.0", or the field's
    description); the short form of server.errors.field_problem (kvbm imports nothing of server)."""
    problem, _, path = str(exc).partition(" - at `$.")
    field = path.rstrip("`")
    types = {f.name: f.type for f in msgspec.structs.fields(KVBMConfig)}
    meta = next(
        (m for m in typing.get_args(types.get(field)) if isinstance(m, msgspec.Meta) and m.description), None
    )
    bound = re.fullmatch(r"Expected `[^`]+` ([<>]=? .+)", problem)
    if meta is not None:
        return field, f"must be {meta.description}"
    return field, f"must be {bound[1]}" if bound else problem[:1].lower() + problem[1:]
