"""How a worker process builds its KVBM agent from config (the server calls this, then hands it to the engine):

    index = KVIndex()                                   # embedded mode: the router queries this object
    connector = build_connector(KVBMConfig(...), worker_id="w0", registry=registry, index=index, model="m")
    engine = LLMEngine(engine_config, connector=connector)

`index` is any EventSink: the embedded `KVIndex`, or a transport that forwards events to the server's index. With
`config.redis_url` set and `index` None, events go to the standalone service over the Redis Stream and the worker
holds a lease there (see channel.py); with neither, events go nowhere.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from cluster.redis_link import RedisLink
from kvbm.channel import RedisWorkerChannel
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.events import EventSink
from kvbm.metrics import KVBMMetrics


def build_connector(
    config: KVBMConfig,
    worker_id: str = "worker-0",
    registry: CollectorRegistry | None = None,
    index: EventSink | None = None,
    lease_ttl_s: float = 3.0,
    metrics: KVBMMetrics | None = None,
    model: str = "",
) -> KVBMConnector:
    """`metrics` lets successive connectors of one process (a model reloaded, or several models) share one
    registry; `model` labels this connector's tier and transfer series."""
    config.validate()
    metrics = metrics if metrics is not None else KVBMMetrics(registry)
    events: EventSink | None = index
    channel: RedisWorkerChannel | None = None
    if index is None and config.redis_url:
        channel = RedisWorkerChannel(RedisLink(config.redis_url, metrics.redis_up), worker_id, lease_ttl_s)
        events = channel
    connector = KVBMConnector(config, worker_id, metrics, events, model=model)
    if channel is not None:
        channel.on_resync = connector.request_announce
    return connector
