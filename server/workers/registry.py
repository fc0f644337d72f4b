"""Worker discovery in Redis: remote workers (`strata worker`) register per model, servers find and claim them.

Keys, per model, on the Redis of `--redis-url` (values are JSON or plain strings, never pickles; a registration is
decoded by msgspec into its types, so a malformed one is skipped with a log line):

    strata:workers:<model>                 hash  worker id -> {"address": ChannelAddress, "info": WorkerInfo}
    strata:worker-lease:<model>:<worker>   the worker process's token while it lives: SET NX PX lease_s, renewed
                                           every lease_s/3
    strata:worker-claim:<model>:<worker>   the id of the server holding the worker: SET NX PX lease_s, renewed by it
    strata:worker-events:<model>           stream of {"event": "join" | "leave", "worker": id, "reason": text}

A worker announces "join" when it registers and each time it is free again; servers block on the stream
(XREAD BLOCK) and claim a joining worker before connecting, so a worker has one server at a time (its PUSH
socket would split outputs between two). A registration whose lease is gone (the worker was killed or lost
Redis) is removed by the next server that looks, with a "leave" event; a live worker re-registers itself.
Leases and claims are renewed and released only by their holder (cluster.redis_lease): one whose lease lapsed and
was taken by another worker or server meanwhile leaves it to that one.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass

import msgspec
import redis

from cluster.redis_lease import Leases, LeaseState
from cluster.redis_link import RedisLink
from server.workers.protocol import WorkerInfo
from server.workers.transport import ChannelAddress

log = logging.getLogger(__name__)

STREAM_MAXLEN = 10_000  # join/leave events kept per model (servers only read new ones)

# Remove a registration whose lease is gone and announce it, as one step: Redis runs a script atomically, so a
# worker renewing its lease meanwhile keeps its record, and nobody sees the record gone before the "leave" event.
# KEYS: registrations hash, the worker's lease, the events stream. ARGV: worker id, stream length.
_REMOVE_EXPIRED = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'event', 'leave', 'worker', ARGV[1],
           'reason', 'lease expired')
return 1
"""

# Deregister, unless another worker took this worker id after our lease lapsed (then its record stays).
# KEYS: registrations hash, the worker's lease, its claim, the events stream. ARGV: worker id, our lease token,
# stream length, the reason.
_DEREGISTER = """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'event', 'leave', 'worker', ARGV[1], 'reason', ARGV[4])
return 1
"""


def registrations_key(model: str) -> str:
    return f"strata:workers:{model}"


def registration_lease_key(model: str, worker_id: str) -> str:
    return f"strata:worker-lease:{model}:{worker_id}"


def claim_key(model: str, worker_id: str) -> str:
    return f"strata:worker-claim:{model}:{worker_id}"


def events_key(model: str) -> str:
    return f"strata:worker-events:{model}"


class _Registered(msgspec.Struct):
    """The JSON value under the worker's id in the registrations hash."""

    address: ChannelAddress
    info: WorkerInfo


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker registers: where to connect and what it is."""

    worker_id: str
    address: ChannelAddress
    info: WorkerInfo

    def to_json(self) -> bytes:
        return msgspec.json.encode(_Registered(self.address, self.info))

    @classmethod
    def from_json(cls, worker_id: str, raw: str | bytes) -> WorkerRecord:
        """Raises msgspec.ValidationError (a ValueError) naming the field of a registration that is not one."""
        registered = msgspec.json.decode(raw, type=_Registered)
        return cls(worker_id, registered.address, registered.info)


class WorkerIdTaken(RuntimeError):
    """Another live worker holds this worker id's lease."""


