"""The KVBM service's query link: one typed message each way (msgpack, decoded by msgspec), over ZMQ CURVE.

    router: KVIndexClient (DEALER)  -- PrefixQuery(seq, block_hashes) -->  service: QueryPort (ROUTER)
                                    <-- PrefixAnswer(seq, report, events_applied) --

`seq` pairs an answer with its query: a client that gave up on a query (its timeout passed) drops that query's
late answer instead of reading it as the next one's. The link's CURVE keys come from the cluster secret
(`service_keys`); the service's socket is the CURVE server and admits only the cluster's client key
(cluster/curve.py), so every frame is encrypted and authenticated and a peer without the secret sends none.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from cluster.curve import CurveKeys
from kvbm.index import PrefixReport

MAX_QUERY_BLOCKS = 1 << 20
MAX_QUERY_BYTES = 9 * MAX_QUERY_BLOCKS + 64  # msgpack: at most 9 bytes per u64, a few for the map and seq
MAX_ANSWER_BYTES = 1 << 24  # what a client reads of one answer (a few dozen bytes per worker)
ZAP_DOMAIN = b"strata-kvbm"

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack holds no integer over 2**64 - 1


class PrefixQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which workers hold the leading blocks of `block_hashes`, on which tier (`KVIndex.query`)."""

    seq: U64
    block_hashes: Annotated[list[U64], msgspec.Meta(max_length=MAX_QUERY_BLOCKS)]


class PrefixAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The index's report for query `seq`, and how many events the index had applied when it answered."""

    seq: U64
    report: PrefixReport
    events_applied: int


def service_keys(secret: bytes) -> CurveKeys:
    """The CURVE keys of the query link: the service's socket is the CURVE server, every router a client."""
    return CurveKeys.derive(secret, "kvbm-service-curve-server", "kvbm-service-curve-client")