class Registration:
    """The worker side: register, keep the lease, announce join/leave, free a claim when a server lets go.

    The lease thread also re-registers the worker if its lease lapsed (Redis was unreachable longer than the
    lease and a server removed the registration meanwhile)."""

    def __init__(self, redis_url: str, record: WorkerRecord, lease_s: float = 3.0) -> None:
        self.record = record
        self.model = record.info.model_name
        self.lease_ms = int(lease_s * 1000)
        self._token = (
            f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # tells this process's lease from a predecessor's
        )
        self._link = RedisLink(redis_url)
        self._leases = Leases(self._link.client)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._lease_loop, name="worker-lease", daemon=True)

    def register(self) -> None:
        """Take the lease (waiting out a dead predecessor's), publish the record, announce "join".
        Raises redis.RedisError if Redis is unreachable, WorkerIdTaken if a live worker has this id."""
        client, worker_id = self._link.client, self.record.worker_id
        if not client.set(
            registration_lease_key(self.model, worker_id), self._token, nx=True, px=self.lease_ms
        ):
            remaining_ms = client.pttl(registration_lease_key(self.model, worker_id))
            log.info(
                "worker id %s still leased (%d ms left): waiting for it to expire", worker_id, remaining_ms
            )
            self._stop.wait(max(remaining_ms, 0) / 1000 + 0.05)
            if not client.set(
                registration_lease_key(self.model, worker_id), self._token, nx=True, px=self.lease_ms
            ):
                raise WorkerIdTaken(
                    f"worker id {worker_id!r} is in use by a live worker of {self.model}; "
                    "choose another with --worker-id"
                )
        client.hset(registrations_key(self.model), worker_id, self.record.to_json())
        self.announce("join")
        self._thread.start()

    def announce(self, event: str, reason: str = "") -> None:
        self._link.call(lambda r: self._announce(r, event, reason), None)

    def _announce(self, client: redis.Redis | redis.client.Pipeline, event: str, reason: str) -> None:
        client.xadd(
            events_key(self.model),
            {"event": event, "worker": self.record.worker_id, "reason": reason},
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )

    def release_claim(self, server_id: str) -> None:
        """The server `server_id` let go (or went silent): free the worker for the next server at once."""
        key = claim_key(self.model, self.record.worker_id)
        self._link.call(lambda _: self._leases.release(key, server_id), False)

    def deregister(self, reason: str) -> None:
        """Stop the lease, remove the record and announce "leave" (servers drop it from the stream event), all in
        one script; nothing if another worker holds this worker id's lease now."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        worker_id = self.record.worker_id
        keys = [
            registrations_key(self.model),
            registration_lease_key(self.model, worker_id),
            claim_key(self.model, worker_id),
            events_key(self.model),
        ]
        args = [worker_id, self._token, STREAM_MAXLEN, reason]
        if self._link.call(lambda r: r.eval(_DEREGISTER, len(keys), *keys, *args), 1) == 0:
            log.warning("worker %s: another worker holds this id now; leaving its registration", worker_id)
        self._link.close()

    def _lease_loop(self) -> None:
        state = LeaseState.RENEWED
        while not self._stop.wait(self.lease_ms / 3000):
            previous, state = state, self._link.call(self._renew, state)
            if state is LeaseState.TAKEN:
                log.warning("worker %s: lease had lapsed; registered again", self.record.worker_id)
                self.announce("join", "lease renewed after a lapse")
            elif state is LeaseState.HELD_BY_OTHER and previous is not LeaseState.HELD_BY_OTHER:
                log.warning(
                    "worker %s: lease lapsed and another worker took this id; not overwriting it",
                    self.record.worker_id,
                )

    def _renew(self, client: redis.Redis) -> LeaseState:
        """Renew the lease, or take it again if it lapsed and is free (the record, maybe removed meanwhile, is
        written again); another worker's lease on this id is left as it is."""
        (state,) = self._leases.renew(
            [registration_lease_key(self.model, self.record.worker_id)], self._token, self.lease_ms
        )
        if state is LeaseState.TAKEN:
            client.hset(registrations_key(self.model), self.record.worker_id, self.record.to_json())
        return state


class Directory:
    """The server side: read registrations, claim workers, follow the join stream. Never raises: while Redis is
    unreachable, reads return nothing (the model keeps serving on the workers it has)."""

    def __init__(self, redis_url: str, model: str, lease_s: float = 3.0) -> None:
        self.model = model
        self.lease_ms = int(lease_s * 1000)
        self.server_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._link = RedisLink(redis_url)
        self._leases = Leases(self._link.client)

    def stream_tail(self) -> str:
        """The id of the newest join/leave event ("0-0" if none): follow from here after reading the records."""
        last = self._link.call(lambda r: r.xrevrange(events_key(self.model), count=1), [])
        return last[0][0].decode() if last else "0-0"

    def wait_for_events(self, after: str, block_ms: int) -> list[tuple[str, dict[str, str]]] | None:
        """Stream events after `after`, blocking up to `block_ms` for the first one; None if Redis is
        unreachable (the caller waits before asking again)."""
        found = self._link.call(lambda r: r.xread({events_key(self.model): after}, block=block_ms), None)
        if found is None:
            return None
        return [
            (entry_id.decode(), {k.decode(): v.decode() for k, v in fields.items()})
            for _, entries in found
            for entry_id, fields in entries
        ]

    def live_records(self) -> list[WorkerRecord] | None:
        """Registered workers whose lease is alive, or None if Redis is unreachable; registrations whose lease
        is gone are removed (with a "leave" event)."""
        raw = self._link.call(lambda r: r.hgetall(registrations_key(self.model)), None)
        ids = [worker_id.decode() for worker_id in raw or {}]
        alive = self._link.call(
            lambda r: _exist(r, [registration_lease_key(self.model, w) for w in ids]), None
        )
        if raw is None or alive is None:
            return None
        records = []
        for worker_id, present in zip(ids, alive, strict=True):
            record = self._parse(worker_id, raw[worker_id.encode()]) if present else None
            if record is not None:
                records.append(record)
            elif not present:
                self._remove_expired(worker_id)
        return records

    def record(self, worker_id: str) -> WorkerRecord | None:
        raw = self._link.call(lambda r: r.hget(registrations_key(self.model), worker_id), None)
        return self._parse(worker_id, raw) if raw else None

    def _parse(self, worker_id: str, raw: bytes) -> WorkerRecord | None:
        """A registration, or None (logged) if it is not one this Strata version can read."""
        try:
            return WorkerRecord.from_json(worker_id, raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s: ignoring unreadable registration of worker %s: %s", self.model, worker_id, exc)
            return None

    def claim(self, worker_id: str) -> bool:
        """Take the worker for this server; False if another server holds it."""
        key = claim_key(self.model, worker_id)
        return bool(self._link.call(lambda r: r.set(key, self.server_id, nx=True, px=self.lease_ms), False))

    def keep_claims(self, worker_ids: list[str]) -> list[str]:
        """Renew the claims of the workers this server holds (every lease_s/3 or sooner), taking back one that
        lapsed while nobody held it; return the workers whose claim another server took meanwhile (logged, and
        left to that server). [] while Redis is unreachable."""
        if not worker_ids:
            return []
        keys = [claim_key(self.model, worker_id) for worker_id in worker_ids]
        states = self._link.call(lambda _: self._leases.renew(keys, self.server_id, self.lease_ms), None)
        if states is None:
            return []
        lost = [w for w, state in zip(worker_ids, states, strict=True) if state is LeaseState.HELD_BY_OTHER]
        for worker_id in lost:
            log.warning(
                "%s: this server's claim of worker %s lapsed and another server claimed it; not overwriting it",
                self.model,
                worker_id,
            )
        return lost

    def release(self, worker_id: str) -> None:
        """Free the worker's claim if this server still holds it."""
        key = claim_key(self.model, worker_id)
        self._link.call(lambda _: self._leases.release(key, self.server_id), False)

    def close(self) -> None:
        self._link.close()

    def _remove_expired(self, worker_id: str) -> None:
        keys = [
            registrations_key(self.model),
            registration_lease_key(self.model, worker_id),
            events_key(self.model),
        ]
        removed = self._link.call(
            lambda r: r.eval(_REMOVE_EXPIRED, len(keys), *keys, worker_id, STREAM_MAXLEN), 0
        )
        if removed:
            log.warning("%s: worker %s's lease expired; registration removed", self.model, worker_id)


def _exist(client: redis.Redis, keys: list[str]) -> list[bool]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return [bool(found) for found in pipe.execute()]
